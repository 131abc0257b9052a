"""What checkpoints read from and write into the partitioned optimizer (a mixin of
``ZeroPartitionedOptimizer``, which owns every attribute used here): this rank's owned ranges,
its fp32 master slices and their optimizer state, bucket by bucket, one sub-group resident at a
time when the state is offloaded (``offload/optimizer_homes.py``)."""

from __future__ import annotations

import torch


class ShardCheckpointState:
    """The checkpoint side of ``ZeroPartitionedOptimizer`` (see the module docstring)."""

    def owned_ranges(self) -> list[tuple[int, int]]:
        """``(start, size)`` of the slice of every bucket this rank owns, in bucket order."""
        return [(bucket.owned_start, bucket.owned_size) for bucket in self.buckets]

    def shard_state(self) -> list[dict]:
        """This rank's part of the training state, per bucket: ``{"master": its fp32 slice,
        "state": the optimizer's state for that slice}`` (the live tensors, except that a master
        slice viewing the flat parameters is copied: torch.save writes a view's whole storage;
        with NVMe offload everything is copied out of the swap buffers)."""
        if self._backward_steps is not None:
            self._backward_steps.check_between_steps("saving a checkpoint")
        self.apply_pending_update()
        copy_all = self.home.kind == "nvme"
        entries = []
        for members in self.home.sub_groups:
            with self.home.resident(members, write_back=False):
                for index in members:
                    master = self.masters[index]
                    state = dict(self._optimizer_for(index).state.get(master, {}))
                    if copy_all:
                        state = {
                            k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()
                        }
                    whole = master.untyped_storage().nbytes() == master.nbytes
                    keep = whole and not copy_all
                    entries.append(
                        {
                            "master": master.detach() if keep else master.detach().clone(),
                            "state": state,
                        }
                    )
        return entries

    def first_state(self) -> dict | None:
        """``{"master", "state"}`` (copies) of the first bucket that has optimizer state, or
        None before the first step: what checkpoint metadata classifies the state kinds by,
        without reading every sub-group back from NVMe."""
        self.apply_pending_update()
        for members in self.home.sub_groups:
            with self.home.resident(members, write_back=False):
                for index in members:
                    state = self._optimizer_for(index).state.get(self.masters[index])
                    if state:
                        return {
                            "master": self.masters[index].detach().clone(),
                            "state": {k: v.clone() if torch.is_tensor(v) else v
                                      for k, v in state.items()},
                        }  # fmt: skip
        return None

    def load_shard_state(self, masters: list[torch.Tensor], states: list[dict] | None) -> None:
        """Replaces every bucket's fp32 master slice with ``masters[b]`` and, when ``states`` is
        given, the optimizer state of that slice with ``states[b]``; pending gradients are
        dropped. The model's parameters are not written (the caller loads them)."""
        if self._backward_steps is not None:
            self._backward_steps.check_between_steps("loading a checkpoint")
        given_states = "no" if states is None else len(states)
        if len(masters) != len(self.masters) or given_states not in ("no", len(masters)):
            raise ValueError(
                f"load_shard_state needs one master slice (and state) per bucket: "
                f"{len(self.masters)} buckets, got {len(masters)} slices and {given_states} states"
            )
        for index, (bucket, values) in enumerate(zip(self.buckets, masters)):
            if tuple(values.shape) != (bucket.owned_size,):
                raise ValueError(
                    f"load_shard_state: bucket {index}: the slice has shape "
                    f"{tuple(values.shape)}, this rank owns {(bucket.owned_size,)}"
                )
        self.discard_pending_update()  # the loaded state replaces it
        on_device = {
            id(p): bool(g.get("capturable") or g.get("fused"))
            for optimizer in (self.optimizer, self._device_optimizer)
            if optimizer is not None
            for g in optimizer.param_groups
            for p in g["params"]
        }
        for members in self.home.sub_groups:
            with self.home.resident(members), torch.no_grad():
                for index in members:
                    master = self.masters[index]
                    master.copy_(masters[index])
                    if states is None:
                        continue
                    optimizer = self._optimizer_for(index)
                    optimizer.state.pop(master, None)
                    if states[index]:
                        # As torch's Optimizer.load_state_dict: per-element state on the master's
                        # device, scalar counters on the CPU unless the group steps on the device.
                        optimizer.state[master] = {
                            key: value.to(master.device)
                            if torch.is_tensor(value) and (value.dim() > 0 or on_device[id(master)])
                            else value
                            for key, value in states[index].items()
                        }
        if self._delayed is not None and states is not None:
            # The delayed update's warm-up goes on where the checkpoint's steps left it.
            self._delayed.steps_seen = _steps_taken(states)
        self.zero_grad()

    def refresh_masters_from_params(self) -> None:
        """Re-reads the fp32 master slices from the model's parameters (after the caller loaded
        weights into them); the optimizer state is kept, pending gradients are dropped."""
        self.discard_pending_update()  # the loaded weights replace it
        for members in self.home.sub_groups:
            with self.home.resident(members), torch.no_grad():
                for index in members:
                    master = self.masters[index]
                    values = self._owned_slice_of_params(self.buckets[index], self.params[0].device)
                    master.copy_(values)
        self.zero_grad()


def _steps_taken(states: list[dict]) -> int:
    """The optimizer steps a checkpoint's state records (its per-tensor ``step`` counters)."""
    counts = [int(s["step"]) for s in states if s and "step" in s]
    return max(counts, default=0)
