"""Utilities under DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``RepeatingLoader``,
``OnDevice``, and (on first use) the ZeRO tensor-fragment API and ``groups``."""

from .init_on_device import OnDevice
from .logging import logger
from .repeating_loader import RepeatingLoader

__all__ = ["OnDevice", "RepeatingLoader", "logger"]
