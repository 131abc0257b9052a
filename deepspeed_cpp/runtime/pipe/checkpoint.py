"""Pipeline checkpoints in DeepSpeed's layout, through the integrity and no-pickle rules of every
deepspeed_cpp checkpoint (atomic files, SHA-256 per file, sealed metadata, ``weights_only``
loads, a tag published by one rename).

```
save_dir/latest
save_dir/<tag>/
  layer_<LL>-model_states.pt                  the layer's state_dict (first replica of its stage)
  mp_rank_<SS>_model_states.pt                stage SS: counters, LR schedule, loss scale
                                              (stage 00: the client state)
  zero_pp_rank_<D>_mp_rank_<SS>_optim_states.pt   replica D of stage SS: its fp32 master slices,
                                              their optimizer state, its RNG states
  checkpoint_meta.json                        written last: files with sizes and digests, the
                                              layer bounds, stages, replicas, ZeRO stage
```

Weights are stored per layer under the layer's own names, so any number of stages (and
replicas) loads them: a stage reads the files of its layers. The optimizer shards are restored
when the layout is the same (same layer bounds, replicas and ZeRO stage: a bitwise resume);
under another layout the fp32 masters and the optimizer state (Adam's moments and step) are
re-cut from every stage's shards by parameter name (``optimizer_reshard.py``).

The engine is seen only as a ``PipeCheckpointSubject``: the ``CheckpointSubject`` every
checkpoint sees (the model, the ZeRO stage through its interface, the progress as a
``TrainState`` and the operation restoring one) and the pipeline's stage id and stage count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ...comm.collective_errors import named_collective
from ...utils.logging import logger
from ..checkpoint.atomic_files import (
    publish_directory,
    save_torch_atomically,
    write_text_atomically,
)
from ..checkpoint.client_state import check_client_state
from ..checkpoint.digests import DIGEST_KEY, file_digests, seal_metadata
from ..checkpoint.errors import (
    CheckpointMismatchError,
    CheckpointSaveError,
    IncompleteCheckpointError,
)
from ..checkpoint.interrupted_saves import create_staging, discard_staging
from ..checkpoint.layout import (
    DISPLACED_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    STAGING_SUFFIX,
    check_tag,
    listed_file,
    read_latest_tag,
    read_metadata,
    resolve_checkpoint_dir,
)
from ..checkpoint.loader import check_module_matches, refuse_untakeable_train_state
from ..checkpoint.metadata import ZeroLayout, names_by_parameter, plain, to_json_text
from ..checkpoint.rank_agreement import agree_on
from ..checkpoint.rng_state import capture_rng_states, restore_rng_states
from ..checkpoint.save_lock import SaveLock
from ..checkpoint.saver import write_recovery_script_or_warn
from ..checkpoint.shard_reader import load_mapped
from ..checkpoint.subject import CheckpointSubject
from ..checkpoint.tag_agreement import agree_on_tag
from .optimizer_reshard import resharded_optimizer_state


@dataclass(frozen=True)
class PipeCheckpointSubject:
    """A pipeline engine as its checkpoints see it: ``base`` (``module`` is the
    ``PipelineModule``'s part on this stage, ``zero`` its stage's optimizer) and where this
    rank sits in the pipeline."""

    base: CheckpointSubject
    stage_id: int
    num_stages: int


def layer_file(layer_index: int) -> str:
    return f"layer_{layer_index:02d}-model_states.pt"


def stage_file(stage: int) -> str:
    return f"mp_rank_{stage:02d}_model_states.pt"


def optimizer_file(replica: int, stage: int) -> str:
    return f"zero_pp_rank_{replica}_mp_rank_{stage:02d}_optim_states.pt"


def _saved_layers(module) -> list[tuple[int, nn.Module]]:
    """This stage's layers that have a state (DeepSpeed saves a layer whose forward function is
    a module; a tied layer run through ``forward_fn`` is saved where it runs as a module)."""
    return [
        (index, func)
        for index, func in zip(module.local_layer_range(), module.forward_funcs)
        if isinstance(func, nn.Module)
    ]


def _entry(name: str, role: str, payload, staging: Path) -> dict:
    size, digest = save_torch_atomically(payload, staging / name)
    return {"name": name, "role": role, "rank": dist.get_rank(), "bytes": size, DIGEST_KEY: digest}


def _write_rank_files(
    subject: PipeCheckpointSubject, staging: Path, client_state: dict
) -> tuple[list[dict], dict | None]:
    base = subject.base
    stage, replica, zero, train = subject.stage_id, base.dp_rank, base.zero, base.train_state
    written = []
    if replica == 0:
        for index, layer in _saved_layers(base.module):
            state = {k: v.detach().clone() for k, v in layer.state_dict().items()}
            written.append(_entry(layer_file(index), f"layer {index}", state, staging))
        states = {
            "global_steps": train.global_steps,
            "global_samples": train.global_samples,
            "micro_steps": train.micro_steps,
            "skipped_steps": train.skipped_steps,
            "lr_scheduler": train.lr_scheduler,
            "loss_scaler": train.loss_scaler,
            "client_state": client_state if stage == 0 else None,
            "param_groups": (
                [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
                if zero is not None
                else None
            ),
            "optimizer_skipped_steps": train.optimizer_skipped_steps,
        }
        written.append(_entry(stage_file(stage), f"states of stage {stage}", states, staging))
    if zero is not None:
        entries = zero.shard_state()
        shard = {
            "masters": [e["master"].detach().clone() for e in entries],
            "states": [e["state"] for e in entries],
            "rng": capture_rng_states(base.device),
        }
        role = f"optimizer shard of stage {stage} replica {replica}"
        written.append(_entry(optimizer_file(replica, stage), role, shard, staging))
    return written, (_stage_record(subject) if replica == 0 else None)


def _stage_record(subject: PipeCheckpointSubject) -> dict:
    """What zero_to_fp32 needs of a stage without building it: the names its layer files'
    keys take in the PipelineModule, and where each parameter's fp32 master lies in the
    stage's optimizer shards (a ZeroLayout, slices named by replica)."""
    module, stage, zero = subject.base.module, subject.stage_id, subject.base.zero
    tied = module.tied_layer_keys()
    prefixes = {
        str(index): (f"tied_modules.{tied[index]}." if index in tied else f"{index}.")
        for index, _ in _saved_layers(module)
    }
    layout = None
    if zero is not None and hasattr(zero, "layout_parts"):
        (part,) = zero.layout_parts()  # a pipeline stage has no expert sets
        layout = ZeroLayout.from_part(
            part, names_by_parameter(module), lambda replica: optimizer_file(replica, stage)
        ).to_json()
    return {"stage": stage, "layer_prefixes": prefixes, "zero_layout": layout}


def _layout(subject: PipeCheckpointSubject) -> dict:
    base = subject.base
    return {
        "stages": subject.num_stages,
        "data_parallel": base.dp_world_size,
        "parts": list(base.module.parts),
        "layers": base.module._num_layers,
        "zero_stage": base.zero_stage,
    }


def save_pipeline_checkpoint(
    subject: PipeCheckpointSubject, save_dir, tag=None, client_state=None, save_latest: bool = True
) -> bool:
    """Saves every stage's part of the training state (see the module docstring); collective
    over the whole world."""
    world = dist.group.WORLD
    global_steps = subject.base.train_state.global_steps
    tag = check_tag(f"global_step{global_steps}" if tag is None else tag)
    client_state = {} if client_state is None else client_state
    if check_client_state(client_state, allow_pickle=False):
        raise ValueError("a pipeline checkpoint's client_state must be plain data and tensors")
    tag = agree_on_tag(tag, subject.base.tag_validation)
    save_dir = Path(save_dir)
    staging = save_dir / f"{tag}{STAGING_SUFFIX}"
    rank = dist.get_rank()
    lock = SaveLock(save_dir)  # as the ZeRO saver's: one save per folder, killed saves cleared

    def prepare() -> None:
        if rank == 0:
            create_staging(save_dir, staging, lock)

    published = False
    try:
        agree_on(prepare, group=world, what=f"checkpoint '{tag}': creating {staging}",
                 error_type=CheckpointSaveError)  # fmt: skip
        written = agree_on(
            lambda: _write_rank_files(subject, staging, client_state),
            group=world,
            what=f"checkpoint '{tag}': writing the stage files into {staging}",
            error_type=CheckpointSaveError,
        )
        files = [entry for entries, _ in written for entry in entries]
        stage_records = sorted((r for _, r in written if r), key=lambda r: r["stage"])

        def publish() -> None:
            if rank != 0:
                return
            from ... import __version__

            metadata = seal_metadata(
                {
                    "format": FORMAT_NAME,
                    "version": FORMAT_VERSION,
                    "tag": tag,
                    "deepspeed_cpp_version": __version__,
                    "saved_at_unix": time.time(),
                    "pipeline": _layout(subject),
                    "pipeline_stages": stage_records,
                    "counters": {"global_steps": global_steps},
                    "files": files,
                    "ds_config": plain(subject.base.ds_config),
                }
            )
            write_text_atomically(staging / METADATA_FILE, to_json_text(metadata))
            write_recovery_script_or_warn(save_dir)  # zero_to_fp32.py beside latest, as DeepSpeed
            publish_directory(staging, save_dir / tag, save_dir / f"{tag}{DISPLACED_SUFFIX}")
            if save_latest:
                write_text_atomically(save_dir / LATEST_FILE, tag)

        agree_on(publish, group=world, what=f"checkpoint '{tag}': publishing {save_dir / tag}",
                 error_type=CheckpointSaveError)  # fmt: skip
        published = True
        if rank == 0:
            logger.info("deepspeed_cpp: saved pipeline checkpoint %s (%d files)",
                        save_dir / tag, len(files) + 1)  # fmt: skip
        return True
    finally:
        if lock.held and not published:
            discard_staging(staging)  # still under the lock: no other save can own it
        lock.release()


def load_pipeline_checkpoint(
    subject: PipeCheckpointSubject,
    load_dir,
    tag=None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    allow_symlinks: bool = False,
):
    """Loads a pipeline checkpoint into this engine, at any number of stages and replicas;
    returns ``(path, client_state)`` or ``(None, None)`` without a tag or ``latest``."""
    if tag is None and read_latest_tag(load_dir, allow_symlinks) is None:
        if not (Path(load_dir) / METADATA_FILE).is_file():
            return None, None
    directory = resolve_checkpoint_dir(load_dir, tag, allow_symlinks)
    metadata = read_metadata(directory, allow_symlinks)
    saved = metadata.get("pipeline")
    if saved is None:
        raise CheckpointMismatchError(
            f"{directory} is not a pipeline checkpoint (saved by a DeepSpeedEngine); load it "
            "into a model built as one module"
        )
    base = subject.base
    module = base.module
    if saved["layers"] != module._num_layers:
        raise CheckpointMismatchError(
            f"{directory} holds a pipeline of {saved['layers']} layers; this PipelineModule "
            f"has {module._num_layers}"
        )
    digests = file_digests(metadata)

    def read(name: str, role: str) -> dict:
        path = listed_file(directory, name, digests, role)
        return load_mapped(path, digests[name], role)

    current = _layout(subject)
    same_layout = current == saved
    optimizer = base.zero
    wants_optimizer = optimizer is not None and load_optimizer_states and not load_module_only
    restored_optimizer = wants_optimizer and same_layout
    resharded_optimizer = wants_optimizer and not same_layout

    def read_stage_files() -> dict:
        # Rank-local reads first, agreed over the world before any collective: a damaged file
        # on one stage fails every rank instead of leaving the others in a broadcast.
        layers = {i: read(layer_file(i), f"layer {i}") for i, _ in _saved_layers(module)}
        shard = None
        if restored_optimizer:
            shard = read(optimizer_file(base.dp_rank, subject.stage_id), "optimizer shard")
        elif resharded_optimizer:
            stage_records = metadata["pipeline_stages"]
            shard = resharded_optimizer_state(optimizer, module, directory, stage_records, digests)
        states = read(stage_file(subject.stage_id if same_layout else 0), "stage states")
        client = read(stage_file(0), "stage states")["client_state"]
        # What loading would refuse, refused before anything is written (on every rank).
        for index, layer in _saved_layers(module):
            try:
                check_module_matches(layer, layers[index], load_module_strict)
            except CheckpointMismatchError as error:
                raise CheckpointMismatchError(f"{directory}, layer {index}: {error}") from None
        if not load_module_only:
            refuse_untakeable_train_state(
                base,
                _saved_train_state(states, base, wants_optimizer),
                directory,
                scheduler=load_lr_scheduler_states and bool(states["lr_scheduler"]),
            )
        return {"layers": layers, "shard": shard, "states": states, "client": client}

    loaded: dict = {}
    agree_on(
        lambda: loaded.update(read_stage_files()),
        group=dist.group.WORLD,
        what=f"load_checkpoint of {directory}",
        error_type=IncompleteCheckpointError,
        keep_local_error=True,
    )
    for index, layer in _saved_layers(module):
        with torch.no_grad():
            layer.load_state_dict(loaded["layers"][index], strict=load_module_strict)
    module._synchronize_tied_weights()  # a tied copy without a file of its own
    states, client_state = loaded["states"], loaded["client"]
    if optimizer is not None:
        if restored_optimizer or resharded_optimizer:
            shard = loaded["shard"]
            if restored_optimizer:
                optimizer.load_shard_state(list(shard["masters"]), list(shard["states"]))
                restore_rng_states(shard["rng"], base.device)
            else:  # re-cut from every saved stage (optimizer_reshard.py); no RNG to match
                optimizer.load_shard_state(*shard)
                if base.global_rank == 0:
                    logger.info("deepspeed_cpp: resharding %s from %s to %s",
                                directory, saved, current)  # fmt: skip
            optimizer.write_params_from_masters()
            for group, saved_group in zip(optimizer.param_groups, states["param_groups"]):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
        else:
            optimizer.refresh_masters_from_params()
    if not load_module_only:
        base.restore_train_state(
            _saved_train_state(states, base, restored_optimizer or resharded_optimizer),
            scheduler=load_lr_scheduler_states and bool(states["lr_scheduler"]),
            # Without the optimizer's saved groups, the schedule's last rates.
            lrs_from_scheduler=not restored_optimizer,
        )
    with named_collective("barrier at the end of load_checkpoint"):
        dist.barrier()
    return str(directory), client_state


def _saved_train_state(states: dict, base: CheckpointSubject, optimizer_loaded: bool):
    """A stage-states file's counters as the ``TrainState`` to restore: the optimizer's skipped
    steps only where its state was loaded (else it keeps its own), the accumulation count this
    engine's (the file does not record it, and the micro-step count is taken as saved)."""
    current = base.train_state
    return replace(
        current,
        global_steps=int(states["global_steps"]),
        global_samples=int(states["global_samples"]),
        micro_steps=int(states["micro_steps"]),
        skipped_steps=int(states["skipped_steps"]),
        optimizer_skipped_steps=(
            int(states["optimizer_skipped_steps"])
            if optimizer_loaded
            else current.optimizer_skipped_steps
        ),
        lr_scheduler=states["lr_scheduler"],
        loss_scaler=states.get("loss_scaler") or None,
    )
