"""What scripts ask the engine about its configuration and state (DeepSpeed's reader methods:
accumulation steps, batch sizes, precision, ZeRO stage, learning rates, norms, loss scale)."""

from __future__ import annotations

import torch


class EngineConfigReaders:
    """Mixed into ``DeepSpeedEngine``: reads its ``config``, ``optimizer`` and ``loss_scaler``."""

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

    def gradient_clipping(self) -> float:
        """The config's ``gradient_clipping`` (0: none)."""
        return self._config.gradient_clipping

    def get_global_grad_norm(self) -> float | None:
        return self.optimizer.global_grad_norm if self.optimizer is not None else None

    def get_loss_scale(self) -> float:
        return self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0

    @property
    def communication_data_type(self) -> torch.dtype:
        return torch.float32
