"""Checkpoints of the engine: per-rank shard files, plain-data metadata, atomic publication.

``save_checkpoint`` / ``load_checkpoint`` back ``DeepSpeedEngine``'s methods of the same names.
A checkpoint saved at any world size and ZeRO stage (0-3) loads at any other (``reshard.py``);
``deepspeed_cpp.utils.zero_to_fp32`` turns one into a plain fp32 ``state_dict`` without an
engine. The file layout is described in ``layout.py``, the metadata in ``metadata.py``.
Models with MoE layers save each expert in a file of its own and name experts globally, so that
their checkpoints also load at another ``ep_size`` (``expert_files.py``, ``expert_layout.py``).
``model_save.py`` backs ``save_16bit_model`` (the model alone, in its own dtype, one file).
"""

from .errors import (
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    IncompleteCheckpointError,
    ModelParallelMismatchError,
    PickleNotAllowedError,
    UnsafeCheckpointError,
)
from .finite_parameters import NonFiniteParametersError
from .loader import load_checkpoint
from .saver import save_checkpoint

__all__ = [
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointSaveError",
    "IncompleteCheckpointError",
    "ModelParallelMismatchError",
    "NonFiniteParametersError",
    "PickleNotAllowedError",
    "UnsafeCheckpointError",
    "load_checkpoint",
    "save_checkpoint",
]
