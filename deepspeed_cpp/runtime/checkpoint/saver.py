"""engine.save_checkpoint: every rank writes its part; rank 0 publishes the tag, then ``latest``.

The protocol (each step ends with every rank agreeing that every rank succeeded, see
``rank_agreement.py``; if one did not, every rank raises and nothing further is written):

1. rank 0 creates ``save_dir/<tag>.partial/`` (first clearing what killed saves left in the
   folder, see ``interrupted_saves.py``);
2. every rank writes its shard file into it, rank 0 also the module-states and client-state
   files, each through a temporary name, fsync and rename;
3. rank 0 writes ``checkpoint_meta.json`` (listing every file with its size and SHA-256,
   computed while the file was written, see ``digests.py``) into it, renames
   the directory to ``save_dir/<tag>``, writes ``save_dir/zero_to_fp32.py`` if it is missing
   or out of date (``recovery_script.py``) and only then rewrites ``save_dir/latest``.

A crash at any point therefore leaves ``latest`` naming the previous complete checkpoint, and no
directory named after a tag that lacks its metadata. A save that fails (rather than being killed)
removes its ``<tag>.partial`` before it raises. Rank 0 holds ``save_dir``'s save lock from
step 1 to the end (``save_lock.py``): a second training saving into the same folder meanwhile is
refused, naming the holder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ...module_inject import tensor_parallel_info, tensor_parallel_slices
from ...moe.expert_names import expert_layers, to_global
from ...utils.logging import logger
from .atomic_files import (
    publish_directory,
    save_torch_atomically,
    write_text_atomically,
)
from .client_state import NEEDS_PICKLE_KEY, check_client_state
from .digests import DIGEST_KEY, seal_metadata
from .errors import CheckpointSaveError
from .expert_files import expert_payloads, moe_metadata, without_experts
from .expert_layout import (
    bucket_writers,
    checkpoint_layout,
    global_names_by_parameter,
    trainable_ids,
)
from .finite_parameters import NonFiniteParametersError, refuse_nonfinite_parameters
from .interrupted_saves import create_staging, discard_staging
from .layout import (
    CLIENT_STATE_FILE,
    DISPLACED_SUFFIX,
    FORMAT_NAME,
    FORMAT_VERSION,
    LATEST_FILE,
    METADATA_FILE,
    MODULE_FILE,
    STAGING_SUFFIX,
    check_tag,
    model_parallel_dir,
    optimizer_shard_file,
    read_latest_tag,
)
from .metadata import dtype_name, plain, to_json_text
from .model_save import compact, share_tied
from .rank_agreement import agree_on
from .recovery_script import SCRIPT_NAME, write_recovery_script
from .reshard import classify_state
from .rng_state import capture_rng_states
from .save_lock import SaveLock
from .streamed_save import save_streamed_atomically
from .tag_agreement import agree_on_tag

before_rank_files: Callable[[Path, int], None] | None = None
"""Test seam: when set, called on every rank with (staging directory, rank) just before the rank
writes its files, so that a test can make one rank fail part-way through a save."""


def _model_dtype(subject) -> str:
    first = next(iter(subject.module.parameters()), None)
    return dtype_name(first.dtype) if first is not None else "float32"


def _trainable_ids(subject) -> set[int]:
    zero = subject.zero
    return set() if zero is None else trainable_ids(zero.layout_parts())


def _bucket_entries(subject, indices: list[int]) -> dict[int, dict]:
    """This rank's master slices and their optimizer state, by bucket index in the checkpoint's
    layout (``indices``: that index of each of this rank's buckets)."""
    zero = subject.zero
    if zero is None:
        return {}
    entries = {}
    # NVMe-held tensors come as DeferredTensor entries, read while the shard file is written.
    writers = bucket_writers(zero.layout_parts())
    slices = zip(writers, zero.stream_shard_state(), zero.owned_ranges(), indices)
    for writes, slice_, (start, size), bucket in slices:
        if writes:  # ZeRO-0 ranks hold identical copies; the first rank of the group saves them
            entries[bucket] = {"start": start, "size": size, **slice_}
    return entries


def _module_payload(subject, state_dict: dict, exclude_frozen_parameters: bool) -> dict:
    if exclude_frozen_parameters:
        trainable = _trainable_ids(subject)
        for name, param in subject.module.named_parameters(remove_duplicate=False):
            if id(param) not in trainable:
                state_dict.pop(name, None)
    zero = subject.zero
    return {
        "module": state_dict,
        "frozen_parameters_excluded": bool(exclude_frozen_parameters),
        **subject.train_state.payload(),
        "param_groups": (
            [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
            if zero is not None
            else None
        ),
        "zero_stage": subject.zero_stage,
        "world_size": subject.dp_world_size,
        "dtype": _model_dtype(subject),
    }


def _file_entry(
    name: str, role: str, rank: int, payload: dict, staging: Path, streamed: bool = False
) -> dict:
    """Writes ``payload`` to ``staging/name`` (``streamed``: it may hold DeferredTensor entries,
    see ``streamed_save.py``); its entry in the metadata's file list."""
    save = save_streamed_atomically if streamed else save_torch_atomically
    size, digest = save(payload, staging / name)
    return {"name": name, "role": role, "rank": rank, "bytes": size, DIGEST_KEY: digest}


def _write_rank_files(
    subject, staging: Path, client_state, exclude_frozen: bool, state_dict: dict, indices
) -> list[dict]:
    rank = subject.dp_rank  # within the data-parallel group: one part per model-parallel rank
    if before_rank_files is not None:
        before_rank_files(staging, rank)
    shard_name = optimizer_shard_file(rank)
    shard = {
        "rank": rank,
        "world_size": subject.dp_world_size,
        "rng": capture_rng_states(subject.device),
        "buckets": _bucket_entries(subject, indices),
    }
    written = [
        _file_entry(shard_name, f"shard of rank {rank}", rank, shard, staging, streamed=True)
    ]
    layers = expert_layers(subject.module)
    state_dict = to_global(share_tied(subject.module, state_dict), layers)
    for name, role, experts in expert_payloads(state_dict, layers, rank):
        written.append(_file_entry(name, role, rank, compact(experts), staging))
    if rank == 0:
        dense = without_experts(state_dict, layers)
        module = _module_payload(subject, dense, exclude_frozen)
        written.append(_file_entry(MODULE_FILE, "module states", 0, module, staging))
        written.append(
            _file_entry(
                CLIENT_STATE_FILE, "client state", 0, {"client_state": client_state}, staging
            )
        )
    return written


def _state_kinds(subject) -> dict[str, str]:
    entry = subject.zero.first_state()
    if entry is None:
        return {}  # no optimizer step yet: no state
    master = entry["master"]
    return {key: classify_state(value, master) for key, value in entry["state"].items()}


def _metadata(
    subject, tag: str, files: list[dict], exclude_frozen: bool, pickled: bool, layout
) -> dict:
    from ... import __version__

    zero = subject.zero
    state = subject.train_state
    names = global_names_by_parameter(subject.module)
    trainable = _trainable_ids(subject)
    frozen = [
        {
            "names": names[id(p)],
            "shape": list(getattr(p, "ds_shape", p.shape)),
            "dtype": dtype_name(p.dtype),
        }
        for p in subject.module.parameters()
        if id(p) not in trainable
    ]
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "tag": tag,
        "deepspeed_cpp_version": __version__,
        "saved_at_unix": time.time(),
        "zero_stage": subject.zero_stage,
        "world_size": subject.dp_world_size,
        "dtype": _model_dtype(subject),
        "counters": {
            "global_steps": state.global_steps,
            "global_samples": state.global_samples,
            "micro_steps": state.micro_steps,
            "skipped_steps": state.skipped_steps,
        },
        "zero_layout": layout.to_json() if layout is not None else None,
        "moe": moe_metadata(expert_layers(subject.module)),
        "frozen_parameters": frozen,
        "frozen_parameters_excluded": bool(exclude_frozen),
        "optimizer": (
            {
                "type": type(zero.optimizer).__name__,
                "param_groups": plain(
                    [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups]
                ),
                "state_kinds": _state_kinds(subject),
            }
            if zero is not None
            else None
        ),
        "lr_scheduler": state.lr_scheduler_type,
        "files": files,
        NEEDS_PICKLE_KEY: pickled,
        "ds_config": plain(subject.ds_config),
        **(
            {"model_parallel": {"rank": subject.mp_rank, "world_size": subject.mp_world_size}}
            if subject.mp_world_size > 1
            else {}
        ),
        # AutoTP: how each sliced parameter is split, for zero_to_fp32 to merge the parts.
        **(
            {"tensor_parallel_slices": tensor_parallel_slices(subject.module)}
            if tensor_parallel_info(subject.module) is not None
            else {}
        ),
    }


def _gather_state(subject, module_state: dict, layouts: list) -> None:
    """The collective part of a save: the module state (ZeRO-3 gathers it to rank 0; with
    expert-parallel layers each rank keeps its own, its experts go to files of their own) and
    the checkpoint's layout with this rank's bucket indices in it (``expert_layout.py``)."""
    zero = subject.zero
    if subject.expert_parallel:
        module_state.update(subject.module.state_dict())  # stages 0-2: parameters whole
    else:
        module_state.update(subject.full_module_state_dict(True))
    if zero is None:
        layouts.extend([None, []])
        return
    names = global_names_by_parameter(subject.module)
    layouts.extend(
        checkpoint_layout(zero.layout_parts(), names, subject.group, subject.dp_world_size)
    )


def _prepare(save_dir: Path, staging: Path, client_state, allow_pickle: bool, lock) -> bool:
    """Rank 0: checks the client state (before anything is written; only rank 0's is saved),
    takes the folder's save lock and creates the staging directory. Returns whether the client
    state needs full unpickling."""
    pickled = check_client_state({} if client_state is None else client_state, allow_pickle)
    create_staging(save_dir, staging, lock)
    return pickled


def write_recovery_script_or_warn(save_dir: Path) -> None:
    """``zero_to_fp32.py`` beside ``latest``, as DeepSpeed leaves it (``recovery_script.py``).
    A convenience, not part of the checkpoint: failing to write it warns and the save goes on."""
    try:
        write_recovery_script(save_dir)
    except OSError as error:
        logger.warning(
            "deepspeed_cpp: could not write %s (%s); the checkpoint is unaffected, and "
            "`python -m deepspeed_cpp.utils.zero_to_fp32` does what it would",
            save_dir / SCRIPT_NAME,
            error.strerror or error,
        )


def _publish(
    subject, tag, save_dir, staging, files, save_latest, exclude_frozen, pickled, previous, layout
):
    latest = f"{save_dir / LATEST_FILE} still names {previous!r}"
    metadata = seal_metadata(_metadata(subject, tag, files, exclude_frozen, pickled, layout))
    try:
        write_text_atomically(staging / METADATA_FILE, to_json_text(metadata))
        left_behind = publish_directory(
            staging, save_dir / tag, save_dir / f"{tag}{DISPLACED_SUFFIX}"
        )
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(error.errno, f"{reason}; nothing was published, {latest}") from error
    write_recovery_script_or_warn(save_dir)
    if save_latest:
        try:
            write_text_atomically(save_dir / LATEST_FILE, tag)
        except OSError as error:
            # The tag is whole and loads by name; only the pointer to it did not move.
            raise OSError(
                error.errno, f"{save_dir / tag} is complete, but {error.strerror}; {latest}"
            ) from error
    if left_behind is not None:
        # The new checkpoint is whole and published (and `latest` names it): only clean-up
        # failed, which the next save retries. Not an error: the save did what it promised.
        moved = f"{LATEST_FILE} -> {tag}" if save_latest else f"{latest} (save_latest=False)"
        logger.warning(
            "deepspeed_cpp: published checkpoint %s (%s), but %s; remove it by hand, or the "
            "next save into %s removes it",
            save_dir / tag,
            moved,
            left_behind,
            save_dir,
        )


def save_checkpoint(
    subject,
    save_dir,
    tag=None,
    client_state: dict | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    allow_pickle: bool = False,
) -> bool:
    """Saves the engine that ``subject`` describes (``subject.py``) under ``save_dir/<tag>``
    (see the module docstring); collective.

    ``client_state`` may hold tensors and plain data; other objects only with ``allow_pickle``
    (then loading needs ``allow_pickle`` too, see ``client_state.py``)."""
    if save_dir is None or str(save_dir) == "":
        # Path("") is the working folder: a checkpoint would land wherever the job was started.
        raise ValueError(
            f"save_checkpoint: save_dir is {save_dir!r}; expected the folder to save into"
        )
    rank, group = subject.dp_rank, subject.group
    tag = check_tag(f"global_step{subject.train_state.global_steps}" if tag is None else tag)
    state = subject.train_state
    if rank == 0 and state.micro_steps % state.gradient_accumulation_steps:
        logger.warning(
            "deepspeed_cpp: saving '%s' after micro-step %d of %d of a step: the gradients "
            "accumulated since the last step are not saved (a run resumed from it restarts the "
            "step at its first micro-step); save after engine.step() at a boundary to avoid it",
            tag,
            state.micro_steps % state.gradient_accumulation_steps,
            state.gradient_accumulation_steps,
        )
    # Over the whole world: every model-parallel part is saved under the same tag.
    tag = agree_on_tag(tag, subject.tag_validation)
    save_dir = model_parallel_dir(save_dir, subject.mp_rank, subject.mp_world_size, loading=False)
    staging = save_dir / f"{tag}{STAGING_SUFFIX}"
    try:
        previous = read_latest_tag(save_dir)
    except (OSError, ValueError, RuntimeError):
        previous = None
    unchanged = f"nothing was published; {save_dir / LATEST_FILE} still names {previous!r}"
    lock = SaveLock(save_dir)  # rank 0 takes it in _prepare; released however the save ends
    published = False
    try:
        (pickled, *_) = agree_on(
            lambda: (
                _prepare(save_dir, staging, client_state, allow_pickle, lock) if rank == 0 else None
            ),
            group=group,
            what=f"checkpoint '{tag}': creating {staging} ({unchanged})",
            error_type=CheckpointSaveError,
        )
        # ZeRO-3 gathers the parameters to rank 0 one at a time: collectives, so they run in a step
        # of their own, before any rank-local failure (a full disk) could leave the other ranks
        # waiting in a gather. The other ranks keep nothing; rank 0 keeps the consolidated state.
        module_state: dict = {}
        layouts: list = []
        agree_on(
            lambda: _gather_state(subject, module_state, layouts),
            group=group,
            what=f"checkpoint '{tag}': gathering the module state to rank 0 ({unchanged})",
            error_type=CheckpointSaveError,
        )
        agree_on(
            lambda: refuse_nonfinite_parameters(subject.module, module_state),
            group=group,
            what=f"checkpoint '{tag}': checking that the parameters are finite ({unchanged})",
            error_type=NonFiniteParametersError,
        )
        written = agree_on(
            lambda: _write_rank_files(
                subject,
                staging,
                client_state or {},
                exclude_frozen_parameters,
                module_state,
                layouts[1],
            ),
            group=group,
            what=f"checkpoint '{tag}': writing the rank files into {staging} ({unchanged})",
            error_type=CheckpointSaveError,
        )
        files = [entry for entries in written for entry in entries]
        agree_on(
            lambda: (
                _publish(
                    subject,
                    tag,
                    save_dir,
                    staging,
                    files,
                    save_latest,
                    exclude_frozen_parameters,
                    pickled,
                    previous,
                    layouts[0],
                )
                if rank == 0
                else None
            ),
            group=group,
            what=f"checkpoint '{tag}': publishing {save_dir / tag}",
            error_type=CheckpointSaveError,
        )
        if rank == 0:
            total = sum(entry["bytes"] for entry in files)
            logger.info(
                "deepspeed_cpp: saved checkpoint %s (%d files, %.1f MB)%s",
                save_dir / tag,
                len(files) + 1,
                total / 1e6,
                f"; {LATEST_FILE} -> {tag}" if save_latest else "",
            )
        published = True
        return True
    finally:
        if lock.held and not published:
            discard_staging(staging)  # still under the lock: no other save can own it
        lock.release()
