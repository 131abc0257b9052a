"""What a checkpoint reads of an engine, and how it restores one: the only way
``save_checkpoint`` and ``load_checkpoint`` reach the engine.

The engine hands over a ``CheckpointSubject`` (``engine_checkpoints.py`` builds it): plain
facts (ranks, world sizes, stage number, the config), the model, the ZeRO stage through its
``ZeroStage`` interface (``runtime/zero/stage.py``: ``layout_parts()``, ``owned_ranges()``,
``stream_shard_state()``, ...; never a stage class), its progress as a ``TrainState``, and the
three engine operations a checkpoint needs. Nothing here names an engine attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..train_state import TrainState

if TYPE_CHECKING:
    from ..zero.stage import ZeroStage


@dataclass(frozen=True)
class CheckpointSubject:
    """An engine as checkpoints see it (see the module docstring).

    ``zero``: the stage that trains (None: no optimizer); ``expert_parallel``: the model has
    expert-parallel MoE layers, whose experts differ between ranks; ``full_module_state_dict(
    rank0_only)``: the whole model's state dict, experts under global names (collective);
    ``load_full_module_state(state_dict)``: loads such a dict (partitioned at ZeRO-3);
    ``whole_model_state_dict(rank0_only)``: the same with AutoTP's slices gathered (what
    ``save_16bit_model`` writes; ``gathers_16bit_weights_on_save``: ZeRO-3 may gather it);
    ``restore_train_state(state, scheduler=, lrs_from_scheduler=)``: takes the counters, the
    loss scaler's state and (``scheduler``) the schedule's, with ``lrs_from_scheduler`` also
    writing the schedule's learning rates into the param groups; ``check_train_state(state,
    scheduler=, scheduler_type=)``: raises (ValueError) where that would, changing nothing."""

    module: torch.nn.Module
    zero: ZeroStage | None
    zero_stage: int
    global_rank: int
    dp_rank: int
    dp_world_size: int
    group: object
    mp_rank: int
    mp_world_size: int
    device: torch.device
    ds_config: dict
    expert_parallel: bool
    gathers_16bit_weights_on_save: bool
    train_state: TrainState
    full_module_state_dict: Callable[[bool], dict]
    whole_model_state_dict: Callable[[bool], dict]
    load_full_module_state: Callable[[dict], None]
    check_train_state: Callable[..., None]
    restore_train_state: Callable[..., None]
    tag_validation: str = "WARN"
    """``checkpoint.tag_validation`` (``tag_agreement.py``): what differing tags do."""
