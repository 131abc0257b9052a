"""How far training has come, as plain data: what a checkpoint saves of an engine besides the
model and the optimizer's shards, and restores into it (``runtime/checkpoint``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainState:
    """The engine's counters and the state dicts of its schedule and loss scaler.

    ``optimizer_skipped_steps`` is the ZeRO stage's own count (it may differ from
    ``skipped_steps`` after a load: DeepSpeed keeps both); ``lr_scheduler`` and ``loss_scaler``
    are ``state_dict()``s, None where the engine has none."""

    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int
    gradient_accumulation_steps: int
    optimizer_skipped_steps: int = 0
    lr_scheduler: dict | None = None
    lr_scheduler_type: str | None = None
    loss_scaler: dict | None = None

    @classmethod
    def from_payload(cls, payload: dict) -> TrainState:
        """The state as a checkpoint's module-states file holds it (its keys are these
        fields' names; ``lr_scheduler_type`` is recorded in the metadata instead)."""
        return cls(
            global_steps=payload["global_steps"],
            global_samples=payload["global_samples"],
            micro_steps=payload["micro_steps"],
            skipped_steps=payload["skipped_steps"],
            gradient_accumulation_steps=payload["gradient_accumulation_steps"],
            optimizer_skipped_steps=payload.get("optimizer_skipped_steps", 0),
            lr_scheduler=payload.get("lr_scheduler"),
            loss_scaler=payload.get("loss_scaler"),
        )

    def payload(self) -> dict:
        """The fields a module-states file records (see ``from_payload``)."""
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "micro_steps": self.micro_steps,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "skipped_steps": self.skipped_steps,
            "optimizer_skipped_steps": self.optimizer_skipped_steps,
            "lr_scheduler": self.lr_scheduler,
            "loss_scaler": self.loss_scaler,
        }
