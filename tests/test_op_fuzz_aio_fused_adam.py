"""Property-based fuzzing (hypothesis) of the aio handle and of fused Adam's host logic: each
example matches an independent reference, or raises an error naming the offending argument;
never a crash, a hang or silent garbage.

- ``AsyncIOHandle``: random settings (block size, queue depth, workers, submit modes, engines,
  out-of-range values among them), tensor sizes from 0 bytes up with odd byte counts, every
  dtype, offset and non-contiguous views, aligned and unaligned file offsets, sync and async
  calls, several requests in flight from overlapping views of one buffer. Written files are
  compared with plain Python reads of the same file; reads with bytes Python wrote.
- ``plan`` (csrc/fused_adam/multi_tensor_plan.cpp): random element counts and capacities, out of
  range ones among them; every element of every tensor is covered exactly once (checked by
  tests/fused_adam_plan_check.py's reading of the table) or the named error comes back.
- ``fused_adam``'s argument checks (csrc/fused_adam/fused_adam_checks.cpp) through the host
  library: lists of mismatched lengths, dtypes, shapes, zero-size and aliased tensors, and
  hyper-parameters that are NaN, infinite or negative; a valid call matches torch's Adam step,
  an invalid one is refused naming the argument.

Settings (examples per property, the "thorough" profile): tests/fuzz_settings.py.
"""

from __future__ import annotations

import gc
import math
import os
import re
import shutil

import pytest
import torch
from conftest import REPO_ROOT
from disk_folders import on_a_real_disk
from fused_adam_plan_check import check_plan
from fuzz_settings import FUZZ  # skips the module without hypothesis
from hypothesis import given
from hypothesis import strategies as st

from deepspeed_cpp.ops import aio
from deepspeed_cpp.ops.aio import AsyncIOHandle
from deepspeed_cpp.ops.fused_adam import load_fused_adam_host_emulation

PAGE = 4096


# --- aio ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    """A folder on a real disk file system (tmpfs only emulates O_DIRECT)."""
    folder = tmp_path_factory.mktemp("aio_fuzz")
    if not on_a_real_disk(folder):
        folder = REPO_ROOT / "build" / f"aio_fuzz_{os.getpid()}"
        folder.mkdir(parents=True, exist_ok=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def engines():
    aio.load_aio()
    return aio.usable_engines()


_handles: dict[tuple, AsyncIOHandle] = {}


@pytest.fixture(scope="module", autouse=True)
def _release_handles():
    """Ends the module's handles (their worker threads) before the rest of the suite runs."""
    yield
    _handles.clear()
    gc.collect()


def _handle(settings) -> AsyncIOHandle:
    """One handle per setting, kept for the module: workers are threads, not worth restarting."""
    if settings not in _handles:
        block_size, queue_depth, single_submit, overlap_events, workers, engine = settings
        _handles[settings] = AsyncIOHandle(block_size, queue_depth, single_submit,
                                           overlap_events, workers, engine)  # fmt: skip
    return _handles[settings]


SETTINGS = st.tuples(
    st.sampled_from([PAGE, 2 * PAGE, 3 * PAGE, 1 << 20]),
    st.sampled_from([1, 2, 7, 32]),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1, 2, 3]),
    st.sampled_from(["auto", "io_uring", "libaio", "threads"]),
)
DTYPES = [torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float32, torch.int32,
          torch.float64, torch.int64, torch.complex64, torch.bool]  # fmt: skip
NBYTES = st.one_of(st.integers(0, 9), st.integers(PAGE - 3, PAGE + 3),
                   st.integers(10, 3 * PAGE + 17), st.integers(2**20 - 5, 2**20 + 5))  # fmt: skip
FILE_OFFSETS = st.one_of(st.sampled_from([0, PAGE, 3 * PAGE]), st.integers(1, 3 * PAGE + 1))
# How the buffer is laid out in its storage: its own storage, one element into a larger one (not
# page-aligned), a page-aligned locked tensor, a strided view or an overlapping (expanded) one;
# the last two are refused as not contiguous unless they hold one element or none.
LAYOUTS = st.sampled_from(["own", "shifted", "locked", "strided", "expanded"])


def _buffer(handle, layout, dtype, numel):
    """A tensor of `numel` elements of `dtype` laid out as `layout` (random contents)."""
    if layout == "locked":
        base = handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=dtype))
    elif layout == "shifted":
        base = torch.empty(numel + 1, dtype=dtype)[1:]
    elif layout == "strided":
        base = torch.empty(max(2 * numel, 1), dtype=dtype)[::2][:numel]
    elif layout == "expanded":
        return _buffer(handle, "own", dtype, min(numel, 1)).expand(numel)
    else:
        base = torch.empty(numel, dtype=dtype)
    raw = torch.randint(0, 256, (base.numel() * base.element_size(),), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2  # a bool holding another byte than 0 or 1 is not a valid tensor
    base.copy_(raw.view(dtype).view(base.shape))
    return base


def _bytes(tensor) -> bytes:
    # A fresh tensor with default strides: a one-element view may keep a stride of 2, which
    # view(torch.uint8) refuses.
    dense = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    return dense.view(-1).view(torch.uint8).numpy().tobytes()


def _file_bytes(path, offset=0, n=None):
    with open(path, "rb") as file:  # buffered Python I/O: an independent path to the bytes
        file.seek(offset)
        return file.read() if n is None else file.read(n)


def _is_contiguous_layout(layout, numel):
    return layout not in ("strided", "expanded") or numel <= 1


@FUZZ
@given(settings=SETTINGS, dtype=st.sampled_from(DTYPES), nbytes=NBYTES, layout=LAYOUTS,
       file_offset=FILE_OFFSETS, sync=st.booleans(), prefix=st.booleans())  # fmt: skip
def test_aio_write_then_read_round_trips_bytes(
    disk_dir, engines, settings, dtype, nbytes, layout, file_offset, sync, prefix
):
    if settings[-1] != "auto" and settings[-1] not in engines:
        with pytest.raises(RuntimeError, match=settings[-1]):
            _handle(settings)
        return
    handle = _handle(settings)
    size = torch.empty(0, dtype=dtype).element_size()
    numel = nbytes // size
    buffer = _buffer(handle, layout, dtype, numel)
    path = disk_dir / "round_trip.bin"
    # What the file holds before: bytes Python wrote (longer or shorter than the request).
    before = os.urandom(file_offset + nbytes // 2) if prefix else b""
    path.write_bytes(before)
    write = handle.sync_pwrite if sync else handle.async_pwrite
    if not _is_contiguous_layout(layout, numel):
        with pytest.raises(RuntimeError, match=r"async_pwrite: buffer must be contiguous"):
            write(buffer, path, file_offset)
        assert handle.pending_requests() == 0
        return
    write(buffer, path, file_offset)
    if not sync:
        assert handle.wait() == 1
    data = _bytes(buffer)
    if file_offset == 0:
        expected = data  # a write at offset 0 replaces the file
    elif not data:
        expected = before  # like pwrite, writing no bytes changes nothing, the length included
    else:
        # Other offsets change only those bytes; a gap before them reads as zeros.
        head = before[:file_offset].ljust(file_offset, b"\0")
        expected = head + data + before[file_offset + len(data) :]
    assert _file_bytes(path) == expected

    # Read the same range back into a fresh buffer of another layout; then past the end.
    target = _buffer(handle, "shifted" if layout == "locked" else "locked", dtype, numel)
    if file_offset + len(data) > len(expected):  # an empty write did not reach file_offset
        handle.async_pread(target, path, file_offset)
        with pytest.raises(RuntimeError, match="reading past the end of the file"):
            handle.wait()
        return
    read = handle.sync_pread if sync else handle.async_pread
    read(target, path, file_offset)
    if not sync:
        handle.wait()
    assert _bytes(target) == data
    if numel:
        handle.async_pread(target, path, len(expected) - len(data) + size)  # past the end
        with pytest.raises(RuntimeError, match=re.escape(str(path))):
            handle.wait()
    assert handle.pending_requests() == 0


@FUZZ
@given(settings=SETTINGS, nbytes=st.integers(1, 3 * PAGE + 5), cuts=st.lists(
    st.tuples(st.integers(0, 3 * PAGE), st.integers(0, 2 * PAGE), FILE_OFFSETS),
    min_size=1, max_size=5))  # fmt: skip
def test_aio_requests_in_flight_from_overlapping_views(disk_dir, engines, settings, nbytes, cuts):
    """Several async writes from overlapping slices of one buffer (to files of their own), then
    async reads of each file into overlapping slices of another buffer, one per wait()."""
    if settings[-1] != "auto" and settings[-1] not in engines:
        return
    handle = _handle(settings)
    source = _buffer(handle, "shifted", torch.uint8, nbytes)
    views = []
    for index, (start, length, file_offset) in enumerate(cuts):
        start = min(start, nbytes)
        view = source[start : start + length]
        path = disk_dir / f"overlap_{index}.bin"
        path.write_bytes(b"")
        handle.async_pwrite(view, path, file_offset)
        views.append((view, path, file_offset))
    assert handle.wait() == len(cuts)
    for view, path, file_offset in views:
        assert _file_bytes(path, file_offset) == _bytes(view)
        if view.numel():  # an empty write leaves the empty file as it is
            assert _file_bytes(path, 0, file_offset) == b"\0" * file_offset
    target = torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]
    for (start, length, _), (view, path, file_offset) in zip(cuts, views):
        start = min(start, nbytes)
        handle.async_pread(target[start : start + length], path, file_offset)
        if view.numel() == 0 and file_offset > 0:  # the file is empty: offset is past its end
            with pytest.raises(RuntimeError, match="reading past the end of the file"):
                handle.wait()
            continue
        handle.wait()
        assert _bytes(target[start : start + length]) == _bytes(view)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_aio_validate_of_a_one_element_strided_view(disk_dir, engines, dtype):
    """A one-element view with stride 2 is contiguous, so the handle takes it; validate=True
    once failed on it in view(torch.uint8) instead of comparing the bytes."""
    handle = _handle((PAGE, 2, False, True, 1, "auto"))
    view = torch.randn(2).to(dtype)[::2]
    path = disk_dir / "validate.bin"
    assert handle.write(view, path, True) == 1
    assert _file_bytes(path) == _bytes(view)
    target = torch.zeros(2, dtype=dtype)[::2]
    assert handle.read(target, path, True) == 1
    assert torch.equal(target, view)


# Out-of-range settings among valid ones: each is accepted or refused naming itself.
@FUZZ
@given(
    block_size=st.one_of(
        st.integers(-PAGE, 3 * PAGE),
        st.sampled_from([2**30, 2**30 + PAGE, 2**31, 2**63 - 1, -(2**63)]),
    ),  # fmt: skip
    queue_depth=st.one_of(st.integers(-2, 3), st.sampled_from([4096, 4097, 2**31, 2**63 - 1])),
    workers=st.one_of(st.integers(-2, 3), st.sampled_from([256, 257, 2**32 + 1])),
    engine=st.sampled_from(["auto", "io_uring", "libaio", "threads", "", "posix", "THREADS"]),
)
def test_aio_settings_are_accepted_or_named(engines, block_size, queue_depth, workers, engine):
    valid = {
        "block_size": block_size > 0 and block_size % PAGE == 0 and block_size <= 2**30,
        "queue_depth": 1 <= queue_depth <= 4096,
        "intra_op_parallelism": 1 <= workers <= 256,
        "engine": engine == "auto" or engine in engines,
    }
    if all(valid.values()):
        if block_size * queue_depth * workers > 2**28:
            return  # valid but would lock a lot of memory in bounce buffers for nothing
        handle = AsyncIOHandle(block_size, queue_depth, False, True, workers, engine)
        assert (handle.get_block_size(), handle.get_queue_depth()) == (block_size, queue_depth)
        assert handle.get_intra_op_parallelism() == workers
        return
    with pytest.raises((RuntimeError, ValueError)) as error:
        AsyncIOHandle(block_size, queue_depth, False, True, workers, engine)
    message = str(error.value)
    assert any(f"{name}" in message for name, ok in valid.items() if not ok), message


# --- fused Adam: the launch planner ---------------------------------------------------------------
@pytest.fixture(scope="module")
def host_ops():
    load_fused_adam_host_emulation()
    return torch.ops.deepspeed_cpp_fused_adam_test


NUMELS = st.one_of(st.integers(0, 40), st.integers(-3, -1), st.sampled_from([2**31 - 1, 2**31]))
CAPACITY = st.integers(-2, 12) | st.sampled_from([2**31 - 1, 2**31, 2**32 + 3, 2**63 - 1])


@FUZZ
@given(numels=st.lists(NUMELS, max_size=30), chunk=st.integers(-1, 9) | st.just(2**40),
       max_tensors=CAPACITY, max_blocks=CAPACITY)  # fmt: skip
def test_plan_covers_every_element_once_or_names_the_error(
    host_ops, numels, chunk, max_tensors, max_blocks
):
    errors = []
    if max(max_tensors, max_blocks) > 2**31 - 1:  # would wrap round as an int
        errors.append("max_tensors and max_blocks must be at most 2147483647")
    elif chunk < 1:
        errors.append(f"chunk_elements must be >= 1, got {chunk}")
    elif min(max_tensors, max_blocks) < 1:
        errors.append(
            f"max_tensors and max_blocks must be >= 1, got {max_tensors} and {max_blocks}"
        )
    else:
        for index, numel in enumerate(numels):
            if numel < 0:
                errors.append(f"tensor {index} has {numel} elements")
                break
            if numel and math.ceil(numel / chunk) > 2**31 - 1:
                errors.append(f"tensor {index} has {numel} elements, ")
                break
    if errors:
        with pytest.raises(RuntimeError) as error:
            host_ops.plan(numels, chunk, max_tensors, max_blocks)
        assert errors[0] in str(error.value)
        return
    if sum(math.ceil(n / chunk) for n in numels) > 5000:
        return  # too many blocks to read back in a few milliseconds; test_fused_adam_plan has it
    check_plan(host_ops, numels, chunk, max_tensors, max_blocks)


# --- fused Adam: the argument checks -------------------------------------------------------------
ADAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HYPER = st.one_of(st.floats(0, 0.5), st.sampled_from([0.0, -0.1, math.nan, math.inf, -math.inf]))
BETA = st.one_of(st.floats(0, 0.999), st.sampled_from([1.0, -0.1, math.nan, math.inf]))


def _adam_reference(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd):
    """One AdamW step in float64, bias-corrected (as the op is called below)."""
    p, g = param.double(), grad.double()
    m = exp_avg.double() * beta1 + (1 - beta1) * g
    v = exp_avg_sq.double() * beta2 + (1 - beta2) * g * g
    m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
    p = p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    return p, m, v


@FUZZ
@given(
    data=st.data(),
    count=st.integers(0, 4),
    step=st.integers(-1, 3),
    lr=HYPER, eps=HYPER, weight_decay=HYPER, beta1=BETA, beta2=BETA,
)  # fmt: skip
def test_fused_adam_arguments_checked_or_step_matches(
    host_ops, data, count, step, lr, eps, weight_decay, beta1, beta2
):
    shapes = [
        data.draw(st.lists(st.integers(0, 5), max_size=3), label="shape") for _ in range(count)
    ]
    param_dtype = data.draw(st.sampled_from(ADAM_DTYPES), label="param_dtype")
    state_dtype = data.draw(st.sampled_from([torch.float32, param_dtype]), label="state_dtype")
    lists = {
        "params": [torch.randn(s).to(param_dtype) for s in shapes],
        "grads": [torch.randn(s).to(param_dtype) for s in shapes],
        "exp_avgs": [torch.rand(s).to(state_dtype) for s in shapes],
        "exp_avg_sqs": [torch.rand(s).to(state_dtype) for s in shapes],
    }
    expected = None  # the first error a correct check reports, as a regular expression
    # Disturb one thing at random: a list's length, one tensor's dtype, shape or memory.
    disturbance = data.draw(st.sampled_from(["none", "length", "dtype", "shape", "alias"]))
    names = list(lists)
    if disturbance == "length":
        name = data.draw(st.sampled_from(names[1:]), label="list")
        shorter = count > 0 and data.draw(st.booleans(), label="shorter")
        lists[name] = lists[name][:-1] if shorter else [*lists[name], torch.zeros(1)]
        expected = "the four lists must have equal lengths"
    elif disturbance == "dtype" and count:
        name = data.draw(st.sampled_from(names), label="list")
        index = data.draw(st.integers(0, count - 1), label="index")
        # At index 0 another Adam dtype can be a valid call; other dtypes never are.
        others = [torch.float64, torch.int32] + (ADAM_DTYPES if index else [])
        dtype = data.draw(st.sampled_from(others), label="dtype")
        tensor = lists[name][index]
        lists[name][index] = tensor.to(dtype)
        if dtype != tensor.dtype:
            expected = rf"{name}\[{index}\]"
    elif disturbance == "shape" and count:
        name = data.draw(st.sampled_from(names[1:]), label="list")
        index = data.draw(st.integers(0, count - 1), label="index")
        tensor = lists[name][index]
        lists[name][index] = torch.zeros(tensor.numel() + 1, dtype=tensor.dtype)
        expected = rf"{name}\[{index}\] has {tensor.numel() + 1} elements"
    elif disturbance == "alias" and count:
        # A tensor the op writes sharing memory with another argument: refused, or the update
        # would depend on the order the kernel's blocks run in.
        a, b = data.draw(st.lists(st.sampled_from(names), min_size=2, max_size=2), label="pair")
        i, j = data.draw(st.integers(0, count - 1)), data.draw(st.integers(0, count - 1))
        source = lists[a][i]
        if (a, i) != (b, j) and source.numel() and lists[b][j].numel() == source.numel():
            if lists[b][j].dtype == source.dtype and not (a == b == "grads"):
                lists[b][j] = source.view(lists[b][j].shape)
                expected = "share memory|overlap"
    # The checks run in this order: lengths, step, hyper-parameters, then tensor by tensor.
    hyper_error = None
    if step < 1:
        hyper_error = "step must be >= 1"
    for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                        ("weight_decay", weight_decay)):  # fmt: skip
        in_range = 0 <= value < 1 if name.startswith("beta") else 0 <= value < math.inf
        if hyper_error is None and not in_range:
            hyper_error = f"{name} must be"
    if disturbance != "length" or expected is None:
        expected = hyper_error or expected
    args = [lists[n] for n in names]
    before = [[t.clone() for t in tensors] for tensors in args]
    hyper = (step, lr, beta1, beta2, eps, weight_decay, True, True)
    if expected is not None:
        with pytest.raises(RuntimeError, match=expected):
            host_ops.fused_adam_with_capacity(5, 2, 3, 32, *args, *hyper)
        for tensors, saved in zip(args, before):  # refused before touching anything
            assert all(torch.equal(t, s) for t, s in zip(tensors, saved))
        return
    host_ops.fused_adam_with_capacity(5, 2, 3, 32, *args, *hyper)
    for i in range(count):
        reference = _adam_reference(*(saved[i] for saved in before), step, lr, beta1, beta2, eps,
                                    weight_decay)  # fmt: skip
        for ours, ref in zip((args[0][i], args[2][i], args[3][i]), reference):
            tolerance = 1e-5 if ours.dtype == torch.float32 else 1e-2
            torch.testing.assert_close(ours.double(), ref.to(ours.dtype).double(),
                                       rtol=tolerance, atol=tolerance, equal_nan=True)  # fmt: skip


def test_fused_adam_aliasing_named_and_shared_grads_allowed(host_ops):
    """The cases the property may draw rarely: one parameter passed twice, a state tensor
    overlapping part of a parameter, and one gradient shared by two parameters (allowed)."""
    hyper = (1, 0.1, 0.9, 0.999, 1e-8, 0.0, True, True)
    flat = torch.randn(11)
    params = [flat[:6], flat[5:]]  # one element shared
    states = [[torch.zeros(6), torch.zeros(6)] for _ in range(2)]
    grads = [torch.randn(6), torch.randn(6)]
    with pytest.raises(RuntimeError, match=r"params\[0\] and params\[1\] share memory"):
        host_ops.fused_adam_with_capacity(5, 2, 3, 32, params, grads, *states, *hyper)
    params = [torch.randn(6), torch.randn(6)]
    with pytest.raises(RuntimeError, match=r"exp_avgs\[1\] and exp_avg_sqs\[1\] share memory"):
        host_ops.fused_adam_with_capacity(5, 2, 3, 32, params, grads, states[0],
                                          [states[1][0], states[0][1]], *hyper)  # fmt: skip
    with pytest.raises(
        RuntimeError, match=r"params\[1\] and grads\[1\]|grads\[1\] and params\[1\]"
    ):
        host_ops.fused_adam_with_capacity(5, 2, 3, 32, params, [grads[0], params[1]], *states,
                                          *hyper)  # fmt: skip
    shared = [grads[0], grads[0]]
    before = [p.clone() for p in params]
    host_ops.fused_adam_with_capacity(5, 2, 3, 32, params, shared, *states, *hyper)
    for param, start in zip(params, before):
        reference = _adam_reference(start, grads[0], torch.zeros(6), torch.zeros(6), *hyper[:5],
                                    0.0)[0]  # fmt: skip
        torch.testing.assert_close(param.double(), reference, rtol=1e-6, atol=1e-6)
