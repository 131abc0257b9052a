"""DeepSpeedEngine: the nn.Module a training script drives with forward, backward and step."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from ..comm.collective_errors import named_collective
from ..comm.logging_api import configure as configure_comms_logger
from ..utils import groups as moe_groups
from ..utils.logging import logger
from .call_order import CallOrder, refuse_foreign_parameters
from .config import DeepSpeedConfig
from .config_optimizer import config_optimizer_factory
from .dataloader import make_distributed_loader
from .engine_refusals import (
    refuse_expert_parallel_with,
    refuse_param_offload_alone,
    refuse_partitioned_parameters,
    refuse_zero3_with_model_parallelism,
    release_previous_engine,
)
from .failed_step import FailedStepGuard
from .half_inputs import cast_floating_to_half
from .loss_scaler import make_loss_scaler
from .lr_schedules import build_lr_scheduler
from .model_parallel import ModelParallelGroups
from .nonfinite_gradients import raise_if_asked, report_skipped_step
from .training_report import TrainingReport
from .zero.moe_stage import (
    DENSE,
    ExpertParallelZeroStage,
    expert_set_of,
    needs_expert_sets,
)
from .zero.offload.host_heap import give_back_free_heap
from .zero.offload.optimizer_offload import OptimizerOffload, ParamOffload
from .zero.partitioned_optimizer import ZeroPartitionedOptimizer


def _initial_broadcast_label(
    index: int, count: int, tensor: torch.Tensor, key
) -> Callable[[], str]:
    """Names one broadcast of initialize(); formatted only if that broadcast fails."""
    where = "" if key == DENSE else f", expert set {key}"
    return lambda: (
        f"broadcast of the initial weights in initialize() (tensor {index} of {count}, "
        f"shape {list(tensor.shape)}{where})"
    )


class DeepSpeedEngine(torch.nn.Module):
    """Wraps the user's module; ``backward`` and ``step`` run ZeRO stage 0, 1, 2 or 3.

    ``step()`` is called after every micro-batch, as with DeepSpeed: it steps the optimizer only
    at gradient-accumulation boundaries and otherwise just counts the micro-step.
    """

    def __init__(
        self,
        *,
        args=None,
        model: torch.nn.Module,
        optimizer=None,
        model_parameters=None,
        training_data=None,
        lr_scheduler=None,
        config: DeepSpeedConfig,
        collate_fn=None,
        mpu=None,
    ):
        super().__init__()
        if model is None:
            raise ValueError("deepspeed_cpp.initialize needs model=<torch.nn.Module>")
        self.config = config
        # Data parallelism runs over the mpu's data-parallel group (the world without an mpu):
        # gradients are reduced, ZeRO state sharded and checkpoints written over it
        # (model_parallel.py).
        self.mpu = mpu
        self.parallel = ModelParallelGroups.from_mpu(mpu)
        self.group = self.parallel.dp_group
        self.dp_rank, self.dp_world_size = self.parallel.dp_rank, self.parallel.dp_world_size
        self.mp_rank, self.mp_world_size = self.parallel.mp_rank, self.parallel.mp_world_size
        self.global_rank = dist.get_rank()
        # Before any collective: a monitor whose package is missing fails on every rank alike.
        self._report = TrainingReport(config, self.global_rank)
        self.monitor, self.timers = self._report.monitor, self._report.timers
        configure_comms_logger(config)  # before the first collective it should count
        self.world_size = dist.get_world_size()
        # DeepSpeed's launcher passes --local_rank; torchrun sets LOCAL_RANK.
        from_args = getattr(args, "local_rank", None)
        if from_args is not None and int(from_args) >= 0:
            self.local_rank = int(from_args)
        else:
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        accelerator = get_accelerator()
        if accelerator.device_name() != "cpu":
            accelerator.set_device(self.local_rank)
        self.device = torch.device(accelerator.device_name(self.local_rank))

        release_previous_engine(model)
        self._expert_parallel = needs_expert_sets(model.parameters())
        if self._expert_parallel:
            refuse_expert_parallel_with(config, self.mp_world_size)
        refuse_zero3_with_model_parallelism(config, self.mp_world_size)
        self._is_boundary_override: bool | None = None
        self.module = model
        if self.zero_optimization_stage() < 3:
            refuse_partitioned_parameters(model, self.zero_optimization_stage())
            self.module.to(self.device)
            if self.fp16_enabled():
                self.module.half()
            elif self.bfloat16_enabled():
                self.module.bfloat16()
            self._broadcast_module_from_rank0()

        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._failed_step = FailedStepGuard()
        self._call_order = CallOrder(self.module)
        self._last_log = (time.perf_counter(), 0)

        self.loss_scaler = make_loss_scaler(config.fp16) if self.fp16_enabled() else None
        stage = self._configure_zero_optimizer(optimizer, model_parameters)
        self._zero_stage = stage  # at ZeRO-3 also without an optimizer: it gathers parameters
        self.optimizer = stage if stage is not None and stage.trains else None
        self.lr_scheduler = self._configure_lr_scheduler(lr_scheduler)
        self.training_dataloader = (
            make_distributed_loader(
                training_data,
                batch_size=self.train_micro_batch_size_per_gpu(),
                rank=self.dp_rank,
                world_size=self.dp_world_size,
                collate_fn=collate_fn,
                drop_last=bool(config.dataloader_drop_last),
            )
            if training_data is not None
            else None
        )
        if self.global_rank == 0:
            logger.info(
                "deepspeed_cpp: engine ready: ZeRO stage %d, %s, world size %d%s, micro batch %d, "
                "gradient accumulation %d%s",
                self.zero_optimization_stage(),
                "fp16" if self.fp16_enabled() else "bf16" if self.bfloat16_enabled() else "fp32",
                self.world_size,
                (
                    f" (data parallel {self.dp_world_size} x model parallel {self.mp_world_size})"
                    if self.mpu is not None
                    else ""
                ),
                self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps(),
                f", {self.optimizer.describe()}" if self.optimizer is not None else "",
            )
        model._deepspeed_cpp_engine = weakref.ref(self)
        give_back_free_heap()  # what set-up freed in glibc's heap, where the engine swaps

    # --- construction -------------------------------------------------------------------------
    def _broadcast_module_from_rank0(self) -> None:
        """Every rank starts from its data-parallel group's first rank's weights and buffers, as
        data parallelism requires (model-parallel ranks hold other parts: not broadcast)."""
        if self.dp_world_size == 1:
            return
        source = self.parallel.broadcast_src
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        with torch.no_grad():
            for index, tensor in enumerate(tensors):
                key = expert_set_of(tensor) if isinstance(tensor, torch.nn.Parameter) else DENSE
                what = _initial_broadcast_label(index, len(tensors), tensor, key)
                with named_collective(what):
                    if key == DENSE:
                        dist.broadcast(tensor.data, src=source, group=self.group)
                    else:
                        # ep_size > 1 experts differ between expert-parallel ranks: each is a
                        # replica only within its expert-data-parallel group, whose first
                        # rank's copy every member starts from.
                        dist.broadcast(
                            tensor.data,
                            src=moe_groups._get_expert_broadcast_src_rank(key),
                            group=moe_groups._get_expert_data_parallel_group(key),
                        )

    def _configure_zero_optimizer(self, client_optimizer, model_parameters):
        config_optimizer = self.config.optimizer
        if client_optimizer is not None and config_optimizer is not None:
            raise ValueError(
                "an optimizer was passed to initialize() and the config has an 'optimizer' "
                "section too; keep one of them"
            )
        zero = self.config.zero_optimization
        offload = OptimizerOffload.from_config(
            zero, self.config.aio, self.config.step_during_backward_setting()
        )
        # Offloaded master shards are stepped on the host: the config optimizer is a CPU one.
        optimizer_device = self.device if offload is None else torch.device("cpu")
        if zero.stage == 3:
            return self._configure_stage3(
                client_optimizer, model_parameters, offload, optimizer_device
            )
        common = dict(
            stage=zero.stage,
            group=self.group,
            reduce_bucket_size=int(zero.reduce_bucket_size),
            reduce_scatter=zero.reduce_scatter,
            gradient_clipping=self.config.gradient_clipping,
            loss_scaler=self.loss_scaler,
            offload=offload,
            device_optimizer=self._device_part_optimizer(offload),
        )
        if self.mp_world_size > 1:  # the norm over the whole model (model_parallel.py)
            common.update(
                norm_group=self.parallel.mp_group, counts_in_norm=self.parallel.counts_in_norm
            )
        stage_class = ZeroPartitionedOptimizer
        if self._expert_parallel:
            # Expert parameters of ep_size > 1 get sets of their own, each reduced and sharded
            # over its expert-data-parallel group, offloaded to a home of its own (a partial
            # offload, which needs a device optimizer, is refused there).
            stage_class = ExpertParallelZeroStage
            del common["device_optimizer"]
        if client_optimizer is not None:
            if not isinstance(client_optimizer, torch.optim.Optimizer) and callable(
                client_optimizer
            ):
                client_optimizer = client_optimizer(self._param_groups(model_parameters))
            self._check_optimizer_covers_module(client_optimizer)
            return stage_class(client_optimizer, **common)
        if config_optimizer is None:
            return None  # inference or evaluation only; step() will say so
        factory = config_optimizer_factory(
            config_optimizer.type, config_optimizer.params, optimizer_device
        )
        return stage_class(factory, self._param_groups(model_parameters), **common)

    def _configure_stage3(self, client_optimizer, model_parameters, offload, optimizer_device):
        from .zero.stage3 import ZeroStage3

        optimizer = client_optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            self._check_optimizer_covers_module(optimizer)
        if optimizer is None and self.config.optimizer is not None:
            optimizer = config_optimizer_factory(
                self.config.optimizer.type, self.config.optimizer.params, optimizer_device
            )
        param_offload = ParamOffload.from_config(self.config.zero_optimization, self.config.aio)
        refuse_param_offload_alone(optimizer, param_offload, offload)
        dtype = (
            torch.float16
            if self.fp16_enabled()
            else torch.bfloat16
            if self.bfloat16_enabled()
            else None
        )
        return ZeroStage3(
            self.module,
            optimizer,
            self._param_groups(model_parameters) if optimizer is not None else None,
            zero=self.config.zero_optimization,
            group=self.group,
            device=self.device,
            dtype=dtype,
            gradient_clipping=self.config.gradient_clipping,
            loss_scaler=self.loss_scaler,
            offload=offload,
            device_optimizer=self._device_part_optimizer(offload),
            param_offload=param_offload,
        )

    def _device_part_optimizer(self, offload):
        """With a partial offload (``ratio`` < 1), the config optimizer for the device's part."""
        config_optimizer = self.config.optimizer
        if offload is None or offload.ratio >= 1.0 or config_optimizer is None:
            return None
        return config_optimizer_factory(config_optimizer.type, config_optimizer.params, self.device)

    def _param_groups(self, model_parameters) -> list[dict]:
        if model_parameters is None:
            model_parameters = self.module.parameters()
        items = list(model_parameters)
        if items and isinstance(items[0], dict):
            groups = [dict(group, params=list(group["params"])) for group in items]
            for index, group in enumerate(groups):
                where = f"model_parameters[{index}]['params']"
                refuse_foreign_parameters(self.module, group["params"], where)
            return groups
        if items and isinstance(items[0], tuple):  # named_parameters()
            items = [param for _, param in items]
        refuse_foreign_parameters(self.module, items, "model_parameters")
        return [{"params": items}]

    def _check_optimizer_covers_module(self, optimizer: torch.optim.Optimizer) -> None:
        for index, group in enumerate(optimizer.param_groups):
            where = f"the optimizer's param_groups[{index}]['params']"
            refuse_foreign_parameters(self.module, group["params"], where)
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, param in self.module.named_parameters():
            if param.requires_grad and id(param) not in in_optimizer:
                raise ValueError(
                    f"parameter '{name}' (shape {tuple(param.shape)}) requires grad but is not in "
                    f"the optimizer passed to initialize(); add it or set requires_grad=False"
                )

    def _configure_lr_scheduler(self, client_scheduler):
        if client_scheduler is not None:
            if callable(client_scheduler) and not hasattr(client_scheduler, "step"):
                return client_scheduler(self._scheduler_target())
            return client_scheduler
        if self.config.scheduler is None or self.optimizer is None:
            return None
        return build_lr_scheduler(
            self.config.scheduler.type, self.config.scheduler.params, self._scheduler_target()
        )

    def _scheduler_target(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer if self.optimizer is not None else None

    # --- the training step --------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self._failed_step.check("engine.forward")
        self._report.before_forward(self)
        if self.fp16_auto_cast():
            # fp16.auto_cast (DeepSpeed's): floating-point inputs, however nested, become fp16
            # to match the fp16 module; integer inputs (token ids, labels) are left as they are.
            inputs, kwargs = cast_floating_to_half((inputs, kwargs))
        output = self.module(*inputs, **kwargs)
        self._report.after_forward(self)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of ``loss`` (scaled for fp16, divided by the accumulation steps)."""
        if self.optimizer is None:
            raise RuntimeError("engine.backward needs an optimizer (in the config or initialize)")
        self._failed_step.check("engine.backward")
        self._call_order.before_backward()
        self._report.begin("bwd")
        self._report.begin("bwd_inner")
        scale = 1.0
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scale /= self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.loss_scale
        self.optimizer.begin_backward(self.is_gradient_accumulation_boundary())
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        self._report.end("bwd_inner")
        self._report.begin("bwd_allreduce")
        self.optimizer.end_backward()
        self._report.end("bwd_allreduce")
        self._report.end("bwd")
        self._call_order.after_backward()
        divisor = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        boundary = self.is_gradient_accumulation_boundary()
        self._report.after_backward(loss, divisor, boundary, self.global_samples)
        return loss

    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: the optimizer step and the LR schedule, or neither when
        the gradients are not finite (fp16 overflow, NaN/inf: ``nonfinite_gradients.py``);
        every call counts one micro-step and needs a backward since the last one."""
        if self.optimizer is None:
            raise RuntimeError("engine.step needs an optimizer (in the config or initialize)")
        self._failed_step.check("engine.step")
        self._call_order.before_step(self.global_steps)
        skipped = None
        boundary = self.is_gradient_accumulation_boundary()
        profiled = self._report.before_step(self)
        self._report.begin("step")
        if boundary:
            try:
                stepped = self.optimizer.step()
            except BaseException as error:  # an interrupt part-way leaves the same mix
                self._failed_step.record(self.global_steps, error)
                raise
            self.optimizer.overflow = not stepped
            if stepped:
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            else:
                self.skipped_steps += 1
                skipped = report_skipped_step(
                    self.global_rank == 0,
                    self.global_steps,
                    self.optimizer.global_grad_norm,
                    self.skipped_steps,
                    self.loss_scaler,
                )
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self._report.end("step")
        if boundary:
            self._log_progress()
        self._report.after_step(self, boundary, profiled)
        self.micro_steps += 1
        self._call_order.after_step()
        if skipped is not None:
            raise_if_asked(self.config.nonfinite_gradients, skipped)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides whether the next backward/step ends an accumulation (DeepSpeed's manual
        mode: set it before every forward/backward, True on the last micro-step)."""
        self._is_boundary_override = bool(is_boundary)

    def destroy(self) -> None:
        """Removes every hook the engine installed on the model; a ZeRO-3 model stays
        partitioned (calling it afterwards raises an error naming a parameter)."""
        self._call_order.remove()
        self._report.close()
        if self._zero_stage is not None:
            self._zero_stage.destroy()
        engine_ref = getattr(self.module, "_deepspeed_cpp_engine", None)
        if engine_ref is not None and engine_ref() is self:
            del self.module._deepspeed_cpp_engine

    def full_module_state_dict(self, *, rank0_only: bool = False) -> dict:
        """The module's state dict with every parameter whole (gathered under ZeRO-3) and
        every expert of every rank under its global name (``moe/expert_names.py``); collective.
        With ``rank0_only`` the other ranks get ``{}``."""
        if self._zero_stage is None:
            return {} if rank0_only and self.dp_rank != 0 else self.module.state_dict()
        return self._zero_stage.full_state_dict(self.module, rank0_only=rank0_only)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ZeRO-3 gathers whole weights when the model is saved
        (``stage3_gather_16bit_weights_on_model_save``); accelerate asks before it does."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model's state dict in its training dtype on rank 0 (``{}`` elsewhere), tied
        names sharing one tensor; collective. DeepSpeed's name, which accelerate's
        ``get_state_dict`` and transformers' ``save_model`` call under ZeRO-3."""
        from .checkpoint.model_save import share_tied

        state_dict = share_tied(self.module, self.full_module_state_dict(rank0_only=True))
        if exclude_frozen_parameters:
            for name, param in self.module.named_parameters(remove_duplicate=False):
                if not param.requires_grad:
                    state_dict.pop(name, None)
        return state_dict

    def load_full_module_state(self, state_dict: dict) -> None:
        """Loads a full (consolidated) module state dict, partitioning it under ZeRO-3."""
        if self._zero_stage is None:
            self.module.load_state_dict(state_dict, strict=False)
        else:
            self._zero_stage.load_module_state(self.module, state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.module.zero_grad(set_to_none=set_to_none)

    def _log_progress(self) -> None:
        every = self.config.steps_per_print
        if not every or self.global_steps % every != 0 or self.global_rank != 0:
            return
        now = time.perf_counter()
        last_time, last_samples = self._last_log
        samples_per_second = (self.global_samples - last_samples) / max(now - last_time, 1e-9)
        self._last_log = (now, self.global_samples)
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        logger.info(
            "deepspeed_cpp: step=%d skipped=%d lr=%s loss_scale=%s samples/sec=%.2f",
            self.global_steps,
            self.skipped_steps,
            [round(lr, 10) for lr in self.get_lr()],
            scale,
            samples_per_second,
        )

    # --- checkpoints (deepspeed_cpp.runtime.checkpoint) ---------------------------------------
    def save_checkpoint(
        self,
        save_dir,
        tag=None,
        client_state: dict | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
        allow_pickle: bool = False,
    ) -> bool:
        """Saves the training state to ``save_dir/<tag>`` (default tag ``global_step<N>``) and,
        with ``save_latest``, points ``save_dir/latest`` at it. Every rank must call it.

        ``client_state`` (a dict of tensors and plain data; other objects only with
        ``allow_pickle=True``, and then loading needs it too) is stored as is and returned by
        ``load_checkpoint``. Files are
        published atomically: a crash mid-save leaves ``latest`` at the previous checkpoint.
        Gradients of an unfinished accumulation are not saved: save after ``step()`` at a
        boundary.
        """
        from .checkpoint import save_checkpoint

        self._failed_step.check("engine.save_checkpoint")
        return save_checkpoint(
            self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters, allow_pickle
        )

    def save_16bit_model(
        self, save_dir, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters=False
    ) -> bool:
        """Writes the whole model's ``state_dict`` (its own dtype) to ``save_dir/save_filename``
        from rank 0, atomically; safetensors when the name ends in ``.safetensors``. Under ZeRO-3
        only with ``stage3_gather_16bit_weights_on_model_save`` (parameters gathered one at a
        time to rank 0); without it nothing is saved and False is returned, as in DeepSpeed.
        Every rank must call it."""
        from .checkpoint.model_save import save_16bit_model

        self._failed_step.check("engine.save_16bit_model")
        return save_16bit_model(self, save_dir, save_filename, exclude_frozen_parameters)

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name for ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
        allow_pickle: bool = False,
        allow_symlinks: bool = False,
    ):
        """Restores the state saved under ``load_dir/<tag>`` (``tag`` None: ``latest``'s).

        Returns ``(path, client_state)``, or ``(None, None)`` when no tag is given and there is
        no ``latest`` file. The checkpoint may come from another world size or ZeRO stage
        (0-3): it is resharded. Every rank must call it. ``allow_pickle=True`` is required
        for (and only used by) checkpoints saved with ``save_checkpoint(..., allow_pickle=True)``:
        it unpickles their client state in full, which can run code. ``tag`` (and the tag in
        ``latest``) must be one directory name inside ``load_dir``; symbolic links there (the
        tag folder, ``latest``, a file of the checkpoint) are followed only with
        ``allow_symlinks=True``.
        """
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported by deepspeed_cpp"
            )
        from .checkpoint import load_checkpoint

        loaded = load_checkpoint(
            self,
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            allow_pickle=allow_pickle,
            allow_symlinks=allow_symlinks,
        )
        if loaded[0] is not None and load_optimizer_states and not load_module_only:
            self._failed_step.clear()  # every part a failed step could have touched is replaced
        return loaded

    # --- what scripts ask the engine ----------------------------------------------------------
    def train(self, mode: bool = True):
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._is_boundary_override is not None:
            return self._is_boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def fp16_auto_cast(self) -> bool:
        """Whether forward casts floating-point inputs to fp16 (``fp16.auto_cast``)."""
        return self.fp16_enabled() and bool(self.config.fp16.auto_cast)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def get_lr(self) -> list[float]:
        if self.optimizer is None:
            return []
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def get_loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def communication_data_type(self) -> torch.dtype:
        return torch.float32
