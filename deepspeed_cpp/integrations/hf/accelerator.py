"""An ``accelerate.Accelerator`` that trains through deepspeed_cpp's engine.

accelerate has no hook for a third-party engine, so this subclass takes over the few calls the
Trainer makes on the objects it prepares: ``prepare`` builds the engine
(``deepspeed_cpp.initialize``); ``backward`` runs the engine's backward and, at the end of an
accumulation, its optimizer step (clipping, fp16 overflow checks and the LR schedule included);
``clip_grad_norm_`` reports the norm the engine clipped by; ``unwrap_model``, ``get_state_dict``
(gathered whole, ZeRO-3 included), ``save_state``/``load_state`` (the engine's checkpoint).

The Trainer keeps calling ``optimizer.step()``, ``lr_scheduler.step()`` and
``model.zero_grad()`` after ``backward``; the optimizer and scheduler it holds are views of the
engine's (``EngineOptimizer``, ``EngineScheduler``) whose ``step`` does nothing, because the
engine has already stepped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator

import deepspeed_cpp
from deepspeed_cpp import DeepSpeedEngine

from .config_filling import unresolved_auto_keys
from .process_state import ensure_cpu_process_state


def tensor_parallel_size(config: dict) -> int:
    """``tensor_parallel.autotp_size`` of a ds_config dict (1 when absent, 0 or not a number)."""
    section = config.get("tensor_parallel")
    size = section.get("autotp_size", 1) if isinstance(section, dict) else 1
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


@dataclass
class EnginePlan:
    """What ``prepare`` builds the engine from: the finished ds_config (no ``"auto"`` left) and,
    when the schedule is not the config's, the schedule: a function building it on the engine's
    optimizer, or a schedule object the caller made on their optimizer."""

    config: dict
    lr_scheduler_factory: Callable[[torch.optim.Optimizer], Any] | Any | None = None


class EngineOptimizer:
    """The Trainer's handle on the engine's optimizer: ``step``/``zero_grad`` do nothing (the
    engine steps in ``backward``); ``param_groups`` and the state are the engine's."""

    def __init__(self, engine: DeepSpeedEngine, accelerator: EngineAccelerator):
        self.engine = engine
        self._accelerator = accelerator

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def step_was_skipped(self) -> bool:
        return self._accelerator.optimizer_step_was_skipped

    def step(self, closure=None) -> None:
        """Nothing: the engine stepped at the end of the accumulation, in ``backward``."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine clears its gradients after its step."""

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()


class EngineScheduler:
    """The Trainer's handle on the engine's LR schedule: ``step`` does nothing (the engine steps
    the schedule with the optimizer, and not on a skipped fp16 step)."""

    def __init__(self, engine: DeepSpeedEngine, accelerator: EngineAccelerator):
        self.engine = engine
        self._accelerator = accelerator

    def step(self, *args, **kwargs) -> None:
        """Nothing: the engine stepped the schedule."""

    def get_last_lr(self) -> list[float]:
        """The learning rates the Trainer logs for the step just taken, as it logs them with
        DeepSpeed.

        The Trainer asks between its ``optimizer.step()`` and ``lr_scheduler.step()``. With
        DeepSpeed, accelerate hands the engine only DeepSpeed's own schedules (the config's
        ``scheduler`` section, or a caller's object whose class name is in
        ``VALID_LR_SCHEDULES``); the engine steps them inside ``backward``, so the Trainer reads
        the schedule already moved on: its ``get_last_lr()``, the rates of the next step. Any
        other schedule (the Trainer's own ``lr_scheduler_type``, a caller's torch schedule)
        accelerate keeps and the Trainer steps after reading it, so it reads the rates the step
        used: those recorded before the engine's step here (before any step: the current ones).
        Reading the recorded rates for both logged a config schedule's rates one step late
        (WarmupLR: 0.0 at step 2 where transformers with DeepSpeed logs the warmed-up rate)."""
        from ...runtime.lr_schedules import VALID_LR_SCHEDULES

        schedule = self.engine.lr_scheduler
        if schedule is not None and type(schedule).__name__ in VALID_LR_SCHEDULES:
            return list(schedule.get_last_lr())
        recorded = self._accelerator.learning_rates_of_last_step
        return list(recorded) if recorded is not None else self.engine.get_lr()

    def state_dict(self) -> dict:
        schedule = self.engine.lr_scheduler
        return schedule.state_dict() if schedule is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(state_dict)


def cpu_optimizer_for_offload(optimizer: torch.optim.Optimizer, config: dict):
    """With optimizer offload and ``zero_force_ds_cpu_optimizer`` (on by default), the engine
    accepts only a CPU optimizer; accelerate swaps the Trainer's torch optimizer for one over the
    same param groups (Adagrad -> DeepSpeedCPUAdagrad, anything else -> DeepSpeedCPUAdam, in
    AdamW mode for AdamW, with the optimizer's lr and weight decay). So does this."""
    from ...optim import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam

    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if offload.get("device", "none") == "none" or not config.get(
        "zero_force_ds_cpu_optimizer", True
    ):
        return optimizer
    defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
    if isinstance(optimizer, torch.optim.Adagrad):
        return DeepSpeedCPUAdagrad(optimizer.param_groups, **defaults)
    adamw = isinstance(optimizer, torch.optim.AdamW)
    return DeepSpeedCPUAdam(optimizer.param_groups, adamw_mode=adamw, **defaults)


class EngineAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``prepare`` wraps the model in deepspeed_cpp's engine.

    ``engine_config``: a finished ds_config dict (or call ``plan_engine`` before ``prepare``; the
    Trainer does, once it knows the step count). Mixed precision is the engine's (the config's
    fp16/bf16 sections), so accelerate's own is turned off.
    """

    def __init__(self, *args, engine_config: dict | None = None, **kwargs):
        ensure_cpu_process_state()
        kwargs["mixed_precision"] = "no"
        super().__init__(*args, **kwargs)
        self._plan = EnginePlan(engine_config) if engine_config is not None else None
        # The config's tensor_parallel.autotp_size (the Trainer sets it before data loaders are
        # prepared, which comes before the engine's plan).
        self.tensor_parallel_size = tensor_parallel_size(engine_config or {})
        self.engine: DeepSpeedEngine | None = None
        self._last_step_skipped = False
        self.learning_rates_of_last_step: list[float] | None = None

    def plan_engine(self, plan: EnginePlan) -> None:
        """Sets what the next ``prepare`` of a model builds the engine from."""
        left = unresolved_auto_keys(plan.config)
        if left:
            raise ValueError(
                f'{", ".join(repr(k) for k in left)} still "auto" when the engine is built: '
                "expected values (the Trainer fills these; outside it, set them in the config)"
            )
        self._plan = plan

    # --- prepare -----------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        modules = [a for a in args if isinstance(a, torch.nn.Module)]
        if not modules:
            return super().prepare(*args, device_placement=device_placement)
        if len(modules) > 1:
            raise ValueError(
                f"prepare got {len(modules)} models: deepspeed_cpp's engine trains one model; "
                "prepare each model with its own Accelerator"
            )
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        schedulers = [a for a in args if isinstance(a, torch.optim.lr_scheduler.LRScheduler)]
        engine = self._build_engine(
            modules[0], optimizers[0] if optimizers else None, schedulers[0] if schedulers else None
        )
        prepared = []
        for item in args:
            if isinstance(item, torch.nn.Module):
                prepared.append(engine)
            elif item is None or isinstance(item, torch.optim.Optimizer):
                # None: the Trainer's placeholder when the config brings the optimizer.
                prepared.append(EngineOptimizer(engine, self))
            elif isinstance(item, torch.optim.lr_scheduler.LRScheduler):
                prepared.append(EngineScheduler(engine, self))
            else:
                prepared.append(super().prepare(item))
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _build_engine(self, model, client_optimizer, client_scheduler) -> DeepSpeedEngine:
        if isinstance(model, DeepSpeedEngine):
            return model
        if self._plan is None:
            raise RuntimeError(
                "EngineAccelerator.prepare(model) needs a ds_config: pass "
                "EngineAccelerator(engine_config={...}) or call plan_engine() first"
            )
        config = dict(self._plan.config)
        scheduler = client_scheduler
        if scheduler is None:
            scheduler = self._plan.lr_scheduler_factory
        if client_optimizer is not None and "optimizer" in config:
            raise ValueError(
                "the ds_config has an 'optimizer' section and an optimizer was given too: "
                "expected one of them (drop the section, or pass no optimizer)"
            )
        if client_optimizer is not None:
            # A torch optimizer under ZeRO: DeepSpeed asks for this permission; the Hugging Face
            # integration grants it, as the guide says.
            config.setdefault("zero_allow_untested_optimizer", True)
            client_optimizer = cpu_optimizer_for_offload(client_optimizer, config)
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, *_ = deepspeed_cpp.initialize(
            model=model,
            optimizer=client_optimizer,
            model_parameters=trainable if client_optimizer is None else None,
            lr_scheduler=scheduler,
            config=config,
        )
        self.engine = engine
        self._models.append(engine)
        return engine

    # --- the training step ---------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.engine is None:
            return super().backward(loss, **kwargs)
        engine = self.engine
        # The Trainer decides where an accumulation ends (the last batch of an epoch may end one
        # early) and has already divided the loss for it: the engine must not divide again.
        engine.set_gradient_accumulation_boundary(self.sync_gradients)
        skipped_before = engine.skipped_steps
        engine.backward(loss, scale_wrt_gas=False)
        if self.sync_gradients:
            self.learning_rates_of_last_step = engine.get_lr()
        engine.step()
        if self.sync_gradients:
            self._last_step_skipped = engine.skipped_steps > skipped_before

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the engine skipped the last optimizer step (fp16 overflow, NaN/inf)."""
        if self.engine is None:
            return super().optimizer_step_was_skipped
        return self._last_step_skipped

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clipped at its step (``gradient_clipping``); returns the global gradient
        norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else torch.tensor(float(norm))

    @contextlib.contextmanager
    def no_sync(self, model):
        # The engine reduces gradients at accumulation boundaries only.
        yield

    # --- the model and its state ---------------------------------------------------------------
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, DeepSpeedEngine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True) -> dict:
        """The whole model's state dict on rank 0 (``{}`` elsewhere), gathered from the shards
        under ZeRO-3. Collective: every rank calls it."""
        engine = self._engine_of(model)
        if engine is None:
            return super().get_state_dict(model, unwrap)
        return engine.whole_model_state_dict(rank0_only=True)

    def save_state(self, output_dir: str | None = None, **kwargs) -> str:
        """The engine's checkpoint (model, optimizer, schedule, loss scale) in ``output_dir``:
        ``global_step<N>/`` and ``latest``. Collective."""
        if self.engine is None:
            return super().save_state(output_dir, **kwargs)
        if output_dir is None:
            raise ValueError("save_state(output_dir=None): expected the folder to save into")
        self.engine.save_checkpoint(output_dir)
        return output_dir

    def load_state(self, input_dir: str | None = None, **kwargs) -> None:
        """Restores the engine's checkpoint from ``input_dir`` (its ``latest``). Collective."""
        if self.engine is None:
            return super().load_state(input_dir, **kwargs)
        path, _ = self.engine.load_checkpoint(input_dir)
        if path is None:
            raise FileNotFoundError(
                f"load_state({input_dir!r}): no 'latest' file there: expected a folder written "
                "by save_state or the Trainer's checkpoint-N"
            )

    def _prepare_device_mesh(self):
        """Under tensor parallelism the ranks of a TP group read the same batches: accelerate
        shards data loaders by the (dp_replicate, tp) mesh it is given here, TP ranks
        consecutive as the engine's groups (``runtime/tensor_parallel/groups.py``)."""
        tp_size = self.tensor_parallel_size
        if tp_size <= 1:
            return super()._prepare_device_mesh()
        if getattr(self, "_tensor_parallel_mesh", None) is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._tensor_parallel_mesh = init_device_mesh(
                self.device.type,
                (self.num_processes // tp_size, tp_size),
                mesh_dim_names=("dp_replicate", "tp"),
            )
        return self._tensor_parallel_mesh

    def free_memory(self, *objects):
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        return super().free_memory(*objects)

    def _engine_of(self, model) -> DeepSpeedEngine | None:
        if isinstance(model, DeepSpeedEngine):
            return model
        if self.engine is not None and model is self.engine.module:
            return self.engine
        return None
