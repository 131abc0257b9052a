"""The engine's whole-model and checkpoint API (``save_checkpoint``, ``load_checkpoint``,
``save_16bit_model``, the consolidated state dicts), apart from the training step in
``engine.py``: each method checks the engine's state and hands over to
``runtime/checkpoint``, which does the work."""

from __future__ import annotations

from ..module_inject import gather_full_state_dict, tensor_parallel_info
from ..utils.logging import logger
from .train_state import TrainState


class EngineCheckpoints:
    """Mixed into ``DeepSpeedEngine``: uses its ``module``, ``_zero_stage``, ``optimizer``,
    ``global_rank``, ``dp_rank``, ``config``, ``_failed_step``, its counters, schedule and loss
    scaler."""

    # --- what runtime/checkpoint sees of the engine ---------------------------------------------
    def train_state(self) -> TrainState:
        """How far training has come, as plain data (what a checkpoint saves besides the model
        and the optimizer's shards)."""
        zero, scheduler, scaler = self.optimizer, self.lr_scheduler, self.loss_scaler
        return TrainState(
            global_steps=self.global_steps,
            global_samples=self.global_samples,
            micro_steps=self.micro_steps,
            skipped_steps=self.skipped_steps,
            gradient_accumulation_steps=self.gradient_accumulation_steps(),
            optimizer_skipped_steps=zero.skipped_steps if zero is not None else 0,
            lr_scheduler=scheduler.state_dict() if scheduler is not None else None,
            lr_scheduler_type=type(scheduler).__name__ if scheduler is not None else None,
            loss_scaler=scaler.state_dict() if scaler is not None else None,
        )

    def check_train_state(
        self, state: TrainState, *, scheduler: bool = True, scheduler_type: str | None = None
    ) -> None:
        """Raises (ValueError) where ``restore_train_state(state, scheduler=scheduler)`` would,
        changing nothing, so that a refused checkpoint leaves the engine as it was.
        ``scheduler_type``: the class name of the schedule that saved ``state`` (None: unknown,
        as for a checkpoint DeepSpeed wrote); a torch schedule loads any dict without a word,
        so another class is refused here."""
        if self.loss_scaler is not None and state.loss_scaler is not None:
            self.loss_scaler.check_state_dict(state.loss_scaler)
        schedule = self.lr_scheduler
        if not scheduler or schedule is None or state.lr_scheduler is None:
            return
        ours = type(schedule).__name__
        if scheduler_type is not None and scheduler_type != ours:
            raise ValueError(
                f"the checkpoint's lr scheduler state is a {scheduler_type}'s, this engine's "
                f"scheduler is a {ours}; pass load_lr_scheduler_states=False to keep this "
                "engine's schedule"
            )
        check = getattr(schedule, "check_state_dict", None)
        if check is not None:
            check(state.lr_scheduler)

    def restore_train_state(
        self, state: TrainState, *, scheduler: bool = True, lrs_from_scheduler: bool = False
    ) -> None:
        """Takes a saved ``TrainState``: counters, the loss scaler's state and, with
        ``scheduler``, the schedule's (``lrs_from_scheduler``: its learning rates also go into
        the param groups, for a load without the optimizer's state, which carries them)."""
        if self.optimizer is not None:
            self.optimizer.skipped_steps = state.optimizer_skipped_steps
        self.global_steps = state.global_steps
        self.global_samples = state.global_samples
        gas = self.gradient_accumulation_steps()
        self.micro_steps = state.micro_steps
        if state.gradient_accumulation_steps != gas:
            # Another world size keeps the global batch with another accumulation count: restart
            # the count at the boundary of the step the checkpoint completed.
            self.micro_steps = self.global_steps * gas
        elif state.micro_steps % gas:
            # Saved between two steps: the gradients accumulated since the last one are not in
            # a checkpoint, so the next step takes a whole batch of micro-steps, not the rest of
            # one (which would apply a partial sum divided by the whole count).
            self.micro_steps = state.micro_steps - state.micro_steps % gas
            logger.warning(
                "deepspeed_cpp: the checkpoint was saved after micro-step %d of %d of a step; "
                "its gradients were not saved, so the step restarts at its first micro-step",
                state.micro_steps % gas,
                gas,
            )
        self.skipped_steps = state.skipped_steps
        if self.loss_scaler is not None and state.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state.loss_scaler)
        if not scheduler or self.lr_scheduler is None:
            return
        if state.lr_scheduler is None:
            logger.warning("deepspeed_cpp: the checkpoint has no lr scheduler state to restore")
            return
        self.lr_scheduler.load_state_dict(state.lr_scheduler)
        if lrs_from_scheduler and self.optimizer is not None:
            for group, lr in zip(self.optimizer.param_groups, self.lr_scheduler.get_last_lr()):
                group["lr"] = lr

    def _checkpoint_subject(self):
        """This engine as ``runtime/checkpoint`` sees it (``checkpoint/subject.py``)."""
        from .checkpoint.subject import CheckpointSubject

        return CheckpointSubject(
            module=self.module,
            zero=self.optimizer,
            zero_stage=self.zero_optimization_stage(),
            global_rank=self.global_rank,
            dp_rank=self.dp_rank,
            dp_world_size=self.dp_world_size,
            group=self.group,
            mp_rank=self.mp_rank,
            mp_world_size=self.mp_world_size,
            device=self.device,
            ds_config=self.config.raw,
            expert_parallel=self._expert_parallel,
            gathers_16bit_weights_on_save=self.zero_gather_16bit_weights_on_model_save(),
            train_state=self.train_state(),
            full_module_state_dict=lambda rank0_only: self.full_module_state_dict(
                rank0_only=rank0_only
            ),
            whole_model_state_dict=lambda rank0_only: self.whole_model_state_dict(
                rank0_only=rank0_only
            ),
            load_full_module_state=self.load_full_module_state,
            check_train_state=self.check_train_state,
            restore_train_state=self.restore_train_state,
            tag_validation=self.config.checkpoint.tag_validation,
        )

    def full_module_state_dict(self, *, rank0_only: bool = False) -> dict:
        """The module's state dict with every parameter whole (gathered under ZeRO-3) and
        every expert of every rank under its global name (``moe/expert_names.py``); collective.
        With ``rank0_only`` the other ranks get ``{}``. A model split by AutoTP keeps this
        rank's slices (its checkpoint part); ``whole_model_state_dict`` gathers them."""
        if self._zero_stage is None:
            return {} if rank0_only and self.dp_rank != 0 else self.module.state_dict()
        return self._zero_stage.full_state_dict(self.module, rank0_only=rank0_only)

    def whole_model_state_dict(self, *, rank0_only: bool = False) -> dict:
        """``full_module_state_dict`` with AutoTP's slices gathered over the TP group into the
        unsplit tensors (what save_16bit_model and the HF save_model write); collective. With
        ``rank0_only`` the ranks other than global rank 0 get ``{}``."""
        if tensor_parallel_info(self.module) is None:
            return self.full_module_state_dict(rank0_only=rank0_only)
        whole = gather_full_state_dict(self.module, self.full_module_state_dict())
        return {} if rank0_only and self.global_rank != 0 else whole

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's name for the whole model of an AutoTP engine (accelerate calls it)."""
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether ZeRO-3 gathers whole weights when the model is saved
        (``stage3_gather_16bit_weights_on_model_save``); accelerate asks before it does."""
        return bool(self.config.zero_optimization.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """The whole model's state dict in its training dtype on rank 0 (``{}`` elsewhere), tied
        names sharing one tensor; collective. DeepSpeed's name, which accelerate's
        ``get_state_dict`` and transformers' ``save_model`` call under ZeRO-3."""
        from .checkpoint.model_save import share_tied

        state_dict = share_tied(self.module, self.whole_model_state_dict(rank0_only=True))
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
            self._checkpoint_subject(),
            save_dir,
            tag,
            client_state,
            save_latest,
            exclude_frozen_parameters,
            allow_pickle,
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
        return save_16bit_model(
            self._checkpoint_subject(), save_dir, save_filename, exclude_frozen_parameters
        )

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name for ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)

    def _get_optimizer_ckpt_name(self, checkpoints_path, tag, expp_rank=None) -> str:
        """The file of checkpoint ``tag`` under ``checkpoints_path`` that holds this rank's
        optimizer state (fp32 master slices and their optimizer state), as DeepSpeed's engine
        names it; ``expp_rank`` (DeepSpeed's expert-parallel rank) does not change it here:
        expert state is in the same per-rank file. Loading reads it only when it loads the
        optimizer state."""
        from .checkpoint.layout import model_parallel_dir, optimizer_shard_file

        folder = model_parallel_dir(
            checkpoints_path, self.mp_rank, self.mp_world_size, loading=False
        )
        return str(folder / str(tag) / optimizer_shard_file(self.dp_rank))

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
            self._checkpoint_subject(),
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
