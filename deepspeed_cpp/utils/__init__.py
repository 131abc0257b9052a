"""Utilities; ``logger`` is re-exported where DeepSpeed has it (``deepspeed.utils.logger``)."""

from .logging import logger

__all__ = ["logger"]
