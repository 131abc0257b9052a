"""Compiles the CPU op libraries into the default JIT cache, in the order the suite first uses them.

conftest.py starts this script as a low-priority background process when a test session starts
(DS_TEST_PREBUILD=0 turns it off). A fresh checkout compiles every op (the cache key names the
checkout's folder), and each first use used to compile in the foreground, one op after another,
while most of the suite runs in one process on one core: here the builds run on the core the
tests leave idle. Nothing changes for the tests: a build holds the op's lock in the cache, so a
test that needs an op under construction waits for it (as a second process always did), and one
that needs an op not reached yet compiles it itself, this script then finding it built. A build
that fails here is left to the test that needs the op, which compiles it again and reports the
compiler's error where it belongs.
"""

import os
import sys

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

# test_aio.py asks for aio while it is collected; engine tests (zero, cpu_adam) start early; the
# CIFAR-10 example needs moe; the cpu_* optimizer tests, pinned memory and fused Adam come later.
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


# Last, once the CPU ops are done: the MoE gating kernel's nvcc build (~20 s), for the one
# architecture test_moe_gating_cuda.py builds it for (the architectures are part of the cache
# key), which that test then finds built instead of compiling in the foreground.
MOE_CUDA_ARCH_LIST = "8.0"


def main() -> int:
    failed = []
    for family in (*IN_ORDER_OF_FIRST_USE, MoECudaBuilder):
        if family is MoECudaBuilder:
            os.environ["TORCH_CUDA_ARCH_LIST"] = MOE_CUDA_ARCH_LIST
        op = family()
        try:
            if not op.is_compatible()[0]:
                continue
            op.load()
        except Exception as error:  # noqa: BLE001 - the test that needs the op reports it
            failed.append(f"{op.NAME}: {error}")
    for line in failed:
        print(f"prebuild_ops: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
