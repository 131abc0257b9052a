"""``zero_to_fp32`` for a pipeline checkpoint (``runtime/pipe/checkpoint.py``'s layout): one
``state_dict`` under the ``PipelineModule``'s own names (``<layer index>.<name>``,
``tied_modules.<key>.<name>``), as one process holding every stage would have it.

Each layer file gives its layer's tensors; a parameter the optimizer trains is then replaced by
its fp32 master, cut out of its stage's optimizer shards (one per replica) with the stage's
``ZeroLayout`` recorded in the metadata, so bf16/fp16 pipelines give their fp32 values. Every
file is checked against its SHA-256 as it is read, and read one at a time, memory-mapped.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..runtime.checkpoint.errors import IncompleteCheckpointError
from ..runtime.checkpoint.layout import listed_file
from ..runtime.checkpoint.metadata import ZeroLayout
from ..runtime.checkpoint.shard_reader import load_mapped


def _layer_tensors(directory: Path, record: dict, digests: dict) -> dict[str, torch.Tensor]:
    state = {}
    for index, prefix in record["layer_prefixes"].items():
        name = f"layer_{int(index):02d}-model_states.pt"
        path = listed_file(directory, name, digests, f"layer {index}")
        for key, value in load_mapped(path, digests.get(name), f"layer {index}").items():
            state[prefix + key] = value.clone()  # off the map before the file is closed
    return state


def _stage_masters(directory: Path, layout: ZeroLayout, digests: dict) -> dict[str, torch.Tensor]:
    """Each trainable parameter of one stage (every name it has) -> its fp32 master."""
    values = {p.name: torch.empty(p.numel, dtype=torch.float32) for p in layout.params}
    filled = dict.fromkeys(values, 0)
    for file_name in layout.files():
        path = listed_file(directory, file_name, digests, "optimizer shard")
        masters = load_mapped(path, digests.get(file_name), "optimizer shard")["masters"]
        for bucket_index, bucket in enumerate(layout.buckets):
            for piece in (s for s in bucket.slices if s.file == file_name):
                master = masters[bucket_index] if bucket_index < len(masters) else None
                if master is None or master.numel() != piece.size:
                    raise IncompleteCheckpointError(
                        f"{directory / file_name} does not hold the {piece.size} elements of "
                        f"bucket {bucket_index} that checkpoint_meta.json lists"
                    )
                master = master.reshape(-1)
                for part in layout.pieces(bucket_index, piece.start, piece.start + piece.size):
                    low = part.bucket_start - piece.start
                    count = part.param_stop - part.param_start
                    values[part.param.name][part.param_start : part.param_stop].copy_(
                        master[low : low + count]
                    )
                    filled[part.param.name] += count
        del masters
    for record in layout.params:
        if filled[record.name] != record.numel:
            raise IncompleteCheckpointError(
                f"parameter '{record.name}': the optimizer shards of {directory} hold "
                f"{filled[record.name]} of its {record.numel} elements"
            )
    return {name: values[p.name].view(p.shape) for p in layout.params for name in p.names}


def pipeline_fp32_state_dict(directory: Path, metadata: dict, digests: dict) -> dict:
    records = metadata.get("pipeline_stages")
    if not records:
        raise IncompleteCheckpointError(
            f"{directory} is a pipeline checkpoint without the per-stage records zero_to_fp32 "
            "reads (saved by an older deepspeed_cpp); load it into a PipelineEngine instead"
        )
    state: dict[str, torch.Tensor] = {}
    for record in records:
        stage_state = _layer_tensors(directory, record, digests)
        if record["zero_layout"] is not None:
            layout = ZeroLayout.from_json(record["zero_layout"])
            masters = _stage_masters(directory, layout, digests)
            stage_state.update({k: v for k, v in masters.items() if k in stage_state})
        for name, value in stage_state.items():
            state.setdefault(name, value)  # a tied weight: the same on every stage holding it
    return state
