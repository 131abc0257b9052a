"""``Trainer`` and ``Seq2SeqTrainer`` that train through deepspeed_cpp's engine.

With ``args.deepspeed`` set (our ``TrainingArguments``), training goes through
``EngineAccelerator``: these methods only decide what the engine is built from (the config's last
``"auto"`` values, whose optimizer and schedule) and route checkpoints to the engine. Without it,
both behave as transformers' own.

Optimizer and schedule, as the Hugging Face DeepSpeed guide describes:

================================  ==========================================================
config has                        engine trains with
================================  ==========================================================
``optimizer`` and ``scheduler``   both from the config
``optimizer`` only                the config's optimizer, the Trainer's schedule on it
``scheduler`` only                the Trainer's optimizer (``optim=``), the config's schedule
neither                           the Trainer's optimizer and schedule
================================  ==========================================================

Every ``train()`` builds a new engine from the config as it is then: a second call on the same
Trainer (the model's current weights, a fresh optimizer and schedule, as transformers initialises
DeepSpeed again), each try of ``auto_find_batch_size`` (the batch keys refilled for the batch
tried) and each hyper-parameter trial (the config refilled from the trial's arguments).

Checkpoints: ``checkpoint-N/`` holds what transformers writes (``model.safetensors`` with the
whole model, gathered under ZeRO-3; ``trainer_state.json``, ``config.json``, ...) and the
engine's own ``global_stepN/`` and ``latest``, which ``resume_from_checkpoint`` restores.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os

import transformers

from deepspeed_cpp import DeepSpeedEngine

from .accelerator import (
    EngineAccelerator,
    EngineOptimizer,
    EnginePlan,
    EngineScheduler,
    tensor_parallel_size,
)
from .config_filling import fill_from_model_and_steps


class _EngineTrainerMixin:
    """The Trainer methods that differ when deepspeed_cpp's engine trains."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # What Trainer(optimizers=...) brought: once an engine trained, self.optimizer and
        # self.lr_scheduler are views of the engine's, and a later train() must tell them apart.
        self._caller_optimizers = (self.optimizer, self.lr_scheduler)
        self._config_for_found_batch = None

    @property
    def deepspeed_cpp_enabled(self) -> bool:
        return bool(getattr(self.args, "deepspeed_cpp_enabled", False))

    # --- the accelerator ----------------------------------------------------------------------
    def _build_accelerator_args(self, **kwargs) -> dict:
        accelerator_args = super()._build_accelerator_args(**kwargs)
        if self.deepspeed_cpp_enabled:
            # fp16/bf16 are the engine's (the config's sections, filled from the arguments);
            # accelerate's autocast and grad scaler would act a second time.
            accelerator_args["mixed_precision"] = "no"
        self._accelerator_args = accelerator_args
        return accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        # Hyper-parameter search makes a new accelerator for each trial: the engine of the one it
        # replaces is destroyed first (its hooks, its stage-3 process groups).
        previous = getattr(self, "accelerator", None)
        if isinstance(previous, EngineAccelerator) and previous.engine is not None:
            previous.free_memory()
        super().create_accelerator_and_postprocess()
        if not self.deepspeed_cpp_enabled:
            return
        # transformers names accelerate's class directly; the state (process group, gradient
        # state) is shared between Accelerator objects, so ours simply replaces it.
        self.accelerator = EngineAccelerator(**self._accelerator_args)
        self.accelerator.tensor_parallel_size = tensor_parallel_size(self.args.deepspeed_cpp_config)
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(
                self.gather_function, use_gather_object=self.args.eval_use_gather_object
            )

    # --- what the engine is built from --------------------------------------------------------
    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if self.deepspeed_cpp_enabled:
            self._forget_previous_engine()
            self._plan_engine(max_steps)
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def _forget_previous_engine(self) -> None:
        """Before an engine is built again: a second ``train()`` on this Trainer, or
        ``auto_find_batch_size``'s next try. The accelerator destroyed the last engine
        (``free_memory``); as transformers does when it initialises DeepSpeed again, the new one
        trains the model's current weights with a fresh optimizer and schedule."""
        if isinstance(self.model_wrapped, DeepSpeedEngine):
            # Else transformers takes the old engine for a wrapper it must not wrap again.
            self.model_wrapped = self.model
        if isinstance(self.optimizer, EngineOptimizer):
            caller_optimizer, caller_schedule = self._caller_optimizers
            if caller_optimizer is not None:
                raise ValueError(
                    "train() again after an engine trained with the optimizer passed in "
                    "Trainer(optimizers=...): the engine took its parameter groups over (ZeRO "
                    "keeps shards of them), so it cannot start another engine; expected a new "
                    "Trainer with a new optimizer, or Trainer(optimizer_cls_and_kwargs=...) so "
                    "that each train() builds its own"
                )
            self.optimizer = None
            self.lr_scheduler = caller_schedule
            self._created_lr_scheduler = False

    def _update_auto_batch_size(self, batch_size: int) -> None:
        super()._update_auto_batch_size(batch_size)
        if self.deepspeed_cpp_enabled:
            # The config's batch keys follow the batch auto_find_batch_size settled on (the
            # arguments keep the batch the user asked for).
            per_device = batch_size // max(1, self.args.n_gpu)
            self._config_for_found_batch = self.args.refill_deepspeed_cpp_config(per_device)

    def _hp_search_setup(self, trial) -> None:
        super()._hp_search_setup(trial)  # sets the trial's values on the arguments
        if self.deepspeed_cpp_enabled and self.hp_search_backend is not None and trial is not None:
            # "auto" keys (the optimizer's lr, the batch sizes, ...) take the trial's values; the
            # engine is built from this config when the trial trains.
            self.args.deepspeed_cpp_config = self.args.refill_deepspeed_cpp_config()
            self._config_for_found_batch = None

    def _engine_config(self) -> dict:
        found = self._config_for_found_batch
        return found if found is not None else self.args.deepspeed_cpp_config

    def _plan_engine(self, num_training_steps: int) -> None:
        config = fill_from_model_and_steps(
            self._engine_config(),
            self.model,
            num_training_steps,
            self.args.get_warmup_steps(num_training_steps),
        )
        given = self.lr_scheduler if not self._created_lr_scheduler else None
        if given is not None and "scheduler" in config:
            raise ValueError(
                "a scheduler was passed to the Trainer (optimizers=(..., scheduler)) and the "
                "ds_config has a 'scheduler' section too: expected one of them"
            )
        factory = given  # the caller's schedule object, stepped by the engine
        if "scheduler" not in config and given is None:

            def factory(engine_optimizer):
                # The Trainer's schedule (lr_scheduler_type, warm-up) on the engine's optimizer;
                # a shallow copy so that the Trainer's own lr_scheduler slot stays untouched.
                # (During prepare, self.optimizer is not yet the engine's view, so the call
                # reaches transformers' create_scheduler, through any subclass override.)
                builder = copy.copy(self)
                builder.lr_scheduler = None
                return builder.create_scheduler(num_training_steps, engine_optimizer)

        self.accelerator.plan_engine(EnginePlan(config, factory))

    def create_optimizer(self, model=None):
        if self.deepspeed_cpp_enabled and "optimizer" in self.args.deepspeed_cpp_config:
            return self.optimizer  # the engine builds the config's optimizer: nothing to make here
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if isinstance(self.optimizer, EngineOptimizer):
            # Called after prepare: the engine already holds its schedule (the config's or the
            # Trainer's, built in the plan's factory); the Trainer gets a view of it.
            self.lr_scheduler = EngineScheduler(self.optimizer.engine, self.accelerator)
            self._created_lr_scheduler = True  # a later train() plans its schedule afresh
            return self.lr_scheduler
        return super().create_scheduler(num_training_steps, optimizer)

    # --- checkpoints --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        engine = getattr(self.accelerator, "engine", None)
        if not self.deepspeed_cpp_enabled or engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Every rank joins the gather (ZeRO-3 parameters live in shards); rank 0 writes.
        state_dict = self.accelerator.get_state_dict(engine)
        self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        engine = getattr(self.accelerator, "engine", None)
        if not self.deepspeed_cpp_enabled or engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # The engine's checkpoint holds the optimizer, the schedule and the loss scale, per
        # rank: global_step<N>/ and `latest` beside transformers' files.
        engine.save_checkpoint(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        engine = getattr(self.accelerator, "engine", None)
        if not self.deepspeed_cpp_enabled or engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path, _ = engine.load_checkpoint(checkpoint)
        if path is None:
            raise ValueError(
                f"Can't find a valid checkpoint at {checkpoint}: no 'latest' file of "
                "deepspeed_cpp's engine there (expected a checkpoint-N folder written by this "
                "Trainer)"
            )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # transformers loads model.safetensors into the bare model before the engine exists; the
        # engine's checkpoint restores the same weights (and their fp32 masters) afterwards, so
        # that part is kept. A checkpoint without our engine's files cannot resume exactly.
        if self.deepspeed_cpp_enabled and not os.path.isfile(
            os.path.join(resume_from_checkpoint, "latest")
        ):
            raise ValueError(
                f"Can't find a valid checkpoint at {resume_from_checkpoint}: no 'latest' file of "
                "deepspeed_cpp's engine there (expected a checkpoint-N folder written by this "
                "Trainer with deepspeed=...)"
            )
        return super()._load_from_checkpoint(resume_from_checkpoint, model)


class Trainer(_EngineTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training with deepspeed_cpp's engine when ``args.deepspeed`` (a
    ds_config) is set; see the module docstring for what comes from where."""


class Seq2SeqTrainer(_EngineTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` training with deepspeed_cpp's engine, as ``Trainer``."""
