"""Whether every rank holds the same bytes, and every rank's text, with tensor collectives only:
nothing another rank sent is unpickled.

``same_on_every_rank`` all-gathers a 32-byte sha256 digest (the same size and dtype on every
rank, so the collective cannot mismatch itself); ``all_gather_text`` gathers UTF-8 text as
lengths, then bytes padded to the longest. Callers compare first and gather the text only on a
mismatch, for their message.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .collective_errors import named_collective


def takes_host_tensors(group=None) -> bool:
    """Whether ``group``'s backend takes tensors in host memory (gloo, MPI, a ``cpu:`` entry)."""
    backend = dist.get_backend(group)
    return backend in ("gloo", "mpi") or "cpu:" in backend


def collective_device(group=None, device: torch.device | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the host for gloo/MPI, else ``device``
    (default: the accelerator's current device)."""
    if takes_host_tensors(group):
        return torch.device("cpu")
    if device is None:
        from ..accelerator import get_accelerator

        device = torch.device(get_accelerator().current_device_name())
    return device


def placed(tensor: torch.Tensor, group=None, device: torch.device | None = None) -> torch.Tensor:
    """``tensor`` where ``group``'s collectives take it (a copy only when it must move)."""
    target = collective_device(group, device)
    return tensor if tensor.device == target else tensor.to(target)


def same_on_every_rank(data: bytes, name: str, group=None, device=None) -> bool:
    """Whether every rank of ``group`` passed the same ``data`` (collective). ``name`` names the
    digests' all-gather in errors (timeouts); ``device`` holds the digest where the backend
    takes no host tensors (default: the accelerator's current device)."""
    digest = torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)
    digest = placed(digest, group, device)
    digests = [torch.empty_like(digest) for _ in range(dist.get_world_size(group))]
    with named_collective(name):
        dist.all_gather(digests, digest, group=group)
    return all(torch.equal(other, digests[0]) for other in digests[1:])


def all_gather_text(text: str, what: str, group=None, device=None) -> list[str]:
    """Every rank's ``text`` (collective): two tensor all-gathers, the lengths then the UTF-8
    bytes padded to the longest; ``what`` ends their names in errors."""
    data = text.encode("utf-8")
    world_size = dist.get_world_size(group)
    length = placed(torch.tensor([len(data)], dtype=torch.int64), group, device)
    lengths = [torch.empty_like(length) for _ in range(world_size)]
    with named_collective(f"all_gather of the lengths {what}"):
        dist.all_gather(lengths, length, group=group)
    padded = torch.zeros(max(int(n) for n in lengths), dtype=torch.uint8)
    if data:
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = placed(padded, group, device)
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    with named_collective(f"all_gather of the texts {what}"):
        dist.all_gather(gathered, padded, group=group)
    return [
        bytes(g[: int(n)].cpu().tolist()).decode("utf-8", errors="replace")
        for g, n in zip(gathered, lengths)
    ]
