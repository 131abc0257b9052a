"""DeepSpeedEngine: the nn.Module a training script drives with forward, backward and step."""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist

from ..accelerator import get_accelerator
from ..comm.logging_api import configure as configure_comms_logger
from ..module_inject import tensor_parallel_info
from ..utils.logging import logger
from ..utils.throughput_timer import UNSYNCHRONIZED_THROUGHPUT, ThroughputTimer
from ..utils.z3_leaf_modules import apply_zero_leaf_module_config
from .call_order import CallOrder
from .config import DeepSpeedConfig
from .dataloader import make_distributed_loader
from .engine_checkpoints import EngineCheckpoints
from .engine_config_readers import EngineConfigReaders
from .engine_model_lookup import EngineModelLookup
from .engine_refusals import (
    refuse_expert_parallel_with,
    refuse_partitioned_parameters,
    refuse_zero3_with_model_parallelism,
    release_previous_engine,
)
from .engine_state_moves import EngineStateMoves
from .engine_torch_backward import EngineTorchBackward
from .engine_unreduced_gradients import EngineUnreducedGradients
from .failed_step import FailedStepGuard
from .half_inputs import cast_floating_to_half, cast_parameters
from .initial_weights import broadcast_initial_weights
from .loss_scaler import make_loss_scaler
from .lr_schedules import build_lr_scheduler
from .model_parallel import ModelParallelGroups
from .no_sync import refuse_step_inside as refuse_step_inside_no_sync
from .nonfinite_gradients import raise_if_asked, report_skipped_step
from .tensor_parallel.setup import remap_parameters as remap_for_tensor_parallel
from .torch_backward import TorchBackward
from .training_report import TrainingReport
from .zero.build import build_stage
from .zero.moe_stage import needs_expert_sets
from .zero.offload.host_heap import give_back_free_heap


class DeepSpeedEngine(
    EngineCheckpoints,
    EngineStateMoves,
    EngineModelLookup,
    EngineUnreducedGradients,
    EngineTorchBackward,
    EngineConfigReaders,
    torch.nn.Module,
):
    """Wraps the user's module; ``backward`` and ``step`` run ZeRO stage 0, 1, 2 or 3.

    ``step()`` is called after every micro-batch, as with DeepSpeed: it steps the optimizer only
    at gradient-accumulation boundaries and otherwise just counts the micro-step.
    """

    # loss.backward() on the module's output counts as a backward (torch_backward.py); the
    # pipeline engine runs its own backward passes and turns this off.
    _watches_outputs = True

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
        # zero_optimization.leaf_module: marked before ZeRO-3 forms its fetch units from them.
        apply_zero_leaf_module_config(model, config.zero_optimization.leaf_module)
        # AutoTP: the model split over the mpu's tensor-parallel group (initialize() built it).
        replaced = self._configure_tensor_parallel(model)
        model_parameters = remap_for_tensor_parallel(optimizer, model_parameters, replaced)
        if self.zero_optimization_stage() < 3:
            refuse_partitioned_parameters(model, self.zero_optimization_stage())
            self.module.to(self.device)
            if self.fp16_enabled() or self.bfloat16_enabled():
                cast_parameters(
                    self.module, torch.float16 if self.fp16_enabled() else torch.bfloat16
                )
            broadcast_initial_weights(self.module, self.parallel, self.group)

        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._failed_step = FailedStepGuard()
        self._call_order = CallOrder(self.module)
        self._torch_backward = TorchBackward(self, self.module, watch=self._watches_outputs)
        # engine.no_sync() (no_sync.py): inside the block; and whether the last backward ran
        # there, so that the gradients it left unreduced are reduced before a step.
        self._inside_no_sync = False
        self._reduction_owed = False
        # DeepSpeed's engine.tput_timer, which scripts read for their samples/sec; its own log
        # line is off (steps_per_output None): the report's progress line gives the speed.
        # Unsynchronized: syncing the device at every forward and step() stalls the host's
        # dispatch; each optimizer step waits for the device anyway (the gradient norm).
        self.tput_timer = ThroughputTimer(UNSYNCHRONIZED_THROUGHPUT, self.train_batch_size())

        self.loss_scaler = None
        if self.fp16_enabled():
            # DeepSpeed's ZeRO-0 fp16 optimizers lower the scale at every overflow and stop at
            # min_loss_scale; its ZeRO 1-3 ones apply hysteresis and fail below the minimum.
            zero = self.zero_optimization_stage() > 0
            self.loss_scaler = make_loss_scaler(
                config.fp16, raise_error_at_min_scale=zero, hysteresis=zero
            )
        stage = build_stage(
            config,
            self.module,
            optimizer,
            self.group,
            self.device,
            model_parameters=model_parameters,
            loss_scaler=self.loss_scaler,
            expert_parallel=self._expert_parallel,
            parallel=self.parallel,
        )
        self._zero_stage = stage  # at ZeRO-3 also without an optimizer: it gathers parameters
        if self._report.wall_clock_breakdown and hasattr(stage, "set_timers"):
            stage.set_timers(self.timers)  # ZeRO-3's gathers, reduce-scatters and step
        self.optimizer = stage if stage is not None and stage.trains else None
        self.lr_scheduler = self._configure_lr_scheduler(lr_scheduler)
        self.training_dataloader = (
            make_distributed_loader(
                training_data,
                batch_size=self.train_micro_batch_size_per_gpu(),
                rank=self.dp_rank,  # the ranks of a TP group read the same samples
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
    def _configure_tensor_parallel(self, model) -> dict:
        """Splits the model over the mpu's TP group when the config asks for AutoTP; returns
        {id(replaced parameter): its slice} (see tensor_parallel/setup.py)."""
        from .tensor_parallel.setup import prepare_model

        if int(self.config.tensor_parallel.autotp_size) <= 1 or self.mpu is None:
            return {}
        if tensor_parallel_info(model) is None:
            model.to(self.device)  # the whole model is broadcast from rank 0, then split
        return prepare_model(model, self.mpu, self.config)

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
        self.tput_timer.start()
        self._torch_backward.inside_engine_forward = True
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            self._torch_backward.inside_engine_forward = False
        self._report.after_forward(self)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backward of ``loss`` (scaled for fp16, divided by the accumulation steps); returns
        the loss divided by the accumulation steps (``scale_wrt_gas``), as DeepSpeed does."""
        if self.optimizer is None:
            raise RuntimeError("engine.backward needs an optimizer (in the config or initialize)")
        self._failed_step.check("engine.backward")
        self._call_order.before_backward()
        scale = 1.0
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            scale /= self.gradient_accumulation_steps()
        if self.loss_scaler is not None:
            scale *= self.loss_scaler.loss_scale
        self._begin_stage_backward()
        self._torch_backward.inside_engine_backward += 1  # the output hooks stand aside
        try:
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        finally:
            self._torch_backward.inside_engine_backward -= 1
        self._end_stage_backward()
        divisor = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        boundary = self.is_gradient_accumulation_boundary()
        self._report.after_backward(loss, divisor, boundary, self.global_samples)
        return loss / divisor if divisor != 1 else loss

    def _begin_stage_backward(self) -> None:
        """Before the gradients of a backward (engine.backward's, or a torch-style one's
        prologue: torch_backward.py) reach the stage."""
        self._report.begin("bwd")
        self._report.begin("bwd_inner")
        # Inside no_sync() nothing is reduced: gradients accumulate on each rank.
        reduces = self.is_gradient_accumulation_boundary() and not self._inside_no_sync
        self.optimizer.begin_backward(reduces)

    def _end_stage_backward(self) -> None:
        """After every gradient of the backward reached the stage: the last reductions, and the
        backward counted for step()'s call-order check."""
        self._report.end("bwd_inner")
        self._report.begin("bwd_allreduce")
        self.optimizer.end_backward()
        self._report.end("bwd_allreduce")
        self._report.end("bwd")
        self._call_order.after_backward()
        self._reduction_owed = self._inside_no_sync
        self._torch_backward.epilogue_ran = True  # a script's _backward_epilogue() after it: void

    def step(self, lr_kwargs=None) -> None:
        """At an accumulation boundary: the optimizer step and the LR schedule, or neither when
        the gradients are not finite (fp16 overflow, NaN/inf: ``nonfinite_gradients.py``);
        every call counts one micro-step and needs a backward since the last one."""
        if self.optimizer is None:
            raise RuntimeError("engine.step needs an optimizer (in the config or initialize)")
        self._failed_step.check("engine.step")
        if self._inside_no_sync:
            refuse_step_inside_no_sync(self.global_steps)
        if not (self._call_order.saw_backward() or self._call_order.saw_forward()):
            self._adopt_hand_set_gradients()
        self._call_order.before_step(self.global_steps)
        skipped = None
        boundary = self.is_gradient_accumulation_boundary()
        if boundary and self._reduction_owed:  # the last backward ran inside no_sync()
            self._reduce_local_gradients()
        profiled = self._report.before_step(self)
        self._report.begin("step")
        if boundary:
            skipped = self._optimizer_step(lr_kwargs)
        self._report.end("step")
        self._report.after_step(self, boundary, profiled)
        self.tput_timer.stop(global_step=boundary, report_speed=False)
        self.micro_steps += 1
        self._call_order.after_step()
        self._torch_backward.after_step()
        if skipped is not None:
            raise_if_asked(self.config.nonfinite_gradients, skipped)

    def _optimizer_step(self, lr_kwargs=None):
        """One optimizer step and the LR schedule's, or neither when the gradients are not
        finite (then counted and reported: the report is returned for ``raise_if_asked``, else
        None); the global step and sample counters advance either way."""
        try:
            stepped = self.optimizer.step()
        except BaseException as error:  # an interrupt part-way leaves the same mix
            self._failed_step.record(self.global_steps, error)
            raise
        self.optimizer.overflow = not stepped
        skipped = None
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
        return skipped

    def train_batch(self, data_iter=None):
        """DeepSpeed's pipeline API; this engine trains a plain module."""
        raise RuntimeError(
            "engine.train_batch() is the pipeline engine's: initialize() got a "
            f"{type(self.module).__name__}, not a deepspeed.pipe.PipelineModule; train it with "
            "loss = engine(batch); engine.backward(loss); engine.step()"
        )

    def eval_batch(self, *args, **kwargs):
        """DeepSpeed's pipeline API; this engine evaluates with ``engine(batch)``."""
        raise RuntimeError(
            "engine.eval_batch() is the pipeline engine's: initialize() got a "
            f"{type(self.module).__name__}, not a deepspeed.pipe.PipelineModule; evaluate with "
            "engine.eval() and engine(batch)"
        )

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Overrides whether the next backward/step ends an accumulation (DeepSpeed's manual
        mode: set it before every forward/backward, True on the last micro-step)."""
        self._is_boundary_override = bool(is_boundary)

    def destroy(self) -> None:
        """Removes every hook the engine installed on the model; a ZeRO-3 model stays
        partitioned (calling it afterwards raises an error naming a parameter)."""
        self._call_order.remove()
        self._torch_backward.remove()
        self._report.close()
        if self._zero_stage is not None:
            self._zero_stage.destroy()
        engine_ref = getattr(self.module, "_deepspeed_cpp_engine", None)
        if engine_ref is not None and engine_ref() is self:
            del self.module._deepspeed_cpp_engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        else:
            self.module.zero_grad(set_to_none=set_to_none)

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
