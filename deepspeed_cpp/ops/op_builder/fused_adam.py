"""csrc/fused_adam: the multi-tensor CUDA Adam, built with nvcc; and its host-side test build.

Building needs a CUDA build of torch and the CUDA toolkit (nvcc), not a GPU. The architectures
come from ``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0+PTX``: SASS for sm_80 and sm_90, and PTX
for compute_90 so that newer GPUs can JIT it); ``NVCC_THREADS`` is passed to ``nvcc --threads``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from .builder import NVCC_HOST_FLAGS, OpBuilder

logger = logging.getLogger("deepspeed_cpp")

DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"
_ARCH_PATTERN = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")

_COMMON_SOURCES = [
    "fused_adam/fused_adam_checks.cpp",
    "fused_adam/fused_adam_launch.cpp",
    "fused_adam/multi_tensor_plan.cpp",
]


class CudaArchListError(ValueError):
    """TORCH_CUDA_ARCH_LIST holds something that is not an architecture."""


def parse_cuda_arch_list(text: str) -> list[tuple[str, bool]]:
    """``"8.0;9.0+PTX"`` -> ``[("80", False), ("90", True)]``: (arch number, also emit PTX).

    Entries are separated by ``;``, ``,`` or spaces and look like ``8.0``, ``9.0a`` or
    ``9.0+PTX``. Raises CudaArchListError naming the entry that is not of that form.
    """
    archs: list[tuple[str, bool]] = []
    for entry in re.split(r"[;,\s]+", text.strip()):
        if not entry:
            continue
        match = _ARCH_PATTERN.match(entry)
        if match is None:
            raise CudaArchListError(
                f"TORCH_CUDA_ARCH_LIST={text!r}: entry {entry!r} is not an architecture; expected "
                f"entries like '8.0', '9.0a' or '9.0+PTX' separated by ';'"
            )
        major, minor, suffix, ptx = match.groups()
        arch = f"{major}{minor}{suffix}"
        if arch not in [a for a, _ in archs]:
            archs.append((arch, ptx is not None))
    if not archs:
        raise CudaArchListError(f"TORCH_CUDA_ARCH_LIST={text!r} names no architecture")
    return archs


def requested_cuda_archs() -> list[tuple[str, bool]]:
    """The architectures to build for: TORCH_CUDA_ARCH_LIST, else DEFAULT_CUDA_ARCH_LIST."""
    return parse_cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_CUDA_ARCH_LIST)


def gencode_flags(archs: list[tuple[str, bool]]) -> list[str]:
    """nvcc flags for SASS of every arch, plus PTX where asked (``+PTX``)."""
    flags = []
    for arch, ptx in archs:
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{arch},code=compute_{arch}")
    return flags


def _is_toolkit(path: Path) -> bool:
    return (path / "bin" / "nvcc").is_file() and (path / "include" / "cuda_runtime.h").is_file()


def find_cuda_home() -> tuple[Path | None, str]:
    """The CUDA toolkit to build with, or None and why none was found.

    CUDA_HOME (or CUDA_PATH) when set; else /usr/local/cuda; else the toolkit around the nvcc on
    PATH. A toolkit needs bin/nvcc and include/cuda_runtime.h (torch's own guess can land on a
    folder holding only an nvcc wrapper script, e.g. /usr/local).
    """
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(variable)
        if value:
            if _is_toolkit(Path(value)):
                return Path(value), ""
            return None, (
                f"{variable}={value} is not a CUDA toolkit (expected bin/nvcc and "
                f"include/cuda_runtime.h in it)"
            )
    candidates = [Path("/usr/local/cuda")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    for candidate in candidates:
        if _is_toolkit(candidate):
            return candidate, ""
    return None, "the CUDA toolkit was not found: nvcc is not on PATH and CUDA_HOME is not set"


@functools.cache
def _nvcc_facts(nvcc: str) -> tuple[str, frozenset[str]]:
    """(release like '13.0', the compute_XX architectures it knows) of one nvcc."""
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    match = re.search(r"release (\d+\.\d+)", version.stdout)
    archs = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, timeout=60)
    return (match.group(1) if match else "unknown"), frozenset(archs.stdout.split())


class FusedAdamBuilder(OpBuilder):
    """csrc/fused_adam: Adam/AdamW over lists of CUDA tensors in a few multi-tensor launches."""

    NAME = "fused_adam"

    def sources(self) -> list[str]:
        return ["fused_adam/fused_adam_op.cpp", *_COMMON_SOURCES, "fused_adam/fused_adam_kernel.cu"]

    def extra_cuda_cflags(self) -> list[str]:
        # --fmad=false: nvcc must not contract a*b+c where the CPU kernels do not, so that the
        # device gives the bits the CPU tests check (see common/adam_math.h).
        flags = ["-O3", "--fmad=false", "-Xcompiler", "-ffp-contract=off", *NVCC_HOST_FLAGS]
        if os.environ.get("NVCC_THREADS"):
            flags.append(f"--threads={int(os.environ['NVCC_THREADS'])}")
        try:
            return flags + gencode_flags(requested_cuda_archs())
        except CudaArchListError:
            return flags  # is_compatible() reports the bad list before anything is built

    def is_compatible(self) -> tuple[bool, str]:
        import torch

        if torch.version.cuda is None:
            return False, (
                f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None); "
                f"the fused GPU Adam needs a CUDA build of torch"
            )
        try:
            archs = requested_cuda_archs()
        except CudaArchListError as error:
            return False, str(error)
        if self.prebuilt_library() is not None:
            return True, ""  # running a pre-built library needs no toolkit
        cuda_home, why = find_cuda_home()
        if cuda_home is None:
            return False, why
        release, known_archs = _nvcc_facts(str(cuda_home / "bin" / "nvcc"))
        if release.split(".")[0] != torch.version.cuda.split(".")[0]:
            return False, (
                f"nvcc in {cuda_home} is CUDA {release} but torch was built with CUDA "
                f"{torch.version.cuda}; their major versions must match (set CUDA_HOME)"
            )
        unknown = [a for a, _ in archs if f"compute_{a.rstrip('af')}" not in known_archs]
        if unknown:
            return False, (
                f"nvcc {release} in {cuda_home} cannot build for architecture(s) "
                f"{', '.join(unknown)} asked by TORCH_CUDA_ARCH_LIST; it knows "
                f"{' '.join(sorted(known_archs))}"
            )
        return True, ""

    def prepare_build(self) -> None:
        """Points torch's extension builder at the toolkit find_cuda_home() chose.

        torch guesses CUDA_HOME once, at import, from the nvcc on PATH, which can be a wrapper
        script whose folder (e.g. /usr/local) holds no CUDA headers or libraries.
        """
        import torch.utils.cpp_extension as cpp_extension

        cuda_home, why = find_cuda_home()
        if cuda_home is None:
            raise RuntimeError(f"cannot build op '{self.NAME}': {why}")
        if cpp_extension.CUDA_HOME is None or Path(cpp_extension.CUDA_HOME) != cuda_home:
            logger.info("deepspeed_cpp: torch will build with the CUDA toolkit in %s", cuda_home)
            cpp_extension.CUDA_HOME = str(cuda_home)


class FusedAdamHostBuilder(OpBuilder):
    """The fused Adam kernel's body, planner and checks compiled for the CPU by the C++ compiler.

    Loading it registers a CPU kernel for ``deepspeed_cpp::fused_adam`` that runs the CUDA
    kernel's code (csrc/fused_adam/fused_adam_chunk.h) block by block, thread by thread, over the
    same argument blocks, plus test ops in the ``deepspeed_cpp_fused_adam_test`` namespace. For
    tests and debugging: not in ALL_OPS, never pre-built.
    """

    NAME = "fused_adam_host"

    def sources(self) -> list[str]:
        return ["fused_adam/tests/fused_adam_host_op.cpp", *_COMMON_SOURCES]
