"""Checks the aio and swap-file tests share: an error message naming what it must, and random
payloads of any dtype (every byte value for uint8)."""

from __future__ import annotations

import torch


def assert_names(message, *parts):
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"


def random_payload(numel, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8)
    return torch.randn(numel).to(dtype)
