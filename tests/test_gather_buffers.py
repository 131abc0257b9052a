"""ZeRO-3's gather buffer pool (runtime/zero/gather_buffers.py): a buffer handed back is the one
the next gather of the same size, dtype and device takes, and the pool never keeps more than
twice the largest buffer handed back (oldest dropped first)."""

from __future__ import annotations

import torch

from deepspeed_cpp.runtime.zero.gather_buffers import GatherBuffers


def test_reuses_exact_matches_and_caps_what_it_keeps():
    pool = GatherBuffers()
    first = pool.take(1000, torch.float32, torch.device("cpu"))
    pool.give_back(first)
    assert pool.take(1000, torch.float32, torch.device("cpu")) is first  # reused
    assert pool.held_bytes() == 0
    pool.give_back(first)
    # Another size or dtype never gets it.
    assert pool.take(999, torch.float32, torch.device("cpu")) is not first
    assert pool.take(1000, torch.bfloat16, torch.device("cpu")) is not first
    # At most 2x the largest (4000 bytes here): the oldest goes first.
    others = [torch.empty(1000) for _ in range(2)]
    for buffer in others:
        pool.give_back(buffer)
    assert pool.held_bytes() == 8000
    assert pool.take(1000, torch.float32, torch.device("cpu")) is others[0]
    pool.clear()
    assert pool.held_bytes() == 0
