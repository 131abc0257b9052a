"""Writing the updated fp32 master slices back into every rank's parameters: the
``ParamGathers`` of stages 0-2 (and of stage 3's persistent buckets), which a stage's stepper
calls. Built with the stage's ``ShardSet`` by ``shard_set_builder.py``.

After a step each rank holds the new values of its own slice of every bucket; one all-gather per
bucket (``shard_gather.py``: exchanged in place on gloo) spreads them, straight into the bucket's
flat tensor where the parameters still view it, else through a temporary one copied out. Gathers are
launched bucket by bucket as the step goes, and waited for together (``finish_gathers``).
"""

from __future__ import annotations

import torch

from ...comm.collective_errors import named_collective
from ...ops.zero import flatten_into, unflatten_from
from .shard_gather import gathers_by_exchange, launch_all_gather
from .shard_set import Bucket, ShardSet


class MasterGathers:
    """The gathers of flat buckets over ``shards`` (see the module docstring);
    ``buckets_final_after[k]``: how many leading buckets have their shard gradient final once the
    reducer harvested its first ``k`` reductions (one per bucket here: ``k`` itself)."""

    def __init__(self, shards: ShardSet, reducer, buckets_final_after: list[int]) -> None:
        self.shards = shards
        self.reducer = reducer
        self.buckets_final_after = buckets_final_after
        device = shards.params[0].device
        self.gather_by_exchange = gathers_by_exchange(shards.group, device)

    def buckets_reduced(self) -> int:
        """How many leading buckets have their shard gradient reduced in this backward (final
        at an accumulation boundary)."""
        return self.buckets_final_after[self.reducer.harvested()]

    def gather_params(self) -> None:
        """Writes every in-memory master into every rank's parameters, after a step that the
        caller ran on the optimizer itself (the expert-parallel stage steps all its sets at
        once, then each set gathers over its group)."""
        shards = self.shards
        self.finish_gathers(
            [self.launch_gather(b, m) for b, m in zip(shards.buckets, shards.masters)]
        )

    def bucket_step_calls(self) -> list[list[int]]:
        """The bucket indices stepped per optimizer call when stepping bucket by bucket: one
        bucket a call, so that each bucket's gather overlaps the next one's update."""
        return [[index] for index in range(len(self.shards.buckets))]

    @staticmethod
    def finish_gathers(pending) -> None:
        for index, (bucket, full, works, in_place) in enumerate(pending):
            if not works and in_place:  # written in place already: nothing to wait for or copy
                continue
            with named_collective(
                lambda index=index: f"all_gather of parameter bucket {index} of {len(pending)}"
            ):
                for work in works:
                    work.wait()
            if not in_place:
                unflatten_from(full, [p.data for p in bucket.params], bucket.offsets)

    def launch_gather(self, bucket: Bucket, master: torch.Tensor):
        """Starts writing ``master`` (this rank's updated slice of ``bucket``) and the other
        ranks' slices into the bucket's flat parameters, or into a temporary flat tensor that is
        copied into the parameters when they no longer view theirs."""
        in_place = params_view_flat(bucket)
        full = (
            bucket.flat
            if in_place
            else torch.empty(bucket.size, dtype=bucket.gather_dtype, device=master.device)
        )
        if self.shards.stage == 0:  # every rank owns whole buckets: nothing to gather
            if full.data_ptr() != master.data_ptr():
                full.copy_(master.detach())
            works = []
        else:
            works = launch_all_gather(
                full, master.detach(), self.shards.group, by_exchange=self.gather_by_exchange
            )
        return bucket, full, works, in_place

    def owned_device_target(self, bucket: Bucket) -> torch.Tensor:
        """The device tensor that holds this rank's part of ``bucket``'s parameters."""
        if params_view_flat(bucket):
            return bucket.flat.narrow(0, bucket.owned_start, bucket.owned_size)
        device = self.shards.params[0].device
        return torch.empty(bucket.owned_size, dtype=bucket.gather_dtype, device=device)

    def owned_slice_of_params(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        """The model parameters' current values over this rank's slice of `bucket`, in fp32."""
        return owned_slice_of_flat_params(bucket, device)


def owned_slice_of_flat_params(bucket: Bucket, device: torch.device) -> torch.Tensor:
    """The current values of ``bucket``'s parameters over this rank's slice of it, in fp32."""
    flat = torch.zeros(bucket.size, dtype=torch.float32, device=device)
    flatten_into([p.detach() for p in bucket.params], flat, bucket.offsets)
    return flat.narrow(0, bucket.owned_start, bucket.owned_size).clone()


def params_view_flat(bucket: Bucket) -> bool:
    """Whether ``bucket``'s parameters are still views of its flat tensor (their data was not
    replaced since, e.g. by ``module.half()``)."""
    return bucket.flat is not None and all(
        p.data_ptr() == pointer and p.dtype == bucket.flat.dtype
        for p, pointer in zip(bucket.params, bucket.view_pointers)
    )
