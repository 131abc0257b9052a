"""``deepspeed.git_version_info``: which release this is, and which ops are installed and usable.

``version``, ``git_hash``, ``git_branch``, ``torch_info`` and ``installed_ops`` (op -> a usable
pre-built library ships with the package) are read at import and cost nothing. ``compatible_ops``
(op -> it can be built or loaded on this machine) is worked out on first access: some
compatibility checks run a compiler probe (``aio``'s optional engines) or nvcc, which a script
that only reads ``version`` should not pay for. Neither ever compiles an op.

An op that DeepSpeed has and deepspeed_cpp does not (``fused_lamb``, ``transformer_inference``)
reads as not compatible rather than raising ``KeyError``: scripts and DeepSpeed's tests use these
dicts to skip what a machine cannot run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import __version__ as version
from .ops.op_builder import ALL_OPS


class _OpTable(dict):
    """op name -> bool; names of ops deepspeed_cpp does not have read as False."""

    def __missing__(self, name: str) -> bool:
        return False


def _git_head(start: Path) -> tuple[str, str]:
    """(commit, branch) of the checkout the package was imported from; ``[none]`` outside one.
    Read from the files git keeps (a worktree's ``.git`` is a file pointing at its folder), not
    by running git at import."""
    for folder in (start, *start.parents):
        dot_git = folder / ".git"
        if dot_git.is_file():
            text = dot_git.read_text().strip()
            if text.startswith("gitdir:"):
                dot_git = (folder / text.split(":", 1)[1].strip()).resolve()
        if not dot_git.is_dir():
            continue
        try:
            head = (dot_git / "HEAD").read_text().strip()
            if not head.startswith("ref:"):
                return head[:8], "[detached]"
            ref = head.split(":", 1)[1].strip()
            common = dot_git
            if (dot_git / "commondir").is_file():
                common = (dot_git / (dot_git / "commondir").read_text().strip()).resolve()
            commit = _read_ref(dot_git, common, ref)
            return (commit[:8] if commit else "[none]"), ref.removeprefix("refs/heads/")
        except OSError:
            break
    return "[none]", "[none]"


def _read_ref(git_dir: Path, common: Path, ref: str) -> str | None:
    for folder in (git_dir, common):
        if (folder / ref).is_file():
            return (folder / ref).read_text().strip()
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    return None


git_hash, git_branch = _git_head(Path(__file__).resolve().parent)


# CUDA and NCCL versions count only where CUDA can run: a CUDA build of torch on a machine without
# a GPU reads "0.0", as DeepSpeed's torch_info does for a CPU-only install. DeepSpeed's test helper
# (bf16_required_version_check) and scripts that copy it run CUDA-only bf16 checks when these are
# set; on such a machine DeepSpeed 0.19.8 skips them (measured), and so must we.
_CUDA_USABLE = torch.version.cuda is not None and torch.cuda.is_available()


def _nccl_version() -> str:
    if not _CUDA_USABLE:
        return "0.0"
    try:
        major, minor, *_ = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError, TypeError):
        return "0.0"
    return f"{major}.{minor}"


torch_info = {
    "version": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "bf16_support": _CUDA_USABLE and torch.cuda.is_bf16_supported(),
    "cuda_version": ".".join(torch.version.cuda.split(".")[:2]) if _CUDA_USABLE else "0.0",
    "nccl_version": _nccl_version(),
    "hip_version": getattr(torch.version, "hip", None) or "0.0",
}

installed_ops = _OpTable(
    (name, builder().find_prebuilt()[0] is not None) for name, builder in ALL_OPS.items()
)


def _accelerator_name() -> str:
    from .accelerator import get_accelerator

    return get_accelerator().device_name()


_compatible_ops: _OpTable | None = None


def _probe_compatible_ops() -> _OpTable:
    global _compatible_ops
    if _compatible_ops is None:
        _compatible_ops = _OpTable(
            (name, builder().is_compatible()[0]) for name, builder in ALL_OPS.items()
        )
    return _compatible_ops


def __getattr__(name: str):
    if name == "compatible_ops":
        return _probe_compatible_ops()
    if name == "accelerator_name":
        return _accelerator_name()
    raise AttributeError(f"module 'deepspeed_cpp.git_version_info' has no attribute '{name}'")


# (and, on first access, accelerator_name and compatible_ops)
__all__ = [
    "git_branch",
    "git_hash",
    "installed_ops",
    "torch_info",
    "version",
]
