"""What pre-built libraries were built against, recorded at build time and compared at load time.

``setup.py`` writes ``deepspeed_cpp/_ops/build_info.json`` next to the libraries it pre-builds
and gives the wheel a local version naming the torch it needs (``0.1.0+torch2.14.1.cu130``). A
library compiled against one torch calls that torch's C++ symbols, so under another torch it
would fail to load with an undefined-symbol traceback, or load and misbehave; the loader compares
the record with the running torch first (see ``mismatch``).

Libraries built against PyTorch's stable C ABI (``OpBuilder.STABLE_ABI``) are the exception: they
call only the C shim, so the record lists them under ``stable_abi_ops`` with the oldest torch
they serve (``stable_abi_min_torch``), and any torch from that one on may load them. A wheel of
nothing but such libraries says so in its version: ``0.1.0+torchabi2.13``.
"""

from __future__ import annotations

import json
import platform
import re
import sys
from pathlib import Path

# The keys whose difference makes a pre-built library unusable here, with how a message names
# them. The Python version is recorded but not compared: the libraries use no Python API
# (they are loaded with torch.ops.load_library), and the wheel's tag already pins it.
_MUST_MATCH = {"torch_version": "torch", "cuda_version": "CUDA", "machine": "CPU architecture"}


def current_build_info() -> dict:
    """The facts of this interpreter and torch that a pre-built library depends on."""
    import torch

    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python_version": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "platform": sys.platform,
    }


def wheel_local_version(info: dict) -> str:
    """The local version label naming the torch (and CUDA) pre-built ops need:
    ``torch2.14.1.cu130`` or ``torch2.14.1.cpu``."""
    torch_release = str(info["torch_version"]).split("+")[0]
    cuda = info.get("cuda_version")
    accelerator = "cu" + str(cuda).replace(".", "") if cuda else "cpu"
    return f"torch{torch_release}.{accelerator}"


def stable_abi_local_version(min_torch: tuple[int, int]) -> str:
    """The local version label of a wheel whose libraries all use the stable ABI:
    ``torchabi2.13`` (any torch from 2.13 on)."""
    return "torchabi{}.{}".format(*min_torch)


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.14.1+cu130" -> (2, 14)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(found.group(1)), int(found.group(2))


def read_build_info(path: Path) -> dict:
    """The record beside pre-built libraries; {} when it is missing or unreadable (older
    wheels, hand-copied libraries): such libraries are treated as built for an unknown torch."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def mismatch(recorded: dict, running: dict | None = None, op: str | None = None) -> str:
    """'' when `op`'s library built as `recorded` can load here; else what differs, both sides
    named: "built for torch 2.13.0+cpu, running torch 2.14.1+cu130"."""
    running = running if running is not None else current_build_info()
    if not recorded:
        return f"no build record (build_info.json), running torch {running['torch_version']}"
    if op is not None and op in recorded.get("stable_abi_ops", []):
        return _stable_abi_mismatch(recorded, running)
    differences = []
    for key, label in _MUST_MATCH.items():
        if key in recorded and recorded[key] != running[key]:
            differences.append(f"built for {label} {recorded[key]}, running {label} {running[key]}")
    return "; ".join(differences)


def _stable_abi_mismatch(recorded: dict, running: dict) -> str:
    """A stable-ABI library needs the CPU architecture it was compiled for and a torch at least
    as new as the one it targets; the torch it was built with and CUDA do not matter."""
    differences = []
    if recorded.get("machine", running["machine"]) != running["machine"]:
        differences.append(
            f"built for CPU architecture {recorded['machine']}, running {running['machine']}"
        )
    try:
        needed = torch_release(str(recorded["stable_abi_min_torch"]))
    except (KeyError, ValueError):
        differences.append("its build record names no valid stable_abi_min_torch")
    else:
        if torch_release(str(running["torch_version"])) < needed:
            differences.append(
                "built for torch >= {}.{} (stable ABI), running torch {}".format(
                    *needed, running["torch_version"]
                )
            )
    return "; ".join(differences)
