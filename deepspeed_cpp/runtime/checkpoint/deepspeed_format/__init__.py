"""Checkpoints written by DeepSpeed itself, read without unpickling arbitrary objects
(``restricted_load.py`` lists the classes admitted) and loaded into any ZeRO stage and world size
(``flat_partitions.py`` rebuilds each parameter; ``reassembled_reader.py`` hands them to the
same resharding code as deepspeed_cpp's own checkpoints)."""

from .checkpoint import DeepSpeedCheckpoint, read_deepspeed_checkpoint
from .files import is_deepspeed_checkpoint
from .restricted_load import ADMITTED, load_deepspeed_file

__all__ = [
    "ADMITTED",
    "DeepSpeedCheckpoint",
    "is_deepspeed_checkpoint",
    "load_deepspeed_file",
    "read_deepspeed_checkpoint",
]
