"""Compiles the CPU op libraries into the default JIT cache, in the order the suite first uses them.

conftest.py starts this script as a low-priority background process when a test session starts
(DS_TEST_PREBUILD=0 turns it off). A machine whose cache does not hold these sources' builds
compiles every op, and each first use used to compile in the foreground, one op after another,
while most of the suite runs in one process on one core: here the builds run on the core the
tests leave idle. Nothing changes for the tests: a build holds the op's lock in the cache, so a
test that needs an op under construction waits for it (as a second process always did), and one
that needs an op not reached yet compiles it itself, this script then finding it built. A build
that fails here is left to the test that needs the op, which compiles it again and reports the
compiler's error where it belongs.
"""

import os
import sys
import time
from pathlib import Path

from fused_adam_wheel_build import built_wheel
from session_builds import SESSION_DIR, other_torch_venv, stable_abi_wheel

from deepspeed_cpp.ops.op_builder import (
    AsyncIOBuilder,
    CPUAdagradBuilder,
    CPUAdamBuilder,
    CPULionBuilder,
    FusedAdamHostBuilder,
    MoEBuilder,
    MoECudaBuilder,
    PinMemoryBuilder,
    RegistryBuilder,
    ZeroBuilder,
)

# test_aio.py and test_aio_file_systems.py ask for aio while collected; engine tests (zero,
# cpu_adam) start early; the CIFAR-10 example needs moe; the cpu_* optimizer tests, pinned memory
# and fused Adam come later.
IN_ORDER_OF_FIRST_USE = (
    RegistryBuilder,
    AsyncIOBuilder,
    ZeroBuilder,
    CPUAdamBuilder,
    MoEBuilder,
    CPUAdagradBuilder,
    CPULionBuilder,
    PinMemoryBuilder,
    FusedAdamHostBuilder,
)


# After the CPU ops, the two nvcc builds of the suite, each of which its test then finds done,
# when the session runs that test (conftest.py's session folder lists them): the fused Adam
# wheel (~35 s, test_fused_adam_build.py) and the MoE gating kernel (~20 s) for the one
# architecture test_moe_gating_cuda.py builds it for (the architectures are part of the cache
# key). A failed build is the test's to report.
MOE_CUDA_ARCH_LIST = "8.0"


def _load(op, failed: list[str]) -> None:
    try:
        if op.is_compatible()[0]:
            op.load()
    except Exception as error:  # noqa: BLE001 - the test that needs the op reports it
        failed.append(f"{op.NAME}: {error}")


def _wanted(session: Path) -> list[str]:
    """The builds of the session's tests (conftest.py lists them once collection finished)."""
    wanted = session / "wanted"
    for _ in range(600):
        if wanted.is_file():
            return wanted.read_text().split()
        time.sleep(0.5)
    return []


def main() -> int:
    failed = []
    for family in IN_ORDER_OF_FIRST_USE:
        _load(family(), failed)
    session = os.environ.get(SESSION_DIR)
    wanted = _wanted(Path(session)) if session else []
    if "fused_adam_wheel" in wanted:
        built_wheel(Path(session))
    if "moe_cuda" in wanted:
        before = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = MOE_CUDA_ARCH_LIST
        _load(MoECudaBuilder(), failed)
        # The wheels below are built with the session's own environment, as their tests would.
        if before is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = before
    # The stable-ABI wheel (test_op_loading.py) and, with it installed, the venv with torch 2.13.0
    # and the zero op compiled for it (test_stable_abi_wheel.py): tests/session_builds.py.
    if "stable_abi_wheel" in wanted:
        stable_abi_wheel(Path(session) / "stable_abi_wheel")
    if "other_torch_venv" in wanted:
        other_torch_venv(Path(session) / "other_torch_venv")
    for line in failed:
        print(f"prebuild_ops: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
