"""``engine.load_checkpoint``: checks a checkpoint against the engine, then restores it.

Everything is read and checked before anything is written, so a refused checkpoint leaves the
engine as it was (slices re-cut for NVMe swap files are checked against the files first and
copied from them while they are applied, one sub-group at a time, see ``reshard.py``). Every
rank reads the module-states file and the parts of the shard files its own slices need (through
the saved layout: the checkpoint may come from another world size or another ZeRO stage, see
``reshard.py``), and the ranks agree that all of them succeeded.

Cross-stage loading: stages 0-3 keep the same fp32 masters and element-wise optimizer state,
only cut differently (at stage 3 each partitioned parameter is a bucket of its own), so a
checkpoint from any of them loads into any of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...moe.expert_names import expert_layers, local_name, to_local
from ...utils.logging import logger
from ..train_state import TrainState
from . import tensor_parallel_reshard as tp_reshard
from .client_state import NEEDS_PICKLE_KEY, load_client_state
from .deepspeed_format import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from .deepspeed_format.convert import CONVERTED_FROM_KEY
from .deepspeed_format.expert_groups import regroup_layout, regroup_to_engine
from .deepspeed_format.tensor_parallel import fit_to_engine
from .digests import file_digests
from .errors import (
    CheckpointMismatchError,
    IncompleteCheckpointError,
)
from .expert_files import (
    check_deepspeed_experts_match,
    check_experts_match,
    read_expert_states,
    wanted_by,
)
from .expert_layout import global_names_by_parameter, local_layout, swapped_buckets
from .layout import (
    CLIENT_STATE_FILE,
    MODULE_FILE,
    check_model_parallel_metadata,
    listed_file,
    model_parallel_dir,
    optimizer_shard_file,
    read_latest_tag,
    tag_directory,
)
from .layout import read_metadata as read_checked_metadata
from .metadata import ZeroLayout
from .rank_agreement import agree_on
from .reshard import Resharder, classify_state
from .rng_state import restore_rng_states
from .shard_reader import ShardReader, load_mapped


def _shape(value) -> list[int]:
    return list(value.shape)


def check_module_matches(module: torch.nn.Module, saved: dict, strict: bool, allow_missing=()):
    """Refuses a saved module state_dict whose names or shapes differ from ``module``'s,
    naming the first difference."""
    # A ZeRO-3 partitioned parameter's tensor is empty; ds_shape is its shape.
    current = {
        name: torch.empty(getattr(value, "ds_shape", value.shape), device="meta")
        for name, value in module.state_dict(keep_vars=True).items()
    }
    for name, tensor in current.items():
        if name not in saved:
            if strict and name not in allow_missing:
                raise CheckpointMismatchError(
                    f"the model has '{name}' (shape {_shape(tensor)}) but the checkpoint does not"
                )
        elif saved[name].shape != tensor.shape:
            raise CheckpointMismatchError(
                f"'{name}': the checkpoint has shape {_shape(saved[name])}, the model "
                f"{_shape(tensor)}"
            )
    if strict:
        for name, tensor in saved.items():
            if name not in current:
                raise CheckpointMismatchError(
                    f"the checkpoint has '{name}' (shape {_shape(tensor)}) but the model does not"
                )


def check_layouts_match(saved: ZeroLayout, current: ZeroLayout, held_elsewhere=None) -> None:
    """Refuses a checkpoint whose trainable parameters (names, shapes, param groups) differ
    from the engine's, naming the first difference. ``held_elsewhere(name)``: whether a saved
    parameter this engine lacks is one another rank trains (an expert of another rank)."""
    saved_by_name = saved.by_name()
    for record in current.params:
        match = next((saved_by_name[n] for n in record.names if n in saved_by_name), None)
        if match is None:
            raise CheckpointMismatchError(
                f"parameter '{record.name}' (shape {list(record.shape)}) is trained by this "
                f"engine but the checkpoint has no fp32 master for it"
            )
        if match.shape != record.shape:
            raise CheckpointMismatchError(
                f"parameter '{record.name}': the checkpoint has shape {list(match.shape)}, the "
                f"model {list(record.shape)}"
            )
        if match.group != record.group:
            raise CheckpointMismatchError(
                f"parameter '{record.name}' is in optimizer param group {record.group} here "
                f"and in group {match.group} in the checkpoint"
            )
    current_names = current.by_name()
    for record in saved.params:
        if held_elsewhere is not None and held_elsewhere(record.name):
            continue
        if not any(name in current_names for name in record.names):
            raise CheckpointMismatchError(
                f"the checkpoint trains parameter '{record.name}' (shape {list(record.shape)}) "
                f"but this engine does not (frozen or absent)"
            )


_ADAM_STATE = frozenset({"step", "exp_avg", "exp_avg_sq"})


def _check_deepspeed_optimizer(state_keys, group_count: int, zero) -> None:
    """For optimizer state DeepSpeed saved (read directly or converted): DeepSpeed's optimizer
    class is not ours, so what is checked is that the state holds what this engine's optimizer
    keeps, and the param groups' count."""
    ours = type(zero.optimizer).__name__
    if "adam" in ours.lower() and not _ADAM_STATE <= set(state_keys):
        raise CheckpointMismatchError(
            f"the DeepSpeed checkpoint's optimizer state has {sorted(state_keys)}, this "
            f"engine's {ours} needs {sorted(_ADAM_STATE)}; pass load_optimizer_states=False"
        )
    if group_count != len(zero.param_groups):
        raise CheckpointMismatchError(
            f"the DeepSpeed checkpoint's optimizer has {group_count} param groups, this "
            f"engine's has {len(zero.param_groups)}"
        )


# Classes whose state is the same (torch's Adam names, fp32, a step per tensor) and whose update
# is the same cpu_adam code on the CPU: the config's Adam was DeepSpeedCPUAdam before it became
# FusedAdam (DeepSpeed's class) without offload, and checkpoints of either load into the other.
_SAME_STATE = {"DeepSpeedCPUAdam": "FusedAdam"}


def _optimizer_kind(class_name: str) -> str:
    return _SAME_STATE.get(class_name, class_name)


def _check_optimizer_matches(metadata: dict, zero) -> None:
    saved = metadata.get("optimizer")
    if saved is not None and metadata.get(CONVERTED_FROM_KEY):
        _check_deepspeed_optimizer(saved["state_kinds"], len(saved["param_groups"]), zero)
        return
    if saved is None:
        raise CheckpointMismatchError(
            "the checkpoint has no optimizer state (it was saved by an engine without an "
            "optimizer); pass load_optimizer_states=False"
        )
    ours = type(zero.optimizer).__name__
    if _optimizer_kind(saved["type"]) != _optimizer_kind(ours):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer is {saved['type']}, this engine's is {ours}; pass "
            f"load_optimizer_states=False to load the weights only"
        )
    if len(saved["param_groups"]) != len(zero.param_groups):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, this "
            f"engine's has {len(zero.param_groups)}"
        )


class _Plan:
    """What one rank read and checked, ready to be applied."""

    module_payload: dict
    module_state: dict  # global expert names (moe/expert_names.py): this rank's experts only
    client_state: dict | None = None
    masters: list | None = None
    states: list | None = None
    rng: dict | None = None
    reader: ShardReader | None = None  # closed once the plan is applied (or refused)
    scheduler_type: str | None = None  # the saving schedule's class (None: not recorded)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def _scheduler_type(metadata: dict) -> str | None:
    """The class name of the schedule that saved the checkpoint (None: not recorded, as in one
    converted from DeepSpeed's, which does not name it)."""
    return None if metadata.get(CONVERTED_FROM_KEY) else metadata.get("lr_scheduler")


def _rng_states(subject, directory: Path, metadata: dict, reader: ShardReader) -> dict | None:
    """This rank's saved RNG states, when the checkpoint was saved by as many ranks."""
    if metadata["world_size"] == subject.dp_world_size:
        return reader.file(optimizer_shard_file(subject.dp_rank))["rng"]
    if subject.dp_rank == 0:
        logger.info(
            "deepspeed_cpp: %s was saved by %d ranks, this run has %d: the random-number "
            "generator states are not restored",
            directory,
            metadata["world_size"],
            subject.dp_world_size,
        )
    return None


def _read_and_check(subject, directory: Path, options: dict, plan: _Plan) -> None:
    metadata = read_checked_metadata(directory, options["allow_symlinks"])
    if metadata.get("pipeline") is not None:
        raise CheckpointMismatchError(
            f"{directory} is a pipeline checkpoint (saved by a PipelineEngine, "
            f"{metadata['pipeline']['stages']} stages, a file per layer); load it into a "
            "PipelineModule's engine, or consolidate it with zero_to_fp32 and load the weights "
            "into this model"
        )
    check_model_parallel_metadata(metadata, subject.mp_rank, subject.mp_world_size, directory)
    digests = file_digests(metadata)
    layers = expert_layers(subject.module)
    check_experts_match(metadata, layers)
    module_file = listed_file(directory, MODULE_FILE, digests, "module states")
    plan.module_payload = load_mapped(module_file, digests.get(MODULE_FILE), "module states")
    # The dense state, and the files of this rank's experts (all names global).
    plan.module_state = dict(plan.module_payload["module"])
    plan.module_state.update(read_expert_states(directory, metadata, digests, wanted_by(layers)))
    allow_missing = ()
    if plan.module_payload.get("frozen_parameters_excluded"):
        allow_missing = {
            local_name(n, layers) for p in metadata["frozen_parameters"] for n in p["names"]
        }
    check_module_matches(
        subject.module, to_local(plan.module_state, layers), options["strict"], allow_missing
    )
    plan.scheduler_type = _scheduler_type(metadata)
    # Returned by a module-only load too (DeepSpeed does).
    plan.client_state = load_client_state(
        listed_file(directory, CLIENT_STATE_FILE, digests, "client state"),
        digests.get(CLIENT_STATE_FILE),
        bool(metadata.get(NEEDS_PICKLE_KEY, False)),
        options["allow_pickle"],
    )
    zero = subject.zero
    if options["module_only"]:
        return
    if zero is not None:
        if metadata["zero_layout"] is None:
            raise CheckpointMismatchError(
                "the checkpoint was saved by an engine without an optimizer (no fp32 masters); "
                "pass load_module_only=True"
            )
        saved = ZeroLayout.from_json(metadata["zero_layout"])
        current = local_layout(
            zero.layout_parts(), global_names_by_parameter(subject.module), subject.dp_world_size
        )
        if metadata.get(CONVERTED_FROM_KEY) and metadata.get("optimizer"):
            # DeepSpeed's groups (a MoE model's expert groups of their own) as the engine's.
            saved, groups = regroup_layout(
                saved, metadata["optimizer"]["param_groups"], current, str(directory)
            )
            metadata["optimizer"]["param_groups"] = groups
            plan.module_payload["param_groups"] = groups
        check_layouts_match(saved, current, lambda name: local_name(name, layers) is None)
        if options["optimizer_states"]:
            _check_optimizer_matches(metadata, zero)
        # One reader for the slices and this rank's RNG states: each file is hashed once. It
        # stays open until the plan is applied: slices re-cut for NVMe swap files are read then.
        reader = ShardReader(directory, saved, digests)
        plan.reader = reader
        kinds = metadata["optimizer"]["state_kinds"] if options["optimizer_states"] else {}
        plan.masters, plan.states = Resharder(reader, current, kinds).slices_for(
            zero.owned_ranges(),
            with_state=options["optimizer_states"],
            mapped=swapped_buckets(zero.layout_parts()),
        )
        plan.rng = _rng_states(subject, directory, metadata, reader)
        if saved.stage != current.stage or saved.world_size != current.world_size:
            if subject.dp_rank == 0:
                logger.info(
                    "deepspeed_cpp: resharding %s from ZeRO stage %d on %d ranks to stage %d on "
                    "%d ranks",
                    directory,
                    saved.stage,
                    saved.world_size,
                    current.stage,
                    current.world_size,
                )
    else:
        plan.rng = _rng_states(subject, directory, metadata, ShardReader(directory, None, digests))


def _read_deepspeed(subject, directory: Path, options: dict, plan: _Plan) -> None:
    """``_read_and_check`` for a checkpoint DeepSpeed wrote (``deepspeed_format/``): its
    parameters are rebuilt whole, then cut for this engine like a resharded checkpoint."""
    zero = subject.zero
    wants_masters = zero is not None and not options["module_only"]
    saved = read_deepspeed_checkpoint(directory, options["allow_symlinks"], wants_masters)
    # AutoTP parts come joined: compared with this engine's split and cut for this TP rank.
    saved = fit_to_engine(saved, subject.module, subject.mp_rank, subject.mp_world_size)
    gas = subject.train_state.gradient_accumulation_steps
    # DeepSpeed saves no micro-step count: the checkpoint is at the boundary of its last step.
    saved.payload["micro_steps"] = saved.payload["global_steps"] * gas
    saved.payload["gradient_accumulation_steps"] = gas
    plan.module_payload = saved.payload
    plan.client_state = saved.client_state
    layers = expert_layers(subject.module)
    check_deepspeed_experts_match(saved.info.get("num_experts"), layers, directory)
    # Global expert names (as DeepSpeed's expert files have them): this rank's experts only.
    plan.module_state = {
        name: value
        for name, value in saved.module_state.items()
        if local_name(name, layers) is not None
    }
    check_module_matches(subject.module, to_local(plan.module_state, layers), options["strict"])
    if not wants_masters:
        return
    if not saved.params:
        raise CheckpointMismatchError(
            f"the DeepSpeed checkpoint {directory} has no ZeRO optimizer-states files (fp32 "
            "masters); pass load_module_only=True to load its weights"
        )
    current = local_layout(
        zero.layout_parts(), global_names_by_parameter(subject.module), subject.dp_world_size
    )
    saved.payload["param_groups"] = regroup_to_engine(
        saved.params, saved.payload["param_groups"], current, str(directory)
    )
    layout = saved.layout()
    check_layouts_match(layout, current, lambda name: local_name(name, layers) is None)
    kinds = {}
    if options["optimizer_states"]:
        state = saved.params[0].state
        _check_deepspeed_optimizer(state.keys(), len(saved.payload["param_groups"]), zero)
        kinds = {key: classify_state(value, saved.params[0].master) for key, value in state.items()}
    plan.reader = saved.reader()
    plan.masters, plan.states = Resharder(plan.reader, current, kinds).slices_for(
        zero.owned_ranges(),
        with_state=options["optimizer_states"],
        mapped=swapped_buckets(zero.layout_parts()),
    )
    if subject.dp_rank == 0:
        logger.info(
            "deepspeed_cpp: loading DeepSpeed's checkpoint %s (ZeRO stage %d on %d ranks) into "
            "ZeRO stage %d on %d ranks",
            directory,
            saved.stage,
            saved.world_size,
            current.stage,
            current.world_size,
        )


def _read_tensor_parallel(subject, directories, options: dict, plan: _Plan) -> None:
    """``_read_and_check`` for a checkpoint saved at another tensor-parallel size
    (``tensor_parallel_reshard.py``): its parts joined and re-cut for this TP rank."""
    parts = tp_reshard.read_parts(directories, options["allow_symlinks"])
    recut = tp_reshard.Recut(parts, subject.module, subject.mp_rank, subject.mp_world_size)
    first = parts[0]
    plan.module_payload = first.payload
    plan.scheduler_type = _scheduler_type(first.metadata)
    plan.module_state = tp_reshard.module_state(parts, subject.module, recut)
    allow_missing = ()
    if first.payload.get("frozen_parameters_excluded"):
        allow_missing = {n for p in first.metadata["frozen_parameters"] for n in p["names"]}
    check_module_matches(subject.module, plan.module_state, options["strict"], allow_missing)
    zero = subject.zero
    if zero is not None and not options["module_only"]:
        if options["optimizer_states"]:
            _check_optimizer_matches(first.metadata, zero)
        kinds = first.metadata["optimizer"]["state_kinds"] if options["optimizer_states"] else {}
        current = local_layout(
            zero.layout_parts(), global_names_by_parameter(subject.module), subject.dp_world_size
        )
        plan.reader = tp_reshard.whole_parameter_shards(parts, current, recut, kinds)
        check_layouts_match(plan.reader.layout, current)
        plan.masters, plan.states = Resharder(plan.reader, current, kinds).slices_for(
            zero.owned_ranges(),
            with_state=options["optimizer_states"],
            mapped=swapped_buckets(zero.layout_parts()),
        )
    plan.client_state = load_client_state(
        listed_file(first.directory, CLIENT_STATE_FILE, first.digests, "client state"),
        first.digests.get(CLIENT_STATE_FILE),
        bool(first.metadata.get(NEEDS_PICKLE_KEY, False)),
        options["allow_pickle"],
    )
    if subject.global_rank == 0:
        logger.info(
            "deepspeed_cpp: re-cutting %s from tensor-parallel size %d to %d (random-number "
            "generator states not restored)",
            first.directory,
            len(parts),
            subject.mp_world_size,
        )


def refuse_untakeable_train_state(
    subject, state: TrainState, directory, *, scheduler: bool, scheduler_type: str | None = None
) -> None:
    """Refuses (CheckpointMismatchError naming ``directory``) a loss scaler or schedule state
    the engine would fail to take while a checkpoint is applied, when the weights would already
    be written (``subject.check_train_state``); the pipeline's loader calls it too."""
    try:
        subject.check_train_state(state, scheduler=scheduler, scheduler_type=scheduler_type)
    except ValueError as error:
        raise CheckpointMismatchError(f"{directory}: {error}") from error


def _check_train_state(subject, plan: _Plan, options: dict, directory: Path) -> None:
    if not options["module_only"]:
        refuse_untakeable_train_state(
            subject,
            TrainState.from_payload(plan.module_payload),
            directory,
            scheduler=options["scheduler"],
            scheduler_type=plan.scheduler_type,
        )


def _apply(subject, plan: _Plan, options: dict) -> None:
    payload = plan.module_payload
    subject.load_full_module_state(plan.module_state)
    zero = subject.zero
    if options["module_only"]:
        if zero is not None:
            zero.refresh_masters_from_params()
        return
    if zero is not None:
        zero.load_shard_state(plan.masters, plan.states if options["optimizer_states"] else None)
        if options["optimizer_states"]:
            for group, saved in zip(zero.param_groups, payload["param_groups"]):
                # "name" of an expert group says its ep_size, which may have changed.
                group.update({k: v for k, v in saved.items() if k not in ("params", "name")})
    # The optimizer's own state dict carries the lrs; without it, take the schedule's.
    subject.restore_train_state(
        TrainState.from_payload(payload),
        scheduler=options["scheduler"],
        lrs_from_scheduler=not options["optimizer_states"],
    )
    if plan.rng is not None:
        restore_rng_states(plan.rng, subject.device)


def _directory_to_load(subject, load_dir, tag, allow_symlinks: bool) -> Path | None:
    """This model-parallel rank's ``<tag>`` folder (``latest``'s when ``tag`` is None; None
    when there is no ``latest``)."""
    load_dir = model_parallel_dir(load_dir, subject.mp_rank, subject.mp_world_size, loading=True)
    if tag is None:
        tag = read_latest_tag(load_dir, allow_symlinks)
        if tag is None:
            return None
    return tag_directory(load_dir, tag, allow_symlinks)


def _deepspeed_directory(load_dir, tag, allow_symlinks: bool) -> Path | None:
    """``load_dir/<tag>`` when DeepSpeed wrote it (its model-parallel parts all lie there, where
    deepspeed_cpp's own lie in ``load_dir/mp_rank_XX``); None otherwise."""
    if tag is None:
        tag = read_latest_tag(load_dir, allow_symlinks)
        if tag is None:
            return None
    directory = tag_directory(load_dir, tag, allow_symlinks)
    return directory if directory.is_dir() and is_deepspeed_checkpoint(directory) else None


def load_checkpoint(
    subject,
    load_dir,
    tag=None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    allow_pickle: bool = False,
    allow_symlinks: bool = False,
):
    """Restores the engine ``subject`` describes (``subject.py``) from ``load_dir/<tag>``
    (``tag`` None: the one ``latest`` names).

    Returns ``(path, client_state)``, or ``(None, None)`` with a warning when ``tag`` is None
    and ``load_dir/latest`` does not exist (DeepSpeed's behaviour). Collective.
    ``allow_pickle``: needed (and only then used) for a checkpoint saved with
    ``save_checkpoint(..., allow_pickle=True)``, see ``client_state.py``. ``tag`` and the tag in
    ``latest`` must each be one directory name in ``load_dir``; a symbolic link (``latest``, the
    tag folder, a file in it) is followed only with ``allow_symlinks`` (see ``layout.py``).
    """
    deepspeed_directory = _deepspeed_directory(load_dir, tag, allow_symlinks)
    saved_tp_size = None
    if deepspeed_directory is None:  # DeepSpeed keeps every TP part in one tag folder
        saved_tp_size = tp_reshard.saved_size_to_reshard(subject, load_dir)
    directories = None
    if deepspeed_directory is not None:
        directory = deepspeed_directory
    elif saved_tp_size is not None:
        directories = tp_reshard.part_directories(load_dir, saved_tp_size, tag, allow_symlinks)
        directory = directories[0] if directories else None
    else:
        directory = _directory_to_load(subject, load_dir, tag, allow_symlinks)
    if directory is None:
        logger.warning(
            "deepspeed_cpp: no checkpoint to load: %s has no latest file; pass tag=... to load "
            "a specific one",
            load_dir,
        )
        return None, None
    options = {
        "strict": load_module_strict,
        "optimizer_states": load_optimizer_states and subject.zero is not None,
        "scheduler": load_lr_scheduler_states,
        "module_only": load_module_only,
        "allow_pickle": allow_pickle,
        "allow_symlinks": allow_symlinks,
    }
    plans: list[_Plan] = []  # this rank's; only success flags travel between ranks

    def read_and_check() -> None:
        plans.append(_Plan())
        if saved_tp_size is not None:
            _read_tensor_parallel(subject, directories, options, plans[0])
        elif is_deepspeed_checkpoint(directory):
            _read_deepspeed(subject, directory, options, plans[0])
        else:
            _read_and_check(subject, directory, options, plans[0])
        _check_train_state(subject, plans[0], options, directory)

    try:
        agree_on(
            read_and_check,
            group=subject.group,
            what=f"loading checkpoint {directory}",
            error_type=IncompleteCheckpointError,
            keep_local_error=True,
        )
        plan = plans[0]
        _apply(subject, plan, options)
    finally:
        if plans:
            plans[0].close()
    if subject.dp_rank == 0:
        logger.info("deepspeed_cpp: loaded checkpoint %s", directory)
    return str(directory), plan.client_state
