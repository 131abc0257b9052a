"""The engine's whole-model and checkpoint API (``save_checkpoint``, ``load_checkpoint``,
``save_16bit_model``, the consolidated state dicts), apart from the training step in
``engine.py``: each method checks the engine's state and hands over to
``runtime/checkpoint``, which does the work."""

from __future__ import annotations

from ..module_inject import gather_full_state_dict, tensor_parallel_info


class EngineCheckpoints:
    """Mixed into ``DeepSpeedEngine``: uses its ``module``, ``_zero_stage``, ``global_rank``,
    ``dp_rank``, ``config`` and ``_failed_step``."""

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
