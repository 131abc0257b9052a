"""The invariants of a fused Adam launch plan (csrc/fused_adam/multi_tensor_plan.cpp), checked
against a plain reading of its table: by the planner's tests (``test_fused_adam_plan.py``) and
its fuzz (``test_op_fuzz_aio_fused_adam.py``)."""

from __future__ import annotations

import math


def check_plan(test_ops, numels, chunk, max_tensors, max_blocks):
    """Plans `numels` and checks every invariant against a plain reading of the table."""
    blocks, slots = test_ops.plan(numels, chunk, max_tensors, max_blocks)
    blocks, slots = blocks.tolist(), slots.tolist()
    # Every element of every tensor exactly once: chunk c of tensor t covers
    # [c * chunk, min((c + 1) * chunk, numel)), so the chunks of t must be exactly 0..ceil-1.
    chunks_seen = {}
    for _, _, tensor, chunk_index in blocks:
        chunks_seen.setdefault(tensor, []).append(chunk_index)
    for tensor, numel in enumerate(numels):
        expected = list(range(math.ceil(numel / chunk)))
        assert sorted(chunks_seen.get(tensor, [])) == expected, f"tensor {tensor} ({numel})"
    # List order is kept: the (tensor, chunk) pairs come out sorted.
    pairs = [(tensor, chunk_index) for _, _, tensor, chunk_index in blocks]
    assert pairs == sorted(pairs)
    # Per launch: within capacity, slots distinct and all used, blocks name their slot's tensor.
    launches = sorted({row[0] for row in blocks})
    assert launches == list(range(len(launches)))
    assert sorted({row[0] for row in slots}) == launches, "a launch with slots but no block"
    for launch in launches:
        launch_slots = {s: t for l_, s, t in slots if l_ == launch}
        launch_blocks = [row for row in blocks if row[0] == launch]
        assert len(launch_slots) <= max_tensors and len(launch_blocks) <= max_blocks
        assert sorted(launch_slots) == list(range(len(launch_slots)))
        assert len(set(launch_slots.values())) == len(launch_slots)
        assert {row[1] for row in launch_blocks} == set(launch_slots), "an unused slot"
        for _, slot, tensor, _ in launch_blocks:
            assert launch_slots[slot] == tensor
        # Greedy: a launch other than the last is closed only when it is full.
        if launch != launches[-1]:
            assert len(launch_blocks) == max_blocks or len(launch_slots) == max_tensors
    return blocks, slots
