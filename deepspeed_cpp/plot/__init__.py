"""``python -m deepspeed_cpp.plot <csv_monitor dir | tensorboard dir> [-o curves.png]``: the
loss, learning-rate and loss-scale curves of a run, and its ``Train/Eval/...`` scalars, drawn to
one PNG (matplotlib)."""

from .curves import plot_run, read_run

__all__ = ["plot_run", "read_run"]
