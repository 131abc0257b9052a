"""Converts a DeepSpeed checkpoint into deepspeed_cpp's own layout, once.

The DeepSpeed files are read by the same restricted unpickler as a direct load
(``restricted_load.py``) and rebuilt into whole parameters (``flat_partitions.py``); they are
then written as a deepspeed_cpp checkpoint (``layout.py``) whose saved layout holds each trainable
parameter as a bucket of its own, so the converted folder is read by deepspeed_cpp's ordinary
loader (and ``zero_to_fp32``), with digests, and without the DeepSpeed reader. Loading it gives
the engine the same values, bit for bit, as loading the DeepSpeed folder directly:

- masters and optimizer state: the reassembled tensors, as they are;
- counters, LR scheduler, loss scaler, param groups, client state: as the direct load reads them;
- RNG states: none (DeepSpeed saves none; a direct load restores none either).

The buckets are spread over one shard file per rank DeepSpeed saved with (largest first, each
to the file holding least so far), so a resume at that world size reads its share in parallel.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..atomic_files import fsync_directory, save_torch_atomically, write_text_atomically
from ..client_state import NEEDS_PICKLE_KEY, check_client_state
from ..digests import DIGEST_KEY, seal_metadata
from ..errors import CheckpointNotFoundError
from ..layout import (
    CLIENT_STATE_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    MODULE_FILE,
    STAGING_SUFFIX,
    check_tag,
    optimizer_shard_file,
    read_latest_tag,
    tag_directory,
)
from ..metadata import BucketRecord, ParamRecord, ShardSlice, ZeroLayout, plain, to_json_text
from ..recovery_script import write_recovery_script
from ..reshard import classify_state
from .checkpoint import DeepSpeedCheckpoint, read_deepspeed_checkpoint
from .files import is_deepspeed_checkpoint
from .tensor_parallel import SIZE_KEY, SPLITS_KEY

CONVERTED_FROM_KEY = "converted_from"
"""Metadata key of a converted checkpoint: ``{"format": "deepspeed", "source", "ds_version",
"optimizer"}``. Its optimizer type is DeepSpeed's config name, so the loader checks the state
keys (as a direct load does) rather than the optimizer class name."""

_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def _model_dtype(ds_config: dict) -> str:
    for key, name in _DTYPES.items():
        if isinstance(ds_config.get(key), dict) and ds_config[key].get("enabled"):
            return name
    return "float32"


def _accumulation_steps(ds_config: dict) -> int:
    value = ds_config.get("gradient_accumulation_steps", 1)
    return value if isinstance(value, int) and value > 0 else 1


def _layout(saved: DeepSpeedCheckpoint) -> tuple[ZeroLayout, dict[int, int]]:
    """Each parameter a bucket held whole by one rank's file; bucket -> that rank."""
    world = max(saved.world_size, 1)
    loads = [0] * world
    owner: dict[int, int] = {}
    by_size = sorted(range(len(saved.params)), key=lambda b: -saved.params[b].master.numel())
    for bucket in by_size:
        rank = loads.index(min(loads))
        owner[bucket] = rank
        loads[rank] += saved.params[bucket].master.numel()
    records, buckets = [], []
    for index, param in enumerate(saved.params):
        numel = param.master.numel()
        records.append(ParamRecord((param.name,), param.shape, "float32", param.group, index, 0))
        piece = ShardSlice(owner[index], optimizer_shard_file(owner[index]), 0, numel)
        buckets.append(BucketRecord(numel, param.group, (piece,)))
    return ZeroLayout(saved.stage, world, tuple(records), tuple(buckets)), owner


def _shard_files(saved: DeepSpeedCheckpoint, owner: dict[int, int]) -> list[dict]:
    shards = [
        {"rank": r, "world_size": saved.world_size, "rng": None, "buckets": {}}
        for r in range(max(saved.world_size, 1))
    ]
    for bucket, param in enumerate(saved.params):
        entry = {"start": 0, "size": param.master.numel(), "master": param.master}
        entry["state"] = dict(param.state)
        shards[owner[bucket]]["buckets"][bucket] = entry
    return shards


def _module_payload(saved: DeepSpeedCheckpoint, ds_config: dict) -> dict:
    payload = saved.payload
    gas = _accumulation_steps(ds_config)
    return {
        "module": saved.module_state,
        "frozen_parameters_excluded": False,
        "global_steps": payload["global_steps"],
        "global_samples": payload["global_samples"],
        "micro_steps": payload["global_steps"] * gas,  # DeepSpeed saves at a step's boundary
        "gradient_accumulation_steps": gas,
        "skipped_steps": payload["skipped_steps"],
        "optimizer_skipped_steps": payload["optimizer_skipped_steps"],
        "lr_scheduler": payload["lr_scheduler"],
        "loss_scaler": payload["loss_scaler"],
        "param_groups": payload["param_groups"] or None,
        "zero_stage": saved.stage,
        "world_size": saved.world_size,
        "dtype": _model_dtype(ds_config),
    }


def _frozen(saved: DeepSpeedCheckpoint, frozen_shapes) -> list[dict]:
    trainable = {p.name for p in saved.params}
    return [
        {"names": [name], "shape": list(saved.module_state[name].shape), "dtype": "float32"}
        for name in (frozen_shapes or {})
        if name in saved.module_state and name not in trainable
    ]


def _metadata(saved, tag, files, layout, ds_info: dict, pickled: bool) -> dict:
    from .... import __version__

    ds_config = ds_info["ds_config"]
    state = saved.params[0].state if saved.params else {}
    master = saved.params[0].master if saved.params else None
    optimizer = None
    if saved.params:
        optimizer = {
            "type": str((ds_config.get("optimizer") or {}).get("type", "unknown")),
            "param_groups": plain(saved.payload["param_groups"]),
            "state_kinds": {k: classify_state(v, master) for k, v in state.items()},
        }
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "deepspeed_cpp_version": __version__,
        "saved_at_unix": time.time(),
        "zero_stage": saved.stage,
        "world_size": saved.world_size,
        "dtype": _model_dtype(ds_config),
        "counters": {
            "global_steps": saved.payload["global_steps"],
            "global_samples": saved.payload["global_samples"],
            "micro_steps": saved.payload["global_steps"] * _accumulation_steps(ds_config),
            "skipped_steps": saved.payload["skipped_steps"],
        },
        "zero_layout": layout.to_json() if saved.params else None,
        "moe": None,
        "frozen_parameters": _frozen(saved, ds_info["frozen_param_shapes"]),
        "frozen_parameters_excluded": False,
        "optimizer": optimizer,
        "lr_scheduler": None if saved.payload["lr_scheduler"] is None else "saved by DeepSpeed",
        "files": files,
        NEEDS_PICKLE_KEY: pickled,
        "ds_config": plain(ds_config),
        CONVERTED_FROM_KEY: {
            "format": "deepspeed",
            "source": str(saved.directory),
            "ds_version": str(ds_info.get("ds_version")),
            # AutoTP parts are written joined (TP 1); how DeepSpeed split them is kept so that
            # a load at TP > 1 checks deepspeed_cpp's policy splits the same way.
            SIZE_KEY: int(ds_info.get(SIZE_KEY) or 1),
            SPLITS_KEY: dict(ds_info.get(SPLITS_KEY) or {}),
        },
    }


def _source_tag_dir(source: Path, tag: str | None) -> tuple[Path, str]:
    if not source.is_dir():
        raise CheckpointNotFoundError(f"{source} is not a directory (a DeepSpeed checkpoint dir)")
    if tag is None:
        if is_deepspeed_checkpoint(source):  # a tag folder itself, as zero_to_fp32 accepts
            return source, check_tag(source.name)
        tag = read_latest_tag(source)
        if tag is None:
            raise CheckpointNotFoundError(
                f"{source} is not a DeepSpeed checkpoint: it has no 'latest' file and no "
                "mp_rank_00_model_states.pt / zero_pp_rank_0_mp_rank_00_model_states.pt; pass "
                "--tag to name a tag folder"
            )
    directory = tag_directory(source, tag)
    if not is_deepspeed_checkpoint(directory):
        what = "does not exist" if not directory.is_dir() else "holds no DeepSpeed model states"
        if (directory / METADATA_FILE).exists():
            what = "is already a deepspeed_cpp checkpoint (it has checkpoint_meta.json)"
        raise CheckpointNotFoundError(
            f"{directory} is not a DeepSpeed checkpoint: it {what} (expected "
            f"{MODULE_FILE} or zero_pp_rank_0_mp_rank_00_model_states.pt)"
        )
    return directory, check_tag(tag)


def _check_destination(destination: Path) -> None:
    if destination.exists() and not destination.is_dir():
        raise FileExistsError(f"destination {destination} exists and is not a directory")
    if destination.is_dir() and any(destination.iterdir()):
        raise FileExistsError(
            f"destination {destination} exists and is not empty; convert into a new or empty "
            "folder (nothing is overwritten)"
        )


def convert_deepspeed_checkpoint(source, destination, tag: str | None = None) -> Path:
    """Writes the DeepSpeed checkpoint ``source`` (its ``latest`` tag, or ``tag``; or a tag
    folder itself) as a deepspeed_cpp checkpoint ``destination/<tag>`` with ``latest`` naming
    it; returns that folder. ``destination`` must not exist or be empty."""
    source, destination = Path(source), Path(destination)
    directory, tag = _source_tag_dir(source, tag)
    _check_destination(destination)
    saved = read_deepspeed_checkpoint(directory, allow_symlinks=False, with_optimizer=True)
    ds_info = {**saved.info, "ds_config": saved.info.get("ds_config") or {}}
    pickled = check_client_state(saved.client_state, allow_pickle=False)
    layout, owner = _layout(saved)
    destination.mkdir(parents=True, exist_ok=True)
    staging = destination / f"{tag}{STAGING_SUFFIX}"
    staging.mkdir()
    files = []

    def write(name: str, role: str, rank: int, payload: dict) -> None:
        size, digest = save_torch_atomically(payload, staging / name)
        files.append({"name": name, "role": role, "rank": rank, "bytes": size, DIGEST_KEY: digest})

    for shard in _shard_files(saved, owner):
        write(optimizer_shard_file(shard["rank"]), f"shard of rank {shard['rank']}", shard["rank"],
              shard)  # fmt: skip
    write(MODULE_FILE, "module states", 0, _module_payload(saved, ds_info["ds_config"]))
    write(CLIENT_STATE_FILE, "client state", 0, {"client_state": saved.client_state})
    metadata = seal_metadata(_metadata(saved, tag, files, layout, ds_info, pickled))
    write_text_atomically(staging / METADATA_FILE, to_json_text(metadata))
    final = destination / tag
    os.replace(staging, final)
    fsync_directory(destination)
    write_recovery_script(destination)
    write_text_atomically(destination / LATEST_FILE, tag)
    return final
