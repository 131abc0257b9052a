"""One rank's ``{name: tensor}`` dict on every rank, with tensor collectives only: nothing
another rank sent is unpickled (``broadcast_object_list`` would unpickle rank 0's bytes).

The names, shapes and dtypes go first as JSON text (``text_agreement.all_gather_text``), then
each tensor in one broadcast. Names holding one tensor (tied weights: one storage, two names)
arrive as one tensor under both names, as a pickled dict would have kept them.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from .collective_errors import named_collective
from .text_agreement import all_gather_text, collective_device, placed


def broadcast_tensor_dict(state: dict | None, src: int, group, what: str) -> dict:
    """Global rank ``src``'s ``state`` (``{name: tensor}``; ignored on the other ranks) on every
    rank of ``group`` (collective). ``src`` gets its own dict back; the others get tensors on the
    host (gloo, MPI) or on the accelerator's current device. ``what`` names the collectives in
    errors. A value that is not a tensor raises TypeError on every rank, naming it."""
    is_src = dist.get_rank() == src
    tensors: list[torch.Tensor] = []
    if is_src:
        entries, error, first_of = [], None, {}
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                error = f"{what}: '{name}' is a {type(value).__name__}, expected a tensor"
                break
            key = (value.untyped_storage().data_ptr(), value.storage_offset(), value.dtype,
                   tuple(value.shape), value.stride())  # fmt: skip
            if value.numel() > 0 and key in first_of:
                entries.append([name, first_of[key]])  # the same tensor under another name
                continue
            first_of[key] = name
            entries.append([name, list(value.shape), str(value.dtype).removeprefix("torch.")])
            tensors.append(value.detach().contiguous())
        text = json.dumps({"error": error} if error else {"entries": entries})
    else:
        text = ""
    group_src = dist.get_group_rank(group, src) if group is not None else src
    sent = json.loads(all_gather_text(text, f"of the names and shapes {what}", group)[group_src])
    if "error" in sent:
        raise TypeError(sent["error"])
    if is_src:
        sending = [placed(tensor, group) for tensor in tensors]
    else:
        device = collective_device(group)
        sending = [
            torch.empty(entry[1], dtype=getattr(torch, entry[2]), device=device)
            for entry in sent["entries"]
            if len(entry) == 3
        ]
    with named_collective(f"broadcast of {len(sending)} tensors {what}"):
        for tensor in sending:
            dist.broadcast(tensor, src=src, group=group)
    if is_src:
        return state
    result, received = {}, iter(sending)
    for entry in sent["entries"]:
        result[entry[0]] = next(received) if len(entry) == 3 else result[entry[1]]
    return result
