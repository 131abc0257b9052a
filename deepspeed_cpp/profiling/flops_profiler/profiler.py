"""The flops profiler: per-module parameters, MACs, FLOPs and forward latency of a model, printed
as DeepSpeed's ``print_model_profile`` prints them.

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions,
attention, ... whatever torch's registry counts), one counter per module entered in its forward
pre-hook and left in its forward hook, so a module's count holds its children's and backward is
never counted (DeepSpeed reports forward FLOPs). torch's module tracker is not used for the
attribution: it names only modules whose forward began after the counter was entered. CPU
attention (``_scaled_dot_product_flash_attention_for_cpu``) is mapped to torch's own attention
formula, which its registry lists only for the GPU kernels. MACs are half the FLOPs (every op
torch counts is multiply-accumulate based). Elementwise work (activations, bias adds,
normalisation) is not counted, since torch does not count it; DeepSpeed's hand-written
formulas add it, so its totals are a little higher for the same net.
"""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from .units import duration_to_string, flops_to_string, macs_to_string, params_to_string


def _synchronize() -> None:
    from ...accelerator import get_accelerator

    get_accelerator().synchronize()


def _extra_formulas() -> dict:
    aten = torch.ops.aten
    extra = {}
    cpu_attention = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if cpu_attention is not None and cpu_attention not in flop_counter.flop_registry:
        shaped = flop_counter.sdpa_flop  # already takes tensors (torch wrapped it for shapes)

        def cpu_attention_flops(*args, **kwargs):
            return shaped(*args, **kwargs)

        cpu_attention_flops._get_raw = True  # FlopCounterMode must not wrap it a second time
        extra[cpu_attention] = cpu_attention_flops
    return extra


@functools.cache
def _warm_up_counting() -> None:
    """The first op counted in a process pays for torch's one-time set-up (about a second on a
    CPU); paid here, it does not land in the first profiled module's latency."""
    with FlopCounterMode(display=False, custom_mapping=_extra_formulas()):
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))
        torch.nn.functional.conv2d(torch.ones(1, 1, 3, 3), torch.ones(1, 1, 1, 1))


def _numel(param: torch.nn.Parameter) -> int:
    return int(getattr(param, "ds_numel", param.numel()))  # ZeRO-3: the whole parameter's


class FlopsProfiler:
    """Profiles ``model``'s forward passes between ``start_profile`` and ``stop_profile``."""

    def __init__(self, model: torch.nn.Module, ds_engine=None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self._handles: list = []
        self._counters: dict[int, list[FlopCounterMode]] = defaultdict(list)
        self._flops: dict[int, int] = defaultdict(int)
        self._duration: dict[int, float] = defaultdict(float)
        self._starts: dict[int, list[float]] = defaultdict(list)

    # --- DeepSpeed's API ------------------------------------------------------------------------
    def start_profile(self, ignore_list=None) -> None:
        self.reset_profile()
        _warm_up_counting()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre_forward))
            self._handles.append(module.register_forward_hook(self._post_forward))
        self.started = True

    def stop_profile(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.started = False

    def reset_profile(self) -> None:
        self._flops.clear()
        self._duration.clear()
        self._starts.clear()

    def end_profile(self) -> None:
        self.stop_profile()
        self.reset_profile()

    def get_total_flops(self, as_string: bool = False):
        flops = self._module_flops(self.model)
        return flops_to_string(flops).replace("FLOPS", "FLOPs") if as_string else flops

    def get_total_macs(self, as_string: bool = False):
        macs = self._module_flops(self.model) // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False):
        duration = self._duration.get(id(self.model), 0.0)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False):
        params = self._module_params(self.model)
        return params_to_string(params) if as_string else params

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
        *,
        phase_seconds: dict[str, float] | None = None,
    ) -> str:
        """``phase_seconds`` (the engine's profiled step: "fwd", "bwd", "step") adds DeepSpeed's
        engine lines: latencies, FLOPS per phase and samples/second."""
        from .report import model_profile_text

        text = model_profile_text(
            self, profile_step, module_depth, top_modules, detailed, phase_seconds
        )
        if output_file:
            with open(output_file, "w") as file:
                file.write(text)
        else:
            print(text, file=sys.stdout, flush=True)
        return text

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1):
        from .report import aggregated_profile_text

        text = aggregated_profile_text(self, module_depth, top_modules)
        print(text, flush=True)
        return text

    # --- per module -----------------------------------------------------------------------------
    def _module_flops(self, module: torch.nn.Module) -> int:
        return int(self._flops.get(id(module), 0))

    def _module_params(self, module: torch.nn.Module) -> int:
        return sum(_numel(p) for p in module.parameters())

    def _module_duration(self, module: torch.nn.Module) -> float:
        return self._duration.get(id(module), 0.0)

    # --- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, module, inputs) -> None:
        counter = FlopCounterMode(display=False, custom_mapping=_extra_formulas())
        counter.__enter__()
        self._counters[id(module)].append(counter)
        _synchronize()
        self._starts[id(module)].append(time.perf_counter())

    def _post_forward(self, module, inputs, output) -> None:
        _synchronize()
        starts = self._starts[id(module)]
        if starts:
            self._duration[id(module)] += time.perf_counter() - starts.pop()
        counters = self._counters[id(module)]
        if counters:
            counter = counters.pop()
            counter.__exit__(None, None, None)
            self._flops[id(module)] += counter.get_total_flops()


def get_model_profile(
    model: torch.nn.Module,
    input_shape=None,
    args=None,
    kwargs=None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules=None,
    mode: str = "forward",
):
    """Runs ``model`` (on a random batch of ``input_shape``, or on ``args``/``kwargs``) ``warm_up``
    times unprofiled, then once profiled; returns ``(flops, macs, params)``, as strings with
    ``as_string``. ``mode="generate"`` profiles ``model.generate``."""
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or len(input_shape) < 1:
            raise ValueError("input_shape must be a tuple of at least one dimension")
        parameter = next(model.parameters(), None)
        where = (
            {"device": parameter.device, "dtype": parameter.dtype} if parameter is not None else {}
        )
        args = [torch.randn(*input_shape, **where)]
    if mode not in ("forward", "generate"):
        raise NotImplementedError(f"mode {mode!r}: expected 'forward' or 'generate'")
    run = model if mode == "forward" else model.generate
    profiler = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        profiler.start_profile(ignore_list=ignore_modules)
        run(*args, **kwargs)
    flops, macs, params = (
        profiler.get_total_flops(),
        profiler.get_total_macs(),
        profiler.get_total_params(),
    )
    if print_profile:
        profiler.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    profiler.end_profile()
    if as_string:
        return (
            flops_to_string(flops).replace("FLOPS", "FLOPs"),
            macs_to_string(macs),
            params_to_string(params),
        )
    return flops, macs, params
