"""The aio handle against the file's bytes as plain Python reads them: every engine, odd sizes and
offsets, aligned and unaligned tensors, many requests in flight, and the errors of bad requests
and settings.

Covering design: every size x offset x alignment runs on every engine the machine has, the
64 MiB size included (5 to 7 s per engine here); the handle's settings (depth, workers,
single_submit, overlap_events) are varied by the many-requests test instead, on small files.
Full disks, read-only files and file systems without O_DIRECT: test_aio_file_systems.py.
"""

import gc
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from disk_folders import o_direct_works, on_a_real_disk
from swap_helpers import assert_names, file_bytes, random_bytes, run_python_json

from deepspeed_cpp.ops import aio
from deepspeed_cpp.ops.aio import AsyncIOHandle, usable_engines
from deepspeed_cpp.ops.op_builder import AsyncIOBuilder

PAGE = 4096
SIZES = [1, 511, 4096, 2**20 + 3, 64 * 2**20]
OFFSETS = [0, 4096, 12345]
ENGINES = usable_engines()


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A folder on a real disk file system, so that O_DIRECT is exercised (tmpfs only emulates
    it): pytest's temporary folder when it is one, else one under the repository's build/."""
    folder = tmp_path_factory.mktemp("aio")
    if not on_a_real_disk(folder):
        folder = REPO_ROOT / "build" / f"aio_test_{os.getpid()}"
        folder.mkdir(parents=True, exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


pytestmark = pytest.mark.usefixtures("aio_library")  # compiled before any subprocess needs it


def _tensor(handle, n, aligned):
    if aligned:
        return handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8))
    return torch.empty(n + 1, dtype=torch.uint8)[1:]  # one byte past a 64-byte boundary


def _expected_layout(tensor, offset):
    """Bytes of a request that go through O_DIRECT (the whole pages of the file range), through
    the page cache (the rest) and through a bounce buffer (direct bytes whose memory is not
    page-aligned)."""
    n = tensor.numel()
    body_begin = -(-offset // PAGE) * PAGE
    body_end = (offset + n) // PAGE * PAGE
    direct = max(0, body_end - body_begin)
    bounced = direct if (tensor.data_ptr() + body_begin - offset) % PAGE else 0
    return direct, n - direct, bounced


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_round_trips_every_size_offset_and_alignment(engine, disk_dir):
    handle = AsyncIOHandle(engine=engine)
    assert handle.get_engine() == engine
    direct_ok = o_direct_works(disk_dir)
    for size in SIZES:
        for offset in OFFSETS:
            for aligned in (True, False):
                path = disk_dir / f"{engine}_{size}_{offset}_{aligned}.bin"
                data = random_bytes(size)
                source = _tensor(handle, size, aligned)
                source.copy_(data)
                before = handle.get_stats()
                assert handle.sync_pwrite(source, path, offset) == 1
                assert os.path.getsize(path) == offset + size
                assert file_bytes(path, 0, offset) == bytes(offset)  # a hole reads as zeros
                assert file_bytes(path, offset) == data.numpy().tobytes()
                target = _tensor(handle, size, aligned)
                target.fill_(0)
                assert handle.sync_pread(target, path, offset) == 1
                assert torch.equal(target, data), f"{size} bytes at {offset}, aligned={aligned}"
                after = handle.get_stats()
                moved = {k: after[k] - before[k] for k in after}
                if direct_ok:
                    layouts = [_expected_layout(t, offset) for t in (source, target)]
                else:
                    layouts = [(0, size, 0)] * 2
                expected = [sum(column) for column in zip(*layouts)]
                assert [moved["direct_bytes"], moved["buffered_bytes"],
                        moved["bounced_bytes"]] == expected  # fmt: skip
                if aligned and offset % PAGE == 0:
                    assert moved["bounced_bytes"] == 0
                os.unlink(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.complex64])
def test_round_trip_keeps_every_dtype_bitwise(dtype, disk_dir):
    handle = AsyncIOHandle(block_size=8 * PAGE, queue_depth=4)
    source = torch.randn(3001, dtype=torch.float32).to(dtype)
    if dtype == torch.int64:
        source = torch.randint(-(2**62), 2**62, (3001,))
    path = disk_dir / f"dtype_{dtype}.bin"
    handle.sync_pwrite(source, path)
    assert file_bytes(path) == source.view(torch.uint8).numpy().tobytes()
    target = torch.empty_like(source)
    handle.sync_pread(target, path)
    assert torch.equal(target.view(torch.uint8), source.view(torch.uint8))


@pytest.mark.parametrize(
    "queue_depth, parallelism, single_submit, overlap_events",
    [(4, 3, False, True), (2, 1, True, True), (5, 2, False, False), (32, 1, True, False)],
)
@pytest.mark.parametrize("engine", ENGINES)
def test_many_requests_in_flight(engine, queue_depth, parallelism, single_submit,
                                 overlap_events, disk_dir):  # fmt: skip
    handle = AsyncIOHandle(4 * PAGE, queue_depth, single_submit, overlap_events, parallelism,
                           engine=engine)  # fmt: skip
    settings = (handle.get_queue_depth(), handle.get_intra_op_parallelism(),
                handle.get_single_submit(), handle.get_overlap_events())  # fmt: skip
    assert settings == (queue_depth, parallelism, single_submit, overlap_events)
    # 40 files of odd sizes, plus one file written as 8 disjoint parts at their offsets.
    sizes = torch.randint(1, 300_000, (40,)).tolist()
    sources = [random_bytes(n) for n in sizes]
    for i, source in enumerate(sources):
        handle.async_pwrite(source, disk_dir / f"many_{i}.bin")
    shared = random_bytes(8 * 50_001)
    handle.async_pwrite(shared[:50_001], disk_dir / "many_shared.bin", 0)  # offset 0 first
    for part in range(1, 8):
        piece = shared[part * 50_001 : (part + 1) * 50_001]
        handle.async_pwrite(piece, disk_dir / "many_shared.bin", part * 50_001)
    assert handle.pending_requests() == 48
    assert handle.wait() == 48
    assert handle.pending_requests() == 0
    assert handle.wait() == 0
    targets = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for i, target in enumerate(targets):
        handle.async_pread(target, disk_dir / f"many_{i}.bin")
    shared_back = torch.empty_like(shared)
    handle.async_pread(shared_back, disk_dir / "many_shared.bin")
    assert handle.wait() == 41
    for source, target in zip(sources, targets):
        assert torch.equal(source, target)
    assert torch.equal(shared_back, shared)
    assert file_bytes(disk_dir / "many_shared.bin") == shared.numpy().tobytes()


def test_intra_op_parallelism_splits_one_large_request(disk_dir):
    handle = AsyncIOHandle(block_size=16 * PAGE, queue_depth=3, intra_op_parallelism=4)
    data = random_bytes(37 * 16 * PAGE + 777)
    handle.sync_pwrite(data, disk_dir / "split.bin", 12345)
    back = torch.empty_like(data)
    handle.sync_pread(back, disk_dir / "split.bin", 12345)
    assert torch.equal(back, data)
    assert file_bytes(disk_dir / "split.bin", 12345) == data.numpy().tobytes()


# --- write semantics --------------------------------------------------------------------------


def test_write_at_offset_zero_replaces_and_shrinks_the_file(disk_dir):
    handle = AsyncIOHandle()
    path = disk_dir / "shrink.bin"
    handle.sync_pwrite(random_bytes(2**20 + 3), path)
    small = random_bytes(511)
    handle.sync_pwrite(small, path)
    assert os.path.getsize(path) == 511
    assert file_bytes(path) == small.numpy().tobytes()
    assert handle.sync_pwrite(torch.empty(0), path) == 1
    assert os.path.getsize(path) == 0


def test_write_at_offset_zero_without_truncate_keeps_the_length(disk_dir):
    handle = AsyncIOHandle()
    path = disk_dir / "keep_length.bin"
    original = random_bytes(3 * PAGE + 5)
    handle.sync_pwrite(original, path)
    head = random_bytes(PAGE + 1)
    handle.sync_pwrite(head, path, truncate=False)
    assert file_bytes(path) == torch.cat([head, original[PAGE + 1 :]]).numpy().tobytes()
    # Writing a file in parts, the one at offset 0 last: it does not cut off the others.
    parts = [random_bytes(2 * PAGE) for _ in range(4)]
    for i in (1, 2, 3, 0):
        handle.async_pwrite(parts[i], path, i * 2 * PAGE, truncate=False)
    handle.wait()
    assert file_bytes(path) == torch.cat(parts).numpy().tobytes()


def test_write_at_an_offset_changes_only_those_bytes(disk_dir):
    handle = AsyncIOHandle()
    path = disk_dir / "patch.bin"
    original = random_bytes(3 * PAGE + 100)
    handle.sync_pwrite(original, path)
    patch = random_bytes(PAGE + 7)
    handle.sync_pwrite(patch, path, 5000)
    expected = original.clone()
    expected[5000 : 5000 + patch.numel()] = patch
    assert file_bytes(path) == expected.numpy().tobytes()
    tail = random_bytes(2 * PAGE)  # extends the file past its end
    handle.sync_pwrite(tail, path, 3 * PAGE)
    expected = torch.cat([expected[: 3 * PAGE], tail])
    assert file_bytes(path) == expected.numpy().tobytes()


# --- errors -----------------------------------------------------------------------------------


def test_read_past_the_end_of_the_file(disk_dir):
    handle = AsyncIOHandle()
    path = disk_dir / "short.bin"
    handle.sync_pwrite(random_bytes(1000), path)
    with pytest.raises(RuntimeError) as error:
        handle.sync_pread(torch.empty(600, dtype=torch.uint8), path, 500)
    assert_names(str(error.value), "read of 600 bytes", f"'{path}'", "at file offset 500",
                 "the file has 1000 bytes", "reading past the end")  # fmt: skip


def test_missing_directory_for_read_and_write(disk_dir):
    handle = AsyncIOHandle()
    path = disk_dir / "no_such_dir" / "x.bin"
    with pytest.raises(RuntimeError) as error:
        handle.sync_pwrite(random_bytes(4097), path, 4096)
    assert_names(str(error.value), "write of 4097 bytes", f"'{path}'", "at file offset 4096",
                 "No such file or directory", "ENOENT")  # fmt: skip
    with pytest.raises(RuntimeError) as error:
        handle.sync_pread(torch.empty(3, dtype=torch.uint8), path)
    assert_names(str(error.value), "read of 3 bytes", "ENOENT")


def test_every_failed_request_is_listed_and_the_handle_stays_usable(disk_dir):
    handle = AsyncIOHandle(block_size=PAGE, queue_depth=2, intra_op_parallelism=2)
    good = [random_bytes(n) for n in (10, 70_000, PAGE)]
    handle.async_pwrite(good[0], disk_dir / "good0.bin")
    handle.async_pwrite(random_bytes(5), disk_dir / "missing" / "a.bin")
    handle.async_pwrite(good[1], disk_dir / "good1.bin")
    handle.async_pread(torch.empty(9, dtype=torch.uint8), disk_dir / "missing" / "b.bin", 77)
    handle.async_pwrite(good[2], disk_dir / "good2.bin")
    with pytest.raises(RuntimeError) as error:
        handle.wait()
    message = str(error.value)
    assert_names(message, "2 of 5 requests failed", "write of 5 bytes", "missing/a.bin",
                 "read of 9 bytes", "missing/b.bin", "at file offset 77")  # fmt: skip
    assert "good" not in message
    assert handle.pending_requests() == 0
    for i, data in enumerate(good):
        assert file_bytes(disk_dir / f"good{i}.bin") == data.numpy().tobytes()
    back = torch.empty_like(good[1])
    assert handle.sync_pread(back, disk_dir / "good1.bin") == 1
    assert torch.equal(back, good[1])


# --- tensors in flight --------------------------------------------------------------------------


def test_tensor_freed_while_reading_is_kept_alive(disk_dir):
    handle = AsyncIOHandle()
    data = random_bytes(64 * 2**20)
    handle.sync_pwrite(data, disk_dir / "keep.bin")
    target = torch.empty(64 * 2**20, dtype=torch.uint8)  # large: freeing it would unmap it
    handle.async_pread(target, disk_dir / "keep.bin")
    del target
    gc.collect()
    assert handle.wait() == 1  # freed memory would have made the kernel answer EFAULT


def test_tensor_freed_while_writing_is_kept_alive(disk_dir):
    handle = AsyncIOHandle()
    source = random_bytes(16 * 2**20 + 3)
    expected = source.numpy().tobytes()
    handle.async_pwrite(source, disk_dir / "keep_w.bin")
    del source
    gc.collect()
    noise = [torch.full((2**20,), 7, dtype=torch.uint8) for _ in range(16)]
    handle.wait()
    assert file_bytes(disk_dir / "keep_w.bin") == expected
    del noise


def test_tensor_cannot_be_resized_while_in_flight(disk_dir):
    handle = AsyncIOHandle()
    data = random_bytes(8 * 2**20)
    handle.sync_pwrite(data, disk_dir / "resize.bin")
    target = torch.empty_like(data)
    handle.async_pread(target, disk_dir / "resize.bin")
    # torch leaves a tensor whose resize_ failed with the new sizes: try it on an alias.
    with pytest.raises(RuntimeError, match="not resizable"):
        target.view(-1).resize_(2 * data.numel())
    with pytest.raises(RuntimeError, match="not resizable"):
        target.untyped_storage().resize_(0)
    handle.wait()
    assert torch.equal(target, data)
    target.resize_(2 * data.numel())  # resizable again once the request completed
    assert target.numel() == 2 * data.numel()


# --- locked tensors, API spellings, engines ---------------------------------------------------


def test_new_and_free_cpu_locked_tensor(disk_dir):
    handle = AsyncIOHandle()
    locked = handle.new_cpu_locked_tensor(1001, torch.empty(3, dtype=torch.bfloat16))
    assert locked.shape == (1001,) and locked.dtype == torch.bfloat16
    assert locked.data_ptr() % PAGE == 0
    locked.copy_(torch.randn(1001).to(torch.bfloat16))
    expected = locked.clone()
    handle.sync_pwrite(locked, disk_dir / "locked.bin")
    locked.zero_()
    handle.sync_pread(locked, disk_dir / "locked.bin")
    assert torch.equal(locked, expected)
    handle.async_pread(locked, disk_dir / "locked.bin")
    with pytest.raises(RuntimeError, match="request in flight; call wait"):
        handle.free_cpu_locked_tensor(locked)
    handle.wait()
    assert handle.free_cpu_locked_tensor(torch.empty(4)) is False
    assert handle.free_cpu_locked_tensor(locked) is True
    assert locked.numel() == 0
    assert handle.free_cpu_locked_tensor(locked) is False


def test_deepspeed_spelling_through_the_builder(disk_dir):
    module = AsyncIOBuilder().load()
    handle = module.aio_handle(1 << 20, 8, False, True, 2)
    assert isinstance(handle, AsyncIOHandle)
    assert (handle.get_block_size(), handle.get_queue_depth(), handle.get_thread_count()) == (
        1 << 20, 8, 2)  # fmt: skip
    data = torch.randn(70_001)
    path = str(disk_dir / "ds.bin")
    assert handle.write(data, path, True) == 1  # validate=True re-reads the file
    back = torch.empty_like(data)
    assert handle.read(back, path, True) == 1
    assert torch.equal(back, data)
    assert handle.pwrite(data, path, True, True) == 0  # asynchronous: wait() completes it
    assert handle.wait() == 1
    back.zero_()
    assert handle.pread(back, path, False, False) == 1
    assert torch.equal(back, data)


def test_validation_reports_where_file_and_tensor_differ(disk_dir):
    handle = AsyncIOHandle()
    data = random_bytes(10_000)
    handle.sync_pwrite(data, disk_dir / "v.bin")
    aio._validate(data, str(disk_dir / "v.bin"), 0)  # equal: no error
    with open(disk_dir / "v.bin", "r+b") as file:
        file.seek(1234)
        file.write(bytes([data[1234].item() ^ 0xFF]))
    with pytest.raises(RuntimeError, match=r"tensor \(10000 bytes\) first at byte 1234"):
        aio._validate(data, str(disk_dir / "v.bin"), 0)


def test_raw_custom_class_is_registered_with_defaults(disk_dir):
    raw = torch.classes.deepspeed_cpp.AsyncIOHandle()
    assert (raw.get_block_size(), raw.get_queue_depth(), raw.get_single_submit(),
            raw.get_overlap_events(), raw.get_intra_op_parallelism()) == (
        1 << 20, 32, False, True, 1)  # fmt: skip
    data = torch.arange(1000, dtype=torch.float64)
    assert raw.async_pwrite(data, filename=str(disk_dir / "raw.bin")) == 0
    assert raw.wait() == 1
    assert file_bytes(disk_dir / "raw.bin") == data.numpy().tobytes()


def test_engines_reported_match_the_build():
    built = aio.compiled_engines()
    assert built == AsyncIOBuilder().compiled_engines()
    assert built[-1] == "threads"
    for engine in built:
        reason = aio.engine_unavailable_reason(engine)
        assert (engine in ENGINES) == (reason == ""), reason
    assert aio.default_engine() == ENGINES[0]
    assert f"engines compiled in: {', '.join(built)}" in AsyncIOBuilder().is_compatible()[1]


_ENGINE_ENV_SCRIPT = """
import json, os, sys
from deepspeed_cpp.ops.aio import AsyncIOHandle, default_engine
seen = {}
for engine in sys.argv[1:]:
    os.environ["DS_AIO_ENGINE"] = engine  # read by the library at each resolution
    seen[engine] = [default_engine(), AsyncIOHandle().get_engine()]
print(json.dumps(seen))
"""


def test_ds_aio_engine_forces_the_default_engine():
    out = run_python_json(_ENGINE_ENV_SCRIPT, *ENGINES)
    assert out == {engine: [engine, engine] for engine in ENGINES}


def test_report_names_the_engine_in_use():
    from deepspeed_cpp.env_report import loaded_details

    compiled = ", ".join(aio.compiled_engines())
    assert loaded_details("aio") == f"engine in use: {ENGINES[0]} (compiled in: {compiled})"
    # The fallback engine, forced, as the report command prints it.
    report = subprocess.run(
        [sys.executable, "-m", "deepspeed_cpp.env_report"], capture_output=True, text=True,
        timeout=300, env=dict(os.environ, DS_AIO_ENGINE="threads"),
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    line = next(line for line in report.stdout.splitlines() if line.strip().startswith("aio"))
    assert f"loaded, engine in use: threads (compiled in: {compiled})" in line


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(block_size=1000), RuntimeError, "block_size must be a positive multiple of 4096"),
        (dict(block_size=0), RuntimeError, "block_size must be a positive multiple of 4096 "),
        (dict(queue_depth=0), RuntimeError, "queue_depth must be in [1, 4096], got 0"),
        (dict(intra_op_parallelism=0), RuntimeError, "intra_op_parallelism must be in [1, 256]"),
        (dict(engine="spdk"), ValueError, "engine='spdk' is not known; expected one of auto"),
        (dict(queue_depth=2.5), TypeError, "queue_depth must be an int, got 2.5"),
    ],
)
def test_bad_settings_are_named(kwargs, error, message):
    with pytest.raises(error) as raised:
        AsyncIOHandle(**kwargs)
    assert message in str(raised.value)


def test_bad_requests_are_named(disk_dir):
    handle = AsyncIOHandle()
    path = disk_dir / "bad.bin"
    with pytest.raises(RuntimeError, match=r"async_pwrite: buffer must be contiguous, got strides"):
        handle.async_pwrite(torch.zeros(4, 2)[:, 0], path)
    with pytest.raises(RuntimeError, match="async_pread: buffer must be a CPU tensor, got dev"):
        handle.async_pread(torch.zeros(4, device="meta"), path)
    with pytest.raises(RuntimeError, match="must be a dense .strided. tensor, got layout Sparse"):
        handle.async_pwrite(torch.eye(3).to_sparse(), path)
    with pytest.raises(RuntimeError, match="file_offset must be >= 0, got -1"):
        handle.async_pwrite(torch.zeros(4), path, -1)
    with pytest.raises(RuntimeError, match="filename is empty"):
        handle.async_pwrite(torch.zeros(4), "")
    with pytest.raises(TypeError, match="filename must be a str or os.PathLike, got int"):
        handle.async_pwrite(torch.zeros(4), 17)
    assert handle.pending_requests() == 0


def test_bad_ds_aio_engine_is_named():
    result = subprocess.run(
        [sys.executable, "-c", "from deepspeed_cpp.ops.aio import AsyncIOHandle; AsyncIOHandle()"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, DS_AIO_ENGINE="fast"),
    )  # fmt: skip
    assert result.returncode != 0
    assert "DS_AIO_ENGINE='fast' is not known; expected one of auto" in result.stderr
