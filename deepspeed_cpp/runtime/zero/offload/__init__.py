"""ZeRO-Offload / ZeRO-Infinity: optimizer state and parameters kept in host memory or on NVMe."""

from .swap_files import (
    AioSettings,
    StaleSwapFileError,
    SwapFileError,
    SwapFolder,
    SwapTicket,
    remove_stale_folders,
)

__all__ = [
    "AioSettings",
    "StaleSwapFileError",
    "SwapFileError",
    "SwapFolder",
    "SwapTicket",
    "remove_stale_folders",
]
