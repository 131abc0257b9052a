"""Which files make a DeepSpeed checkpoint, and how to tell one from a deepspeed_cpp checkpoint.

DeepSpeed's layout (shown for one model-parallel rank, ``mp_rank_00``; with tensor parallelism,
AutoTP's ``tensor_parallel.autotp_size`` N, every file exists once per TP rank ``mp_rank_XX``,
XX < N, each holding that rank's slices: ``tensor_parallel.py`` joins them)::

    save_dir/latest                                     the newest tag, e.g. "global_step2"
    save_dir/<tag>/mp_rank_00_model_states.pt           ZeRO 0-2: module, counters, scheduler,
                                                        param_shapes, and the client state's keys
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   ZeRO 3: the same, one per rank
    save_dir/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r's flat fp32 partition
                                                        and its Adam state (ZeRO 1-3)
    save_dir/<tag>/bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt   the same, bf16
                                                        (DeepSpeed's BF16_Optimizer)
    save_dir/<tag>/layer_<L>_expert_<E>_mp_rank_00_model_states.pt   MoE models: global expert
                                                        E of MoE layer L (the model-states file
                                                        holds everything else)

deepspeed_cpp's own checkpoints reuse two of these names but always hold ``checkpoint_meta.json``
and ``client_state.pt``; a folder with neither and a DeepSpeed model-states file is DeepSpeed's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointMismatchError, IncompleteCheckpointError
from ..layout import CLIENT_STATE_FILE, METADATA_FILE, MODULE_FILE


def model_file(mp_rank: int = 0) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero3_model_file(rank: int, mp_rank: int = 0) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def optim_file(rank: int, bf16: bool, mp_rank: int = 0) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


_MP_RANK = re.compile(r"mp_rank_(\d+)_")


def is_deepspeed_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` (one tag's folder) looks like a checkpoint DeepSpeed wrote."""
    if (directory / METADATA_FILE).exists() or (directory / CLIENT_STATE_FILE).exists():
        return False
    return (directory / MODULE_FILE).is_file() or (directory / zero3_model_file(0)).is_file()


@dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint: the model states file rank 0 wrote and the
    optimizer states files of ranks ``0..world_size-1`` (empty without ZeRO)."""

    model: Path
    optim: tuple[Path, ...]
    bf16: bool
    experts: tuple[Path, ...] = ()


def find_files(
    directory: Path, world_size: int, mp_rank: int = 0, mp_world_size: int = 1
) -> DeepSpeedFiles:
    """The files of model-parallel rank ``mp_rank`` (of ``mp_world_size``) of the DeepSpeed
    checkpoint in ``directory`` saved by ``world_size`` data-parallel ranks;
    IncompleteCheckpointError naming the first one missing, CheckpointMismatchError naming a
    file of a model-parallel rank the model states do not announce."""
    model = directory / model_file(mp_rank)
    if not model.is_file():
        model = directory / zero3_model_file(0, mp_rank)
    unannounced = sorted(
        p.name
        for p in directory.glob("*mp_rank_*")
        if (found := _MP_RANK.search(p.name)) and int(found.group(1)) >= mp_world_size
    )
    if unannounced:
        raise CheckpointMismatchError(
            f"{directory} is a DeepSpeed checkpoint with model (tensor or pipeline) parallel "
            f"ranks ({unannounced[0]}) that its model states do not announce (mp_world_size "
            f"{mp_world_size})"
        )
    experts = tuple(sorted(directory.glob(f"*expert_*_mp_rank_{mp_rank:02d}_*")))
    bf16 = (directory / optim_file(0, True, mp_rank)).is_file()
    if not bf16 and not (directory / optim_file(0, False, mp_rank)).is_file():
        return DeepSpeedFiles(model, (), bf16=False, experts=experts)
    optim = tuple(directory / optim_file(rank, bf16, mp_rank) for rank in range(world_size))
    for path in optim:
        if not path.is_file():
            raise IncompleteCheckpointError(
                f"DeepSpeed checkpoint {directory} is incomplete: {path.name} is missing (its "
                f"model states say {world_size} data-parallel ranks saved it)"
            )
    return DeepSpeedFiles(model, optim, bf16, experts)
