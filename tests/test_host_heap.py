"""NVMe offload hands freed host memory back to the kernel (runtime/zero/offload/host_heap.py).

Each case runs in a fresh process (the setting is process-wide): it first frees a 16 MiB block,
which raises glibc's dynamic mmap threshold to 16 MiB as any training step does, then measures
how much of a freed 4 MiB tensor leaves the process's resident set. With glibc's defaults the
tensor now comes from the heap and stays resident after the free; with the threshold fixed by an
engine that swaps to NVMe, it leaves at once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO_ROOT

SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile
    import torch

    def resident():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def resident_share(ranges):
        # mincore(2): which pages of these (freed) address ranges are still in memory.
        import ctypes
        libc, page = ctypes.CDLL("libc.so.6", use_errno=True), os.sysconf("SC_PAGE_SIZE")
        resident = total = 0
        for start, length in ranges:
            first = start // page * page
            count = (start + length - first) // page
            vector = (ctypes.c_ubyte * count)()
            if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(count * page), vector):
                raise OSError(ctypes.get_errno(), f"mincore {start:#x} + {length}")
            resident += sum(v & 1 for v in vector)
            total += count
        return resident / total

    def mib_left_after_free(mib):
        block = torch.ones(mib << 18)  # float32: mib MiB, every page touched
        above = torch.ones(16)  # something allocated after it, so the heap cannot shrink
        before = resident()
        del block
        return (before - resident()) / 2**20

    mib_left_after_free(16)  # glibc now serves anything up to 16 MiB from its heap
    how = sys.argv[1]
    if how == "function":
        from deepspeed_cpp.runtime.zero.offload.host_heap import return_large_frees_to_the_kernel
        print("THRESHOLD", return_large_frees_to_the_kernel())
    elif how == "engine":
        import deepspeed_cpp
        from deepspeed_cpp.runtime.zero.offload import host_heap
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        # Set-up garbage: 128 MiB freed in the heap's middle before the engine exists, in
        # 2 MiB pieces kept apart (so that the 4 MiB tensor measured below cannot reuse them).
        hole, kept = [], []
        for _ in range(64):
            hole.append(torch.ones(1 << 19))
            kept.append(torch.ones(1 << 16))  # from the heap's top: the heap cannot shrink
        pages = [(t.data_ptr(), t.numel() * 4) for t in hole]
        del hole
        print("HOLE_BEFORE", resident_share(pages))
        config = {
            "train_batch_size": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {
                "device": "nvme", "nvme_path": tempfile.mkdtemp()}},
        }
        engine, *_ = deepspeed_cpp.initialize(model=model, config=config)
        print("HOLE_AFTER", resident_share(pages))
        engine.backward(engine(torch.randn(2, 8)).square().mean())
        engine.step()
        print("THRESHOLD", host_heap._applied)
    print("FREED", mib_left_after_free(4))
    """
)


def _run(how: str, **env) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if k != "DS_CPP_MMAP_THRESHOLD"}
    environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29731", RANK="0", WORLD_SIZE="1",
                       LOCAL_RANK="0", **env)  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", SCRIPT, how], cwd=REPO_ROOT, env=environment,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    return dict(line.split(" ", 1) for line in ran.stdout.splitlines() if " " in line)


def test_without_the_fixed_threshold_a_freed_tensor_stays_resident():
    # The control: the measurement can tell the two behaviours apart.
    assert float(_run("nothing")["FREED"]) < 1.0


def test_an_engine_swapping_to_nvme_returns_freed_tensors_at_once():
    result = _run("engine")
    assert result["THRESHOLD"] == str(1 << 20)
    assert float(result["FREED"]) > 3.5
    # What was freed before the engine was ready (still resident then) went back once it was
    # (the engine's own allocations below the threshold reuse some of the 128 MiB: ~20%).
    assert float(result["HOLE_BEFORE"]) > 0.99 and float(result["HOLE_AFTER"]) < 0.5, result


def test_the_threshold_follows_the_environment():
    switched_off = _run("function", DS_CPP_MMAP_THRESHOLD="off")
    assert switched_off["THRESHOLD"] == "None" and float(switched_off["FREED"]) < 1.0
    result = _run("function", DS_CPP_MMAP_THRESHOLD=str(2 << 20))
    assert result["THRESHOLD"] == str(2 << 20) and float(result["FREED"]) > 3.5


@pytest.mark.parametrize("value, expected", [
    ("lots", "DS_CPP_MMAP_THRESHOLD='lots': expected a byte count (e.g. 1048576) or 'off'"),
    ("-5", "DS_CPP_MMAP_THRESHOLD=-5: expected 1 to 33554432 bytes (glibc's limit) or 'off'"),
])  # fmt: skip
def test_a_bad_threshold_is_named(monkeypatch, value, expected):
    from deepspeed_cpp.runtime.zero.offload import host_heap

    monkeypatch.setenv("DS_CPP_MMAP_THRESHOLD", value)
    with pytest.raises(ValueError) as raised:
        host_heap.return_large_frees_to_the_kernel()
    assert str(raised.value) == expected
