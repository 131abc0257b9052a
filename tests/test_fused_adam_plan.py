"""The fused Adam launch planner (host C++, csrc/fused_adam/multi_tensor_plan.cpp), through the
host test library: coverage, capacities, empty, huge and many tiny tensors, and bad input."""

import math

import pytest
import torch
from fused_adam_plan_check import check_plan

from deepspeed_cpp.ops.fused_adam import load_fused_adam_host_emulation


@pytest.fixture(scope="module")
def test_ops():
    load_fused_adam_host_emulation()
    return torch.ops.deepspeed_cpp_fused_adam_test


@pytest.mark.parametrize("capacity", [(7, 3, 5), (1, 1, 1), (64, 36, 440), (65536, 36, 440)])
def test_random_lists_are_covered_exactly_once(test_ops, capacity):
    chunk = capacity[0]
    edge_sizes = [0, 1, chunk - 1, chunk, chunk + 1, 3 * chunk, 5 * chunk + 3]
    for _ in range(20):
        count = int(torch.randint(1, 60, ()))
        numels = [
            edge_sizes[int(torch.randint(len(edge_sizes), ()))]
            if torch.rand(()) < 0.5
            else int(torch.randint(0, 4 * chunk + 2, ()))
            for _ in range(count)
        ]
        numels = [max(0, n) for n in numels]
        check_plan(test_ops, numels, *capacity)


def test_empty_tensors_get_no_slot_and_empty_lists_no_launch(test_ops):
    blocks, slots = check_plan(test_ops, [0, 5, 0, 0, 3, 0], 4, 36, 440)
    assert [row[2] for row in slots] == [1, 4]
    assert [row[2:] for row in blocks] == [[1, 0], [1, 1], [4, 0]]
    for numels in ([], [0], [0, 0, 0]):
        blocks, slots = test_ops.plan(numels, 65536, 36, 440)
        assert blocks.shape == (0, 4) and slots.shape == (0, 3)


def test_hundreds_of_tiny_tensors_fill_the_slots(test_ops):
    numels = [int(n) for n in torch.randint(1, 4, (500,))]
    blocks, _ = check_plan(test_ops, numels, 65536, 36, 440)
    assert len({row[0] for row in blocks}) == math.ceil(500 / 36)


def test_a_large_tensor_spans_launches(test_ops):
    # 3e9 elements (past 2^31: chunk offsets need 64 bits) between two small tensors.
    numels = [10, 3_000_000_001, 7]
    blocks, slots = check_plan(test_ops, numels, 65536, 36, 440)
    chunks = math.ceil(numels[1] / 65536)
    assert len({row[0] for row in blocks}) == math.ceil((1 + chunks + 1) / 440)
    # The huge tensor takes a slot in every launch.
    assert {row[0] for row in slots if row[2] == 1} == {row[0] for row in blocks}


def test_a_huge_tensor_with_large_chunks(test_ops):
    numels = [2**40 + 5]
    blocks, _ = test_ops.plan(numels, 2**24, 36, 440)
    assert blocks.shape[0] == 2**16 + 1
    assert blocks[:, 3].tolist() == list(range(2**16 + 1))
    assert len(set(blocks[:, 0].tolist())) == math.ceil((2**16 + 1) / 440)


def test_argument_block_fits_the_kernel_parameter_limit(test_ops):
    size, limit, max_tensors, max_blocks, chunk, threads = test_ops.argument_block()
    assert size <= limit == 4096
    # The block table is one byte of slot and four of chunk: it could not hold 8 more blocks.
    assert size + 8 * 5 > limit
    assert (max_tensors, max_blocks, chunk, threads) == (36, 440, 65536, 512)


def test_too_many_chunks_to_number_is_refused(test_ops):
    numel = (2**31) * 65536
    with pytest.raises(RuntimeError, match=r"tensor 1 has 140737488355328 elements.*at most "):
        test_ops.plan([5, numel], 65536, 36, 440)


@pytest.mark.parametrize(
    "args, message",
    [
        (([5], 0, 36, 440), "chunk_elements must be >= 1, got 0"),
        (
            ([5], 8, 0, 440),
            "max_tensors and max_blocks must be >= 1, got 0 and 440",
        ),
        (([5, -2], 8, 36, 440), "tensor 1 has -2 elements"),
        # 2^32 + 3 is 3 as an int: refused, not planned with 3 slots.
        (([5], 8, 2**32 + 3, 440), "must be at most 2147483647, got 4294967299 and 440"),
    ],
)
def test_bad_plan_arguments(test_ops, args, message):
    with pytest.raises(RuntimeError, match=message):
        test_ops.plan(*args)
