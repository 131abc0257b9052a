"""Jobs for tests/test_pipe.py: a pipeline trained over real gloo ranks beside the same model
trained in this process on the same global batches (the reference every rank computes itself)."""

from __future__ import annotations

import functools

import torch
from torch import nn

WIDTH = 8


def _tied_output(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight  # the embedding reused transposed, as an output projection


def layer_specs(tied: bool, dropout: float = 0.0):
    from deepspeed_cpp.pipe import LayerSpec, TiedLayerSpec

    body = [
        LayerSpec(nn.Linear, WIDTH, 16),
        nn.Tanh(),
        LayerSpec(nn.Linear, 16, 16),
        nn.Dropout(dropout),
        LayerSpec(nn.Linear, 16, WIDTH),
        torch.tanh,
    ]
    if not tied:
        return [*body, LayerSpec(nn.Linear, WIDTH, 3)]
    embed = TiedLayerSpec("embed", nn.Linear, WIDTH, WIDTH, bias=False)
    head = TiedLayerSpec("embed", nn.Linear, WIDTH, WIDTH, bias=False, forward_fn=_tied_output)
    return [embed, *body, head]


class Reference(nn.Module):
    """The whole pipeline in one module, its parameters named as the stages name theirs
    (``<layer index>.<name>``, ``tied_modules.<key>.<name>``), built with the same seeds."""

    def __init__(self, specs, base_seed: int):
        from deepspeed_cpp.pipe import LayerSpec, TiedLayerSpec

        super().__init__()
        self.layers = nn.ModuleDict()
        self.tied_modules = nn.ModuleDict()
        self.funcs = []
        for index, spec in enumerate(specs):
            torch.manual_seed(base_seed + index)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                fn = (
                    module
                    if spec.forward_fn is None
                    else functools.partial(spec.forward_fn, module)
                )
                self.funcs.append(fn)
            elif isinstance(spec, LayerSpec):
                self.layers[str(index)] = spec.build()
                self.funcs.append(self.layers[str(index)])
            else:
                self.funcs.append(spec)

    def forward(self, x):
        for fn in self.funcs:
            x = fn(x)
        return x

    def named_state(self) -> dict[str, torch.Tensor]:
        state = {
            k[len("layers.") :]: v for k, v in self.state_dict().items() if k.startswith("layers.")
        }
        state.update({k: v for k, v in self.state_dict().items() if k.startswith("tied_modules.")})
        return state


def loss_fn(outputs, labels):
    if outputs.shape[-1] == labels.shape[-1]:
        return nn.functional.mse_loss(outputs, labels)
    return nn.functional.mse_loss(outputs[..., : labels.shape[-1]], labels)


def make_batches(seed: int, steps: int, replicas: int, micro_batches: int, micro: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            [
                (
                    torch.randn(micro, WIDTH, generator=generator),
                    torch.randn(micro, 3, generator=generator),
                )
                for _ in range(micro_batches)
            ]
            for _ in range(replicas)
        ]
        for _ in range(steps)
    ]


def _config(micro_batches: int, replicas: int, clip: float, zero_stage: int, precision="fp32"):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": 4 * micro_batches * replicas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":  # the scale stays 2^8: no overflow in these few steps
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return config


def _schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def train_equals_one_process(
    seed: int,
    steps: int,
    micro_batches: int,
    tied: bool,
    clip: float,
    zero_stage: int,
    stages=2,
    slices=1,
) -> dict:
    """Trains ``stages`` stages x (world / stages / slices) replicas and the reference on the
    same batches; returns the largest differences (losses, parameters, eval loss and logits).
    ``slices`` > 1: a tensor-parallel axis (PipeModelDataParallelTopology) whose ranks all hold
    the same unsplit layers and see the same batches, as replicated parameters of a
    tensor-parallel stage do."""
    import torch.distributed as dist

    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule
    from deepspeed_cpp.runtime.pipe.topology import PipeModelDataParallelTopology

    torch.set_default_dtype(torch.float32)
    replicas = dist.get_world_size() // (stages * slices)
    base_seed = seed % 10_000
    specs = layer_specs(tied)
    layout = {"num_stages": stages}
    if slices > 1:
        topology = PipeModelDataParallelTopology(num_pp=stages, num_mp=slices, num_dp=replicas)
        layout = {"topology": topology}
    pipe = PipelineModule(
        specs,
        **layout,
        loss_fn=loss_fn,
        partition_method="uniform",
        seed_layers=True,
        base_seed=base_seed,
    )
    reference = Reference(layer_specs(tied), base_seed)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(
        model=pipe,
        optimizer=optimizer,
        lr_scheduler=_schedule,
        config=_config(micro_batches, replicas, clip, zero_stage),
    )
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_schedule = _schedule(ref_optimizer)

    start = {k: v.clone() for k, v in pipe.state_dict().items()}
    ref_start = reference.named_state()
    start_diff = max((start[k] - ref_start[k]).abs().max().item() for k in start)

    batches = make_batches(seed, steps, replicas, micro_batches)
    replica = engine.grid.get_data_parallel_id()
    loss_diff = 0.0
    for step in range(steps):
        loss = engine.train_batch(iter(batches[step][replica]))
        ref_optimizer.zero_grad()
        ref_losses = []
        for replica_batches in batches[step]:
            for x, y in replica_batches:
                ref_loss = loss_fn(reference(x), y)
                (ref_loss / (micro_batches * replicas)).backward()
                ref_losses.append(ref_loss.detach())
        if clip > 0:
            nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_optimizer.step()
        ref_schedule.step()
        loss_diff = max(loss_diff, abs(loss.item() - torch.stack(ref_losses).mean().item()))

    ref_state = reference.named_state()
    param_diff = max((v - ref_state[k]).abs().max().item() for k, v in pipe.state_dict().items())
    eval_data = make_batches(seed + 1, 1, replicas, micro_batches)[0][replica]
    eval_loss, logits = engine.eval_batch(iter(eval_data), return_logits=True)
    with torch.no_grad():
        ref_eval = torch.stack(
            [
                loss_fn(reference(x), y)
                for r in make_batches(seed + 1, 1, replicas, micro_batches)[0]
                for x, y in r
            ]
        ).mean()
        ref_logits = reference(eval_data[-1][0])
    logits_diff = (logits - ref_logits).abs().max().item() if engine.is_last_stage() else 0.0
    return {
        "stage": engine.stage_id,
        "start": start_diff,
        "loss": loss_diff,
        "params": param_diff,
        "eval": abs(eval_loss.item() - ref_eval.item()),
        "logits": logits_diff,
        "names": sorted(pipe.state_dict()),
        "lr": engine.get_lr()[0],
        "ref_lr": ref_optimizer.param_groups[0]["lr"],
        "moved": max((start[k] - v).abs().max().item() for k, v in pipe.state_dict().items()),
    }


def _error_of(function) -> str:
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"


def bad_input_errors() -> dict[str, str]:
    """Each misuse the issue names, on 2 ranks; returns the error each raised."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import LayerSpec, PipelineModule

    errors = {
        "stages_not_dividing": _error_of(lambda: PipelineModule(layer_specs(False), num_stages=3)),
        "more_stages_than_layers": _error_of(
            lambda: PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=2)
        ),
        "partition_no_match": _error_of(
            lambda: PipelineModule(layer_specs(False), num_stages=2, partition_method="type:Conv")
        ),
        "partition_unknown": _error_of(
            lambda: PipelineModule(layer_specs(False), num_stages=2, partition_method="random")
        ),
        "layerspec_not_module": _error_of(lambda: LayerSpec(len, 3)),
        "partition_profile": _error_of(
            lambda: PipelineModule(layer_specs(False), num_stages=2, partition_method="profile")
        ),
    }
    config = _config(2, 1, 0.0, 0)
    errors["zero2"] = _error_of(
        lambda: deepspeed.initialize(
            model=PipelineModule(layer_specs(False), num_stages=2, loss_fn=loss_fn),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            config={**config, "zero_optimization": {"stage": 2}},
        )
    )
    errors["config_stages"] = _error_of(
        lambda: deepspeed.initialize(
            model=PipelineModule(layer_specs(False), num_stages=2, loss_fn=loss_fn),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            config={**config, "pipeline": {"stages": 4}},
        )
    )
    pipe = PipelineModule(layer_specs(False), num_stages=2, loss_fn=loss_fn)
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1), config=config
    )
    errors["forward"] = _error_of(lambda: engine(torch.zeros(4, WIDTH)))
    errors["backward"] = _error_of(lambda: engine.backward(torch.zeros(())))
    errors["step"] = _error_of(lambda: engine.step())
    one_micro_batch = make_batches(0, 1, 1, 1)[0][0]
    errors["exhausted"] = _error_of(lambda: engine.train_batch(iter(one_micro_batch)))
    # Only stage 0's iterator runs out: the last stage (which has data) stops too, at once.
    uneven = make_batches(2, 1, 1, 2)[0][0][: 1 if engine.is_first_stage() else 2]
    errors["exhausted_stage0"] = _error_of(lambda: engine.train_batch(iter(uneven)))
    # After a refused batch the pipeline still trains (nothing was sent).
    loss = engine.train_batch(iter(make_batches(1, 1, 1, 2)[0][0]))
    errors["after"] = f"loss {float(loss):.4f}"
    plain = nn.Linear(2, 2)
    plain_engine, *_ = deepspeed.initialize(
        model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        config={"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 1},
    )  # fmt: skip
    errors["train_batch_plain"] = _error_of(lambda: plain_engine.train_batch(iter([])))
    return errors


def checkpointing_changes_nothing(seed: int, steps: int) -> dict:
    """The same pipeline with dropout trained with and without activation checkpointing
    (interval 1): the recomputed forwards replay the RNG, so the weights must be bitwise equal."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    states, losses = [], []
    for interval in (0, 1):
        torch.manual_seed(seed)
        pipe = PipelineModule(
            layer_specs(False, dropout=0.3),
            num_stages=2,
            loss_fn=loss_fn,
            partition_method="uniform",
        )
        if interval:
            pipe.load_state_dict(states[0][0])  # the same start
        # The interval from the config's pipeline section, which overrides the module's (0).
        config = {**_config(3, 1, 0.0, 0), "pipeline": {"activation_checkpoint_interval": interval}}
        engine, *_ = deepspeed.initialize(
            model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1), config=config
        )
        assert pipe.activation_checkpoint_interval == interval
        start = {k: v.clone() for k, v in pipe.state_dict().items()}
        torch.manual_seed(seed + 1)  # the dropout masks' stream
        run = [engine.train_batch(iter(b[0])).item() for b in make_batches(seed, steps, 1, 3)]
        states.append((start, {k: v.clone() for k, v in pipe.state_dict().items()}))
        losses.append(run)
    (start0, end0), (start1, end1) = states
    return {
        "same_start": all(torch.equal(start0[k], start1[k]) for k in start0),
        "same_end": all(torch.equal(end0[k], end1[k]) for k in end0),
        "losses": losses,
        "moved": max((start0[k] - end0[k]).abs().max().item() for k in end0),
    }


def checkpoint_resume(seed: int, directory: str, stages_after: int) -> dict:
    """Trains 2 stages 2 steps, saves, trains 2 more; then a fresh engine of ``stages_after``
    stages loads the checkpoint and trains the same 2 steps again. At 2 stages the weights must
    be bitwise those of the uninterrupted run. At 1 stage (2 replicas; the optimizer state
    re-cut) its loaded weights must equal the saved ones, its eval loss the 2-stage one's and
    its weights after the 2 steps the uninterrupted run's (within 1e-6)."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    def build(stages: int):
        pipe = PipelineModule(
            layer_specs(True), num_stages=stages, loss_fn=loss_fn, partition_method="uniform",
            seed_layers=True, base_seed=seed % 1000,
        )  # fmt: skip
        engine, *_ = deepspeed.initialize(
            model=pipe,
            optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-2),
            lr_scheduler=_schedule,
            # The same global batch of 2 micro-batches: 2 stages x 1 replica x 2 micro-batches
            # or 1 stage x 2 replicas x 1 micro-batch each.
            config=_config(stages, 2 // stages, 0.05, 0),
        )
        return pipe, engine

    def state(pipe) -> dict:
        return {k: v.clone() for k, v in pipe.state_dict().items()}

    batches = make_batches(seed, 4, 1, 2)
    eval_data = make_batches(seed + 1, 1, 1, 2)[0][0]
    pipe, engine = build(2)
    for step in range(2):
        engine.train_batch(iter(batches[step][0]))
    saved = state(pipe)
    saved_eval = engine.eval_batch(iter(eval_data)).item()
    engine.save_checkpoint(directory, client_state={"epoch": 7})
    consolidated = {}
    if stages_after == 2:
        from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        consolidated = get_fp32_state_dict_from_zero_checkpoint(directory)
        plain = Reference(layer_specs(True), 0)
        plain_engine, *_ = deepspeed.initialize(
            model=plain, optimizer=torch.optim.Adam(plain.parameters()),
            config={"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 4},
        )  # fmt: skip
        plain_error = _error_of(lambda: plain_engine.load_checkpoint(directory))
    for step in range(2, 4):
        engine.train_batch(iter(batches[step][0]))
    uninterrupted = state(pipe)

    torch.manual_seed(seed + 99)  # other initial weights: everything must come from the file
    pipe2, engine2 = build(stages_after)
    path, client = engine2.load_checkpoint(directory)
    loaded = state(pipe2)
    result = {"client": client, "steps": engine2.global_steps, "path_ok": path is not None,
              "names": sorted(saved)}  # fmt: skip
    if stages_after == 2:
        # fp32 training: the consolidated masters are the stage's weights, bitwise.
        result["fp32_names"] = sorted(consolidated)
        result["fp32_bitwise"] = all(
            consolidated[k].dtype == torch.float32 and torch.equal(consolidated[k], v)
            for k, v in saved.items()
        )
        result["plain_error"] = plain_error
        result["loaded_bitwise"] = all(torch.equal(loaded[k], saved[k]) for k in saved)
        for step in range(2, 4):
            engine2.train_batch(iter(batches[step][0]))
        resumed = state(pipe2)
        result["resumed_bitwise"] = all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    else:
        # 1 stage holds every layer under the same names; compare those this rank saved. Each
        # replica takes its micro-batch of the same global batches.
        result["loaded_diff"] = max((loaded[k] - v).abs().max().item() for k, v in saved.items())
        share = slice(engine2.dp_rank, engine2.dp_rank + 1)
        eval_one = engine2.eval_batch(iter(eval_data[share])).item()
        result["eval_diff"] = abs(eval_one - saved_eval)
        # Adam's moments and step carried over (a fresh Adam's first steps move each weight by
        # about the learning rate, far from the uninterrupted run).
        result["adam_steps"] = sorted(
            {int(s["step"]) for s in engine2.optimizer.state.values() if "step" in s}
        )
        for step in range(2, 4):
            engine2.train_batch(iter(batches[step][0][share]))
        resumed = state(pipe2)
        result["resumed_diff"] = max(
            (resumed[k] - v).abs().max().item() for k, v in uninterrupted.items()
        )
    return result


def load_error(seed: int, directory: str) -> str:
    """The error a 2-stage engine raises loading ``directory``."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    pipe = PipelineModule(
        layer_specs(True), num_stages=2, loss_fn=loss_fn, partition_method="uniform"
    )
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.Adam(pipe.parameters()), config=_config(2, 1, 0.0, 0)
    )
    return _error_of(lambda: engine.load_checkpoint(directory))


# Half precisions: (dtype, mantissa bits, the engine's loss scale).
HALF = {"bf16": (torch.bfloat16, 7, 1.0), "fp16": (torch.float16, 10, 2.0**8)}


def half_precision_equals_one_process(
    seed: int, steps: int, micro_batches: int, directory: str, precision: str = "bf16"
) -> dict:
    """2 stages, bf16 (ZeRO-1) or fp16 (ZeRO-0, a static-start loss scale of 2^8), Adam: beside
    the same half-precision model in one process whose (scaled) gradients are summed in float32
    over the micro-batches, unscaled and stepped on float32 masters (as the engine does).
    Returns the largest differences relative to the dtype's unit in the last place, and how
    zero_to_fp32 of a checkpoint saved at the end compares with the reference's fp32 masters."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    dtype, mantissa, loss_scale = HALF[precision]
    base_seed = seed % 10_000
    pipe = PipelineModule(layer_specs(False), num_stages=2, loss_fn=loss_fn,
                          partition_method="uniform", seed_layers=True,
                          base_seed=base_seed)  # fmt: skip
    config = _config(micro_batches, 1, 0.0, 1 if precision == "bf16" else 0, precision)
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-2), config=config
    )
    reference = Reference(layer_specs(False), base_seed).to(dtype)
    names = list(reference.named_state())
    params = dict(reference.named_parameters())
    ref_params = [params["layers." + n] for n in names]
    masters = [p.detach().float().clone() for p in ref_params]
    ref_optimizer = torch.optim.Adam(masters, lr=1e-2)
    start = {k: v.clone() for k, v in pipe.state_dict().items()}
    loss_ratio = 0.0
    for batch in make_batches(seed, steps, 1, micro_batches):
        loss = engine.train_batch(iter(batch[0]))
        sums = [torch.zeros_like(m) for m in masters]
        ref_losses = []
        for x, y in batch[0]:
            reference.zero_grad()
            ref_loss = loss_fn(reference(x.to(dtype)), y)
            (ref_loss * (1.0 / micro_batches * loss_scale)).backward()
            ref_losses.append(ref_loss.detach().float())
            for total, p in zip(sums, ref_params):
                total += p.grad.float()
        for master, total in zip(masters, sums):
            master.grad = total * (1.0 / loss_scale)  # a power of 2: exact
        ref_optimizer.step()
        with torch.no_grad():
            for p, master in zip(ref_params, masters):
                p.copy_(master)
        ref_loss = torch.stack(ref_losses).mean()
        loss_ratio = max(loss_ratio, abs(loss.item() - ref_loss.item()) / ref_loss.abs().item())
    engine.save_checkpoint(directory)
    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(directory)
    ref_masters = dict(zip(names, masters))
    ref_state = dict(zip(names, ref_params))
    ulps, dtypes = 0.0, set()
    for name, value in pipe.state_dict().items():
        ref = ref_state[name].float()
        dtypes.add(str(value.dtype))
        # The dtype's spacing at each reference element: 2^(exponent - mantissa bits).
        spacing = torch.ldexp(torch.ones_like(ref), torch.frexp(ref)[1] - 1 - mantissa)
        ulps = max(ulps, ((value.float() - ref).abs() / spacing).max().item())
    return {
        "fp32_names": sorted(consolidated) == sorted(names),
        "fp32_dtypes": sorted({str(v.dtype) for v in consolidated.values()}),
        "fp32_diff": max((consolidated[k] - v).abs().max().item() for k, v in ref_masters.items()),
        # Masters, not the bf16 weights widened: some element must differ from its bf16 copy.
        "fp32_not_widened": any(
            not torch.equal(v, v.to(dtype).float()) for v in consolidated.values()
        ),
        "dtypes": sorted(dtypes),
        "ulps": ulps,
        "loss_ratio": loss_ratio,
        "loss_scale": engine.get_loss_scale() if precision == "fp16" else None,
        "moved": max(
            (start[k].float() - v.float()).abs().max().item() for k, v in pipe.state_dict().items()
        ),  # fmt: skip
    }


def fp16_overflow_skips_every_stage(seed: int) -> dict:
    """2 stages, fp16 with a dynamic loss scale; in the second batch one gradient of stage 0
    only becomes inf. Every stage must skip that step (weights unchanged, the scale halved,
    the same on both stages) and train on after it."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    torch.manual_seed(seed)
    pipe = PipelineModule(layer_specs(False), num_stages=2, loss_fn=loss_fn,
                          partition_method="uniform")  # fmt: skip
    config = _config(2, 1, 0.0, 0)
    config["fp16"] = {
        "enabled": True,
        "initial_scale_power": 8,
        "loss_scale_window": 1000,
        "hysteresis": 1,
    }  # halve at the first overflow
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-2), config=config
    )
    poison = {"on": False}
    if engine.is_first_stage():
        first = next(pipe.parameters())
        first.register_hook(lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)

    def state() -> dict:
        return {k: v.clone() for k, v in pipe.state_dict().items()}

    batches = make_batches(seed, 3, 1, 2)
    scales, changed = [], []
    for step, batch in enumerate(batches):
        poison["on"] = step == 1
        before = state()
        engine.train_batch(iter(batch[0]))
        scales.append(engine.get_loss_scale())
        changed.append(any(not torch.equal(before[k], v) for k, v in pipe.state_dict().items()))
    return {
        "stage": engine.stage_id,
        "scales": scales,
        "changed": changed,
        "skipped": engine.skipped_steps,
        "steps": engine.global_steps,
        "dtypes": sorted({str(v.dtype) for v in pipe.state_dict().values()}),
    }
