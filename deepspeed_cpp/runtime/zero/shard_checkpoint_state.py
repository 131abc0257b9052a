"""What checkpoints read from and write into a stage's ``ShardSet``: this rank's owned ranges,
its fp32 master slices and their optimizer state, bucket by bucket, one sub-group resident at a
time when the state is offloaded (``offload/optimizer_homes.py``). ``ZeroPartitionedOptimizer``
holds one ``ShardCheckpoint`` next to its stepper (which says which optimizer steps a bucket and
whether the state may be read now) and answers the checkpoint calls through it."""

from __future__ import annotations

import contextlib

import torch

from .offload.deferred_tensor import DeferredTensor, PendingValues
from .shard_set import ParamGathers, ShardSet
from .stage import LayoutPart, PartitionLayout
from .steppers import InMemoryStepper


class ShardCheckpoint:
    """The checkpoint side of a stage's shards (see the module docstring)."""

    def __init__(self, shards: ShardSet, stepper: InMemoryStepper, gathers: ParamGathers):
        self.shards = shards
        self.stepper = stepper
        self.gathers = gathers

    def layout(self) -> PartitionLayout:
        shards = self.shards
        plan = shards.plan
        return PartitionLayout(
            params=tuple(shards.params),
            param_bucket=tuple(plan.param_bucket),
            param_offset=tuple(plan.param_offset),
            bucket_sizes=tuple(plan.bucket_sizes),
            bucket_groups=tuple(plan.bucket_groups),
            world_size=shards.world_size,
            replicated=shards.stage == 0,
        )

    def layout_parts(
        self, key: str = "", origins: tuple[int, ...] | None = None
    ) -> list[LayoutPart]:
        """This stage as one ``LayoutPart`` (``key`` and ``origins``: how the expert-parallel
        stage, which owns this one as a set, names it and maps its param groups)."""
        shards, layout = self.shards, self.layout()
        groups = len(self.stepper.optimizer.param_groups) if origins is None else len(origins)
        return [
            LayoutPart(
                key=key,
                stage=shards.stage,
                layout=layout,
                # The stage's group is the data-parallel group: rank r saves file r.
                group_ranks=tuple(range(shards.world_size)),
                param_group_origins=tuple(range(groups)) if origins is None else tuple(origins),
                writes=shards.stage > 0 or shards.rank == 0,
                swapped_buckets=frozenset(
                    b
                    for b in range(len(shards.buckets))
                    if shards.home.state_outline(b) is not None
                ),
            )
        ]

    def owned_ranges(self) -> list[tuple[int, int]]:
        """``(start, size)`` of the slice of every bucket this rank owns, in bucket order."""
        return [(bucket.owned_start, bucket.owned_size) for bucket in self.shards.buckets]

    def shard_state(self) -> list[dict]:
        """This rank's part of the training state, per bucket: ``{"master": its fp32 slice,
        "state": the optimizer's state for that slice}`` (the live tensors, except that a master
        slice viewing the flat parameters is copied: torch.save writes a view's whole storage;
        with NVMe offload everything is copied out of the swap buffers, so the whole state is
        in memory at once: checkpoints use ``stream_shard_state`` instead)."""
        self.stepper.check_between_steps("saving a checkpoint")
        home = self.shards.home
        copy_all = home.kind == "nvme"
        entries = []
        for members in home.sub_groups:
            with home.resident(members, write_back=False):
                entries.extend(self._bucket_entry(index, copy_all) for index in members)
        return entries

    def stream_shard_state(self) -> list[dict]:
        """As ``shard_state``, except that every tensor held in NVMe swap files is a
        ``DeferredTensor`` (dtype and size only) whose bytes ``deferred.reader.view(deferred)``
        returns, read into the swap buffers one sub-group at a time: saving never holds more
        than one sub-group of the state beyond the buffers. The caller closes the readers
        (``reader.close()``) when done, also when it fails."""
        self.stepper.check_between_steps("saving a checkpoint")
        reader = SubGroupReader(self)
        home = self.shards.home
        entries = []
        for members in home.sub_groups:
            if home.state_outline(members[0]) is None:
                with home.resident(members, write_back=False):
                    entries.extend(self._bucket_entry(index, copy=False) for index in members)
                continue
            for index in members:
                scalars, dtypes = home.state_outline(index)
                size = self.shards.buckets[index].owned_size
                state = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}
                for key, dtype in dtypes.items():
                    state[key] = DeferredTensor(dtype, size, index, key, reader)
                master = DeferredTensor(torch.float32, size, index, None, reader)
                entries.append({"master": master, "state": state})
        return entries

    def _bucket_entry(self, index: int, copy: bool) -> dict:
        """``{"master", "state"}`` of a resident bucket (copies with ``copy``; a master viewing
        part of a larger storage is always copied: torch.save writes a view's whole storage)."""
        master = self.shards.masters[index]
        state = dict(self.stepper.optimizer_for(index).state.get(master, {}))
        if copy:
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        whole = master.untyped_storage().nbytes() == master.nbytes
        keep = whole and not copy
        return {"master": master.detach() if keep else master.detach().clone(), "state": state}

    def first_state(self) -> dict | None:
        """``{"master", "state"}`` (copies) of the first bucket that has optimizer state, or
        None before the first step: what checkpoint metadata classifies the state kinds by,
        without reading every sub-group back from NVMe."""
        self.stepper.apply_pending_update()
        home, masters = self.shards.home, self.shards.masters
        for members in home.sub_groups:
            with home.resident(members, write_back=False):
                for index in members:
                    state = self.stepper.optimizer_for(index).state.get(masters[index])
                    if state:
                        return {
                            "master": masters[index].detach().clone(),
                            "state": {k: v.clone() if torch.is_tensor(v) else v
                                      for k, v in state.items()},
                        }  # fmt: skip
        return None

    def load_shard_state(self, masters: list[torch.Tensor], states: list[dict] | None) -> None:
        """Replaces every bucket's fp32 master slice with ``masters[b]`` and, when ``states`` is
        given, the optimizer state of that slice with ``states[b]`` (the caller drops pending
        gradients). The model's parameters are not written (the caller loads them). A
        ``PendingValues`` among them is read while its sub-group is resident: a master straight
        into its swap buffer, a state tensor into a temporary the sub-group's write-back moves
        there, so at most one sub-group's state is in memory beyond the buffers."""
        stepper, shards = self.stepper, self.shards
        if stepper.backward_steps is not None:
            stepper.backward_steps.check_between_steps("loading a checkpoint")
        given_states = "no" if states is None else len(states)
        if len(masters) != len(shards.masters) or given_states not in ("no", len(masters)):
            raise ValueError(
                f"load_shard_state needs one master slice (and state) per bucket: "
                f"{len(shards.masters)} buckets, got {len(masters)} slices and {given_states} "
                f"states"
            )
        for index, (bucket, values) in enumerate(zip(shards.buckets, masters)):
            if tuple(values.shape) != (bucket.owned_size,):
                raise ValueError(
                    f"load_shard_state: bucket {index}: the slice has shape "
                    f"{tuple(values.shape)}, this rank owns {(bucket.owned_size,)}"
                )
        stepper.discard_pending_update()  # the loaded state replaces it
        on_device = {
            id(p): bool(g.get("capturable") or g.get("fused"))
            for optimizer in stepper.optimizers()
            for g in optimizer.param_groups
            for p in g["params"]
        }
        if states is not None:  # every master and state is replaced: nothing stored is read
            shards.home.discard_contents()
        for members in shards.home.sub_groups:
            with shards.home.resident(members), torch.no_grad():
                for index in members:
                    master = shards.masters[index]
                    if isinstance(masters[index], PendingValues):
                        masters[index].read_into(master)
                    else:
                        master.copy_(masters[index])
                    if states is None:
                        continue
                    optimizer = stepper.optimizer_for(index)
                    optimizer.state.pop(master, None)
                    if states[index]:
                        # As torch's Optimizer.load_state_dict: per-element state on the master's
                        # device, scalar counters on the CPU unless the group steps on the device.
                        optimizer.state[master] = {
                            key: value.to(master.device)
                            if torch.is_tensor(value) and (value.dim() > 0 or on_device[id(master)])
                            else value
                            for key, value in _read_pending(states[index]).items()
                        }
        if states is not None:
            stepper.resume_after(states)

    def refresh_masters_from_params(self) -> None:
        """Re-reads the fp32 master slices from the model's parameters (after the caller loaded
        weights into them); the optimizer state is kept (pending gradients are the caller's to
        drop)."""
        self.stepper.discard_pending_update()  # the loaded weights replace it
        shards = self.shards
        device = shards.params[0].device
        for members in shards.home.sub_groups:
            with shards.home.resident(members), torch.no_grad():
                for index in members:
                    values = self.gathers.owned_slice_of_params(shards.buckets[index], device)
                    shards.masters[index].copy_(values)


def _read_pending(state: dict) -> dict:
    return {
        key: value.materialize() if isinstance(value, PendingValues) else value
        for key, value in state.items()
    }


class SubGroupReader:
    """The bytes of an optimizer's ``DeferredTensor`` entries, its sub-groups made resident one
    at a time (read-only: nothing is written back). Views stay valid until the next ``view``
    of another sub-group or ``close``; asked in bucket order, each sub-group is read once."""

    def __init__(self, checkpoint: ShardCheckpoint) -> None:
        self._home = checkpoint.shards.home
        self._masters = checkpoint.shards.masters
        self._optimizer_for = checkpoint.stepper.optimizer_for
        self._group_of = {b: members[0] for members in self._home.sub_groups for b in members}
        self._resident: contextlib.ExitStack | None = None
        self._first: int | None = None  # first bucket of the resident sub-group

    def view(self, deferred: DeferredTensor) -> torch.Tensor:
        first = self._group_of[deferred.bucket]
        if first != self._first:
            self.close()
            members = next(m for m in self._home.sub_groups if m[0] == first)
            stack = contextlib.ExitStack()
            stack.enter_context(self._home.resident(members, write_back=False))
            self._resident, self._first = stack, first
        master = self._masters[deferred.bucket]
        if deferred.key is None:
            value = master.detach()
        else:
            value = self._optimizer_for(deferred.bucket).state[master][deferred.key]
        if value.dtype != deferred.dtype or value.numel() != deferred.numel:
            raise RuntimeError(
                f"checkpoint save: bucket {deferred.bucket} {deferred.key or 'master'} is "
                f"{value.dtype} x {value.numel()} in its swap buffer, the checkpoint's outline "
                f"said {deferred.dtype} x {deferred.numel} (the state changed during the save)"
            )
        return value

    def close(self) -> None:
        resident, self._resident, self._first = self._resident, None, None
        if resident is not None:
            resident.close()
