"""``PipelineEngine``: what ``initialize()`` returns for a ``PipelineModule``. Each process runs
one stage; ``train_batch()`` runs a whole batch (``gradient_accumulation_steps`` micro-batches)
through the 1F1B schedule and steps the optimizer, ``eval_batch()`` runs forwards only.

The optimizer, ZeRO 0/1 partitioning, clipping, loss scaling and LR schedules are the data-
parallel engine's (this class extends it, with the module's grid as its ``mpu``): reductions run
over the stage's data-parallel group, and the gradient norm and overflow checks are summed over
the stages of a replica (``runtime/model_parallel.py``; a tied weight counts on its first stage).
Tied weights' gradients are summed over their stages (``ReduceTiedGrads``) before the
data-parallel reduction, which runs once per batch (``ReduceGrads``), as DeepSpeed's does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...utils.logging import logger
from ...utils.repeating_loader import RepeatingLoader
from ..dataloader import make_distributed_loader
from ..engine import DeepSpeedEngine
from ..nonfinite_gradients import raise_if_asked
from . import schedule
from .module import PipelineError, PipelineModule
from .p2p import Channel


class PipelineEngineMisuseError(RuntimeError):
    """``forward``/``backward``/``step`` called directly on a ``PipelineEngine``."""


class DataIteratorExhaustedError(RuntimeError):
    """The data iterator ran out in the middle of a pipeline batch."""


def _floating(tensors) -> list[int]:
    return [i for i, t in enumerate(tensors) if torch.is_floating_point(t)]


def _as_tuple(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _apply_pipeline_config(section, model: PipelineModule) -> None:
    """The config's ``pipeline`` keys that DeepSpeed's PipelineEngine reads (the others are
    decided by the PipelineModule's own arguments, see runtime/config/field_policy.py)."""
    stages = model.num_pipeline_stages()
    if section.stages != "auto" and section.stages != stages:
        raise PipelineError(
            f"the config's pipeline.stages is {section.stages} but the PipelineModule has "
            f'{stages} stages (num_stages / topology); give the same number, or "auto"'
        )
    if section.activation_checkpoint_interval > 0:  # DeepSpeed: the config's overrides
        model.set_checkpoint_interval(section.activation_checkpoint_interval)
    tensor_parallel = model.topology().get_dim("model")
    if tensor_parallel > 1 and (section.pipe_partitioned or section.grad_partitioned):
        if dist.get_rank() == 0:
            logger.info(
                "deepspeed_cpp: pipeline.pipe_partitioned / grad_partitioned: activations and "
                "their gradients are sent whole between stages (the same values; DeepSpeed "
                "splits the transfer over the %d tensor-parallel ranks)",
                tensor_parallel,
            )


class PipelineEngine(DeepSpeedEngine):
    """A pipeline stage's engine (see the module docstring)."""

    _watches_outputs = False  # train_batch() runs its own backward passes

    def __init__(self, *, model, training_data=None, collate_fn=None, config, **kwargs):
        if not isinstance(model, PipelineModule):
            raise PipelineError(
                f"PipelineEngine needs a PipelineModule, got {type(model).__name__}"
            )
        stage = config.zero_optimization.stage
        if stage >= 2:
            raise PipelineError(
                f"zero_optimization.stage {stage} cannot be used with pipeline parallelism "
                "(PipelineModule); DeepSpeed's pipelines take stage 0 or 1"
            )
        _apply_pipeline_config(config.pipeline, model)
        kwargs["mpu"] = kwargs.get("mpu") or model.mpu()
        super().__init__(model=model, config=config, **kwargs)
        grid = model.mpu()
        self.grid = grid
        self.stage_id = grid.get_stage_id()
        self.num_stages = grid.get_pipe_parallel_world_size()
        self.micro_batches = self.gradient_accumulation_steps()
        self.prev_stage, self.next_stage = self.stage_id - 1, self.stage_id + 1
        self.data_iterator = None
        self.training_dataloader = None
        if training_data is not None:
            self.training_dataloader = make_distributed_loader(
                training_data,
                batch_size=self.train_micro_batch_size_per_gpu(),
                rank=self.dp_rank,
                world_size=self.dp_world_size,
                collate_fn=collate_fn,
                drop_last=bool(config.dataloader_drop_last),
            )
            if self.is_first_stage() or self.is_last_stage():
                self.set_dataiterator(iter(RepeatingLoader(self.training_dataloader)))
        dynamic = bool(model.dynamic_shape)
        previous = grid.stage_to_global(self.prev_stage) if not self.is_first_stage() else None
        following = grid.stage_to_global(self.next_stage) if not self.is_last_stage() else None
        self._activations_in = Channel(previous, "activations", dynamic_shape=dynamic)
        self._grads_out = Channel(previous, "activation gradients", dynamic_shape=dynamic)
        self._activations_out = Channel(following, "activations", dynamic_shape=dynamic)
        self._grads_in = Channel(following, "activation gradients", dynamic_shape=dynamic)
        self.agg_train_loss = None
        self.agg_eval_loss = None
        self._stage_busy_seconds = 0.0
        self._last_batch_seconds = 0.0

    # --- what DeepSpeed refuses on a pipeline ------------------------------------------------
    def forward(self, *args, **kwargs):
        raise PipelineEngineMisuseError(
            "PipelineEngine.forward() is not available: pipeline stages run forward inside "
            "train_batch() / eval_batch()"
        )

    def backward(self, *args, **kwargs):
        raise PipelineEngineMisuseError(
            "PipelineEngine.backward() is not available: train_batch() runs the backward passes"
        )

    def step(self, *args, **kwargs):
        raise PipelineEngineMisuseError(
            "PipelineEngine.step() is not available: train_batch() steps the optimizer"
        )

    def no_sync(self):
        raise PipelineEngineMisuseError(
            "PipelineEngine.no_sync() is not available: train_batch() runs, reduces and steps "
            "a whole batch of micro-batches, so there is no backward whose reduction could be "
            "deferred; raise gradient_accumulation_steps for more micro-batches per step"
        )

    # --- the public pipeline API --------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator) -> None:
        """The iterator ``train_batch()`` / ``eval_batch()`` read ``(inputs, labels)``
        micro-batches from (on the first and last stages; others ignore it)."""
        if self.is_first_stage() or self.is_last_stage():
            self.data_iterator = iterator

    def set_batch_fn(self, fn) -> None:
        """A function applied to every loaded micro-batch before use."""
        self.batch_fn = fn

    batch_fn = None

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """Trains on one batch (``gradient_accumulation_steps`` micro-batches per replica);
        returns the mean loss over the batch (every replica's), the same on every stage."""
        if not torch.is_grad_enabled():
            raise PipelineError("train_batch() needs gradients enabled (it ran under no_grad)")
        if self.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer (in the config or initialize)")
        self._failed_step.check("engine.train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.training = True
        start = time.perf_counter()
        self._reset_batch()
        sched = schedule.TrainSchedule(self.micro_batches, self.num_stages, self.stage_id)
        self._run(sched)
        self.agg_train_loss = self._aggregate_loss(self._losses, "train")
        self._last_batch_seconds = time.perf_counter() - start
        self._log_progress()
        return self.agg_train_loss

    def eval_batch(
        self,
        data_iter,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ):
        """Forwards ``num_micro_batches`` (default: ``gradient_accumulation_steps``) micro-batches
        from ``data_iter``; returns their mean loss (averaged over replicas, on every stage with
        ``bcast_loss``), and with ``return_logits`` also the last stage's outputs of the last
        micro-batch (None on other stages)."""
        if reduce_output not in ("avg", None):
            raise PipelineError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        was_training = self.module.training
        self.module.eval()
        self.training = False
        saved_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        micro_batches = int(num_micro_batches or self.micro_batches)
        self._reset_batch()
        self._compute_loss = compute_loss
        sched = schedule.InferenceSchedule(micro_batches, self.num_stages, self.stage_id)
        try:
            with torch.no_grad():
                self._run(sched)
        finally:
            self.data_iterator = saved_iterator
            self._compute_loss = True
            self.module.train(was_training)
            self.training = was_training
        if compute_loss:
            if reduce_output is None:
                result = list(self._losses) if self.is_last_stage() else None
            else:
                result = self._aggregate_loss(self._losses, "eval", broadcast=bcast_loss)
                self.agg_eval_loss = result
        else:
            result = self._last_outputs if self.is_last_stage() else None
        if return_logits:
            return result, (self._last_outputs if self.is_last_stage() else None)
        return result

    # --- running a schedule -------------------------------------------------------------------
    def _reset_batch(self) -> None:
        self._buffers: dict[int, dict] = {}
        self._losses: list[torch.Tensor] = []
        self._last_outputs = None
        self._loaded = 0
        self._compute_loss = True

    def _run(self, sched: schedule.PipeSchedule) -> None:
        self._batch_micro_batches = sched.micro_batches
        handlers = {
            schedule.LoadMicroBatch: self._exec_load_micro_batch,
            schedule.RecvActivation: self._exec_recv_activations,
            schedule.ForwardPass: self._exec_forward_pass,
            schedule.SendActivation: self._exec_send_activations,
            schedule.RecvGrad: self._exec_recv_grads,
            schedule.BackwardPass: self._exec_backward_pass,
            schedule.SendGrad: self._exec_send_grads,
            schedule.ReduceTiedGrads: self._exec_reduce_tied_grads,
            schedule.ReduceGrads: self._exec_reduce_grads,
            schedule.OptimizerStep: self._exec_optimizer_step,
        }
        loaded = sched.micro_batches
        if self.is_first_stage() or self.is_last_stage():
            loaded = self._prefetch(sched.micro_batches)
        self._agree_on_data(loaded, sched.micro_batches)
        busy = 0.0
        try:
            for step in sched.steps():
                for instruction in step:
                    began = time.perf_counter()
                    handlers[type(instruction)](instruction)
                    if isinstance(instruction, (schedule.ForwardPass, schedule.BackwardPass)):
                        busy += time.perf_counter() - began
        except BaseException:
            # Sends a failed schedule left unmatched would block here: drop them.
            for channel in (self._activations_out, self._grads_out):
                channel.drop_sends()
            raise
        for channel in (self._activations_out, self._grads_out):
            channel.wait_sends()
        self._stage_busy_seconds = busy

    def _buffer(self, instruction) -> dict:
        return self._buffers.setdefault(instruction.buffer_id, {})

    def _prefetch(self, micro_batches: int) -> int:
        """Reads the batch's micro-batches before the first send; returns how many there were
        (fewer when the iterator ran out: ``_agree_on_data`` then fails every rank)."""
        if self.data_iterator is None:
            raise PipelineError(
                "the first and last pipeline stages need a data iterator: pass training_data to "
                "initialize(), or train_batch(data_iter=...) / set_dataiterator()"
            )
        self._prefetched = []
        for _ in range(micro_batches):
            try:
                self._prefetched.append(next(self.data_iterator))
            except StopIteration:
                break
        return len(self._prefetched)

    def _agree_on_data(self, loaded: int, micro_batches: int) -> None:
        """Every rank learns whether any first or last stage ran out of data, before anything
        is sent: otherwise the stages that read no data (the middle ones) and the other
        replicas would wait for activations that never come. One small all-reduce over the
        world per batch (a slot per rank, the minimum kept)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            counts = torch.full((world,), micro_batches, dtype=torch.int64)
            counts[dist.get_rank()] = loaded
            with named_collective("all_reduce of the micro-batch counts before a pipeline batch"):
                dist.all_reduce(counts, op=dist.ReduceOp.MIN)
            short = [(rank, int(n)) for rank, n in enumerate(counts.tolist()) if n < micro_batches]
        else:
            short = [(0, loaded)] if loaded < micro_batches else []
        if not short:
            return
        self._prefetched = []
        rank, count = short[0]
        stage = self.grid.topology().get_coord(rank).pipe
        raise DataIteratorExhaustedError(
            f"the data iterator of rank {rank} (stage {stage}) ran out after {count} of the "
            f"{micro_batches} micro-batches of this batch; every stage stops this batch (this is "
            f"stage {self.stage_id}). Give at least gradient_accumulation_steps micro-batches "
            "per batch (a deepspeed.utils.RepeatingLoader repeats a finite loader)"
        )

    def _exec_load_micro_batch(self, instruction) -> None:
        batch = self._prefetched[self._loaded]
        self._prefetched[self._loaded] = None
        self._loaded += 1
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise PipelineError(
                "a pipeline micro-batch must be a pair (inputs, labels); got "
                f"{type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        inputs, labels = batch
        buffer = self._buffer(instruction)
        if self.is_first_stage():
            buffer["inputs"] = self._to_stage(inputs, cast=True)
        if self.is_last_stage():
            buffer["labels"] = self._to_stage(labels, cast=False)

    def _to_stage(self, value, *, cast: bool):
        if isinstance(value, (tuple, list)):
            return tuple(self._to_stage(v, cast=cast) for v in value)
        if not torch.is_tensor(value):
            return value
        value = value.to(self.device)
        if cast and torch.is_floating_point(value):
            if self.bfloat16_enabled():
                value = value.bfloat16()
            elif self.fp16_enabled():
                value = value.half()
        return value

    def _zero_grads_while_waiting(self) -> None:
        # The gradients a step left to be zeroed at the next backward (a full pass over them) are
        # zeroed before a blocking receive instead: the stage waits there at the start of a
        # batch (1F1B's fill), so the pass leaves the critical path.
        if self.training:
            zero_now = getattr(self.optimizer, "zero_grads_now", None)
            if zero_now is not None:
                zero_now()

    def _exec_recv_activations(self, instruction) -> None:
        self._zero_grads_while_waiting()
        received = self._activations_in.recv(self.device)
        if self.training:
            for tensor in _as_tuple(received):
                if torch.is_floating_point(tensor):
                    tensor.requires_grad_(True)
        self._buffer(instruction)["inputs"] = received

    def _exec_forward_pass(self, instruction) -> None:
        buffer = self._buffer(instruction)
        outputs = self.module(buffer["inputs"])
        if not self.is_last_stage():
            buffer["outputs"] = outputs
            return
        self._last_outputs = outputs
        if self.module.loss_fn is not None and self._compute_loss:
            loss = self.module.loss_fn(outputs, buffer["labels"])
        else:
            loss = outputs
        buffer["loss"] = loss
        if torch.is_tensor(loss):
            self._losses.append(loss.detach())

    def _exec_send_activations(self, instruction) -> None:
        outputs = self._buffer(instruction)["outputs"]
        self._activations_out.send(outputs)
        if not self.training:
            self._buffers.pop(instruction.buffer_id, None)

    def _exec_recv_grads(self, instruction) -> None:
        self._zero_grads_while_waiting()
        self._buffer(instruction)["grads"] = self._grads_in.recv(self.device)

    def _exec_backward_pass(self, instruction) -> None:
        buffer = self._buffer(instruction)
        self.optimizer.begin_backward(False)  # stage 0/1: accumulate until ReduceGrads
        if self.is_last_stage():
            loss = buffer["loss"]
            if not (torch.is_tensor(loss) and loss.dim() == 0):
                raise PipelineError(
                    "the last stage's loss must be a scalar tensor (loss_fn(outputs, labels), or "
                    f"the outputs without a loss_fn); got {type(loss).__name__}"
                    + (f" of shape {list(loss.shape)}" if torch.is_tensor(loss) else "")
                )
            scale = 1.0 / self._batch_micro_batches
            if self.loss_scaler is not None:
                scale *= self.loss_scaler.loss_scale
            (loss * scale).backward()
        else:
            outputs = _as_tuple(buffer["outputs"])
            grads = buffer["grads"]
            pairs = [
                (outputs[i], g)
                for i, g in zip(_floating(outputs), grads)
                if outputs[i].requires_grad
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self.optimizer.end_backward()
        buffer.pop("outputs", None)
        buffer.pop("loss", None)
        buffer.pop("grads", None)

    def _exec_send_grads(self, instruction) -> None:
        buffer = self._buffers.pop(instruction.buffer_id)
        inputs = _as_tuple(buffer["inputs"])
        grads = tuple(
            inputs[i].grad if inputs[i].grad is not None else torch.zeros_like(inputs[i])
            for i in _floating(inputs)
        )
        self._grads_out.send(grads)

    def _exec_reduce_tied_grads(self, instruction) -> None:
        for weight, group in self.module.get_tied_weights_and_groups():
            grad = self.optimizer.accumulated_grad(weight)
            if grad is None:  # unused on this stage in this batch: its part is zero
                weight.grad = torch.zeros_like(weight)
                grad = weight.grad
            with named_collective("all_reduce of a tied weight's gradient over its stages"):
                dist.all_reduce(grad, group=group)

    def _exec_reduce_grads(self, instruction) -> None:
        self.optimizer.begin_backward(True)
        self.optimizer.end_backward()  # hands every accumulated gradient to the reducer

    def _exec_optimizer_step(self, instruction) -> None:
        skipped = self._optimizer_step()
        self.micro_steps += self.micro_batches
        if skipped is not None:
            raise_if_asked(self.config.nonfinite_gradients, skipped)

    # --- checkpoints (checkpoint.py) ----------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """Saves the pipeline in DeepSpeed's layout (a file per layer, a shard per rank); every
        rank calls it. ``client_state`` must be plain data and tensors."""
        from .checkpoint import save_pipeline_checkpoint

        unsupported = {k: v for k, v in kwargs.items() if v}
        if unsupported:
            raise NotImplementedError(
                f"PipelineEngine.save_checkpoint does not take {sorted(unsupported)}"
            )
        self._failed_step.check("engine.save_checkpoint")
        subject = self._pipe_checkpoint_subject()
        return save_pipeline_checkpoint(subject, save_dir, tag, client_state, save_latest)

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        allow_symlinks: bool = False,
        **kwargs,
    ):
        """Loads a pipeline checkpoint saved at any number of stages and replicas (the optimizer
        state only from the same layout); returns ``(path, client_state)``."""
        from .checkpoint import load_pipeline_checkpoint

        unsupported = {k: v for k, v in kwargs.items() if v}
        if unsupported:
            raise NotImplementedError(
                f"PipelineEngine.load_checkpoint does not take {sorted(unsupported)}"
            )
        loaded = load_pipeline_checkpoint(
            self._pipe_checkpoint_subject(),
            load_dir,
            tag,
            load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            allow_symlinks=allow_symlinks,
        )
        if loaded[0] is not None and not load_module_only:
            self._failed_step.clear()
        return loaded

    def _pipe_checkpoint_subject(self):
        """This engine as its pipeline checkpoints see it (``checkpoint.py``)."""
        from .checkpoint import PipeCheckpointSubject

        return PipeCheckpointSubject(
            base=self._checkpoint_subject(), stage_id=self.stage_id, num_stages=self.num_stages
        )

    # --- the batch loss -----------------------------------------------------------------------
    def _aggregate_loss(self, losses, what: str, broadcast: bool = True) -> torch.Tensor:
        """The last stage's mean micro-batch loss, averaged over its replicas, then sent to
        every stage of the replica (as DeepSpeed's engines report it)."""
        pipe_group = self.grid.get_pipe_parallel_group()
        last = self.grid.stage_to_global(self.num_stages - 1)
        if self.is_last_stage():
            if not losses:
                raise PipelineError(f"{what}_batch produced no loss on the last stage")
            total = torch.stack([loss.float() for loss in losses]).mean().reshape(1)
            if self.dp_world_size > 1:
                with named_collective(f"all_reduce of the {what} loss over replicas"):
                    dist.all_reduce(total, group=self.grid.get_data_parallel_group())
                total /= self.dp_world_size
        else:
            total = torch.zeros(1, dtype=torch.float32, device=self.device)
        if broadcast and self.num_stages > 1:
            with named_collective(f"broadcast of the {what} loss from the last stage"):
                dist.broadcast(total, src=last, group=pipe_group)
        return total[0]

    def _log_progress(self) -> None:
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0 and self.global_rank == 0:
            logger.info(
                "deepspeed_cpp: steps: %d loss: %.4f iter time (s): %.3f samples/sec: %.3f",
                self.global_steps,
                float(self.agg_train_loss),
                self._last_batch_seconds,
                self.train_batch_size() / max(self._last_batch_seconds, 1e-9),
            )

    def stage_busy_seconds(self) -> float:
        """Seconds of the last batch this stage spent computing (forward + backward passes):
        the rest of the batch's wall time is pipeline bubble and communication."""
        return self._stage_busy_seconds

    def last_batch_seconds(self) -> float:
        return self._last_batch_seconds
