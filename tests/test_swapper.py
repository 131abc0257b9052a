"""TensorSwapper: tensors out to a folder and back through two pinned buffers, with a computation
on every chunk that checks it against the original tensors while the next chunk is in flight."""

import os

import pytest
import torch

from deepspeed_cpp.ops.aio import usable_engines
from deepspeed_cpp.runtime.swap import TensorSwapper

CHUNK = 16 * 4096  # small, so that every tensor below spans several chunks or none


def _tensors():
    """Odd sizes around the chunk boundaries, several dtypes, an empty tensor, a 2-D one."""
    return [
        torch.randn(2 * CHUNK // 4 + 3),  # float32: two full chunks and 3 elements
        torch.randn(5).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (CHUNK // 8,)),  # int64: exactly one chunk
        torch.randn(1, dtype=torch.float64),
        torch.empty(0),
        torch.randint(0, 256, (3 * CHUNK - 1,), dtype=torch.uint8),
        torch.randn(37, 129),
    ]


def _expected_chunks(tensors):
    """(index, offset, count) of every chunk, computed from the sizes alone."""
    chunks = []
    for index, tensor in enumerate(tensors):
        per_chunk = CHUNK // tensor.element_size()
        if tensor.numel() == 0:
            chunks.append((index, 0, 0))
        for start in range(0, tensor.numel(), per_chunk):
            chunks.append((index, start, min(per_chunk, tensor.numel() - start)))
    return chunks


class ChunkChecker:
    """The caller's computation: checks each chunk against the original tensors, records what
    it saw and whether the transfer of a neighbouring chunk was in flight meanwhile."""

    def __init__(self, swapper, originals):
        self.swapper, self.originals = swapper, [t.reshape(-1) for t in originals]
        self.seen, self.in_flight = [], []

    def __call__(self, index, offset, chunk):
        assert chunk.dim() == 1 and chunk.dtype == self.originals[index].dtype
        expected = self.originals[index][offset : offset + chunk.numel()]
        assert torch.equal(chunk, expected), f"chunk of tensor {index} at {offset} differs"
        assert chunk.data_ptr() % 4096 == 0  # a pinned, page-aligned buffer
        self.seen.append((index, offset, chunk.numel()))
        self.in_flight.append(self.swapper.requests_in_flight())


@pytest.mark.parametrize("engine", usable_engines())
def test_swap_out_and_in_with_a_checking_computation_on_every_chunk(engine, tmp_path):
    swapper = TensorSwapper(chunk_bytes=CHUNK, block_size=4 * 4096, queue_depth=4, engine=engine)
    assert swapper.engine() == engine
    originals = _tensors()
    sources = [t.clone() for t in originals]
    expected_chunks = _expected_chunks(originals)

    checker = ChunkChecker(swapper, originals)
    paths = swapper.swap_out(sources, tmp_path, on_chunk=checker)
    assert checker.seen == expected_chunks
    # From the second chunk on, the previous chunk's write is in flight during the computation.
    assert checker.in_flight[0] == 0 and all(n == 1 for n in checker.in_flight[1:])
    assert swapper.requests_in_flight() == 0
    for path, original in zip(paths, originals):
        assert path.read_bytes() == original.reshape(-1).view(torch.uint8).numpy().tobytes()
    for source, original in zip(sources, originals):
        assert torch.equal(source, original)  # swap_out leaves the sources alone

    targets = [torch.full_like(t, 3) for t in originals]
    checker = ChunkChecker(swapper, originals)
    swapper.swap_in(targets, tmp_path, on_chunk=checker)
    assert checker.seen == expected_chunks
    # Until the last chunk, the next chunk's read is in flight during the computation.
    assert all(n == 1 for n in checker.in_flight[:-1]) and checker.in_flight[-1] == 0
    for target, original in zip(targets, originals):
        assert torch.equal(target, original)


def test_changes_made_by_the_computation_are_what_moves(tmp_path):
    swapper = TensorSwapper(chunk_bytes=CHUNK)
    source = torch.randn(3 * CHUNK // 4 + 11)
    original = source.clone()

    def double(index, offset, chunk):
        chunk.mul_(2)

    swapper.swap_out([source], tmp_path, on_chunk=double)
    assert torch.equal(source, original)
    target = torch.empty_like(source)
    swapper.swap_in([target], tmp_path)
    assert torch.equal(target, original * 2)
    swapper.swap_in([target], tmp_path, on_chunk=double)  # e.g. an update applied on the way in
    assert torch.equal(target, original * 4)


def test_swap_out_replaces_a_larger_earlier_swap(tmp_path):
    swapper = TensorSwapper(chunk_bytes=CHUNK)
    swapper.swap_out([torch.randn(5 * CHUNK)], tmp_path)
    smaller = torch.randn(CHUNK // 4 + 1)
    (path,) = swapper.swap_out([smaller], tmp_path)
    assert os.path.getsize(path) == smaller.numel() * 4
    back = torch.empty_like(smaller)
    swapper.swap_in([back], tmp_path)
    assert torch.equal(back, smaller)


def test_a_failing_computation_leaves_nothing_in_flight(tmp_path):
    swapper = TensorSwapper(chunk_bytes=CHUNK)
    tensors = [torch.randn(4 * CHUNK // 4)]

    def fail_on_third(index, offset, chunk):
        if offset >= 2 * CHUNK // 4:
            raise ValueError("computation failed")

    with pytest.raises(ValueError, match="computation failed"):
        swapper.swap_out(tensors, tmp_path, on_chunk=fail_on_third)
    assert swapper.requests_in_flight() == 0
    swapper.swap_out(tensors, tmp_path)  # still usable
    back = torch.empty_like(tensors[0])
    with pytest.raises(ValueError, match="computation failed"):
        swapper.swap_in([back], tmp_path, on_chunk=fail_on_third)
    assert swapper.requests_in_flight() == 0
    swapper.swap_in([back], tmp_path)
    assert torch.equal(back, tensors[0])


def test_swap_in_checks_the_files(tmp_path):
    swapper = TensorSwapper(chunk_bytes=CHUNK)
    swapper.swap_out([torch.randn(100)], tmp_path)
    path = TensorSwapper.file_for(tmp_path, 0)
    with pytest.raises(ValueError, match=r"has 400 bytes, but tensor 0 \(101 x torch.float32\)"):
        swapper.swap_in([torch.empty(101)], tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tensor_00001.swap \(tensor 1\) is gone"):
        swapper.swap_in([torch.empty(100), torch.empty(3)], tmp_path)
    assert path.is_file()


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096, got 10"):
        TensorSwapper(chunk_bytes=1000)
    swapper = TensorSwapper(chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match=r"tensors\[1\] must be contiguous, got strides \(1, 4\)"):
        swapper.swap_out([torch.zeros(3), torch.zeros(4, 4).t()], tmp_path)
    with pytest.raises(ValueError, match=r"tensors\[0\] must be a CPU tensor, got device meta"):
        swapper.swap_in([torch.zeros(3, device="meta")], tmp_path)
    with pytest.raises(TypeError, match=r"tensors\[0\] must be a torch.Tensor, got list"):
        swapper.swap_out([[1.0]], tmp_path)
