"""Writing the updated fp32 master slices back into every rank's parameters: the
``ParamGathers`` of ``ZeroPartitionedOptimizer`` (a mixin; the stage owns every attribute used
here), which its stepper calls.

After a step each rank holds the new values of its own slice of every bucket; one all-gather per
bucket (``shard_gather.py``: broadcasts on gloo) spreads them, straight into the bucket's flat
tensor where the parameters still view it, else through a temporary one copied out. Gathers are
launched bucket by bucket as the step goes, and waited for together (``finish_gathers``).
"""

from __future__ import annotations

import torch

from ...comm.collective_errors import named_collective
from ...ops.zero import unflatten_from
from .shard_gather import launch_all_gather
from .shard_set import Bucket


class MasterGathers:
    """The gather side of ``ZeroPartitionedOptimizer`` (see the module docstring)."""

    def gather_params(self) -> None:
        """Writes every in-memory master into every rank's parameters, after a step that the
        caller ran on ``optimizer`` itself (the expert-parallel stage steps all its sets at
        once, then each set gathers over its group)."""
        self.finish_gathers([self.launch_gather(b, m) for b, m in zip(self.buckets, self.masters)])

    def bucket_step_calls(self) -> list[list[int]]:
        """The bucket indices stepped per optimizer call when stepping bucket by bucket: one
        bucket a call, so that each bucket's gather overlaps the next one's update."""
        return [[index] for index in range(len(self.buckets))]

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
        in_place = self.params_still_view_flat(bucket)
        full = (
            bucket.flat
            if in_place
            else torch.empty(bucket.size, dtype=bucket.gather_dtype, device=master.device)
        )
        if self.stage == 0:  # every rank owns whole buckets: nothing to gather
            if full.data_ptr() != master.data_ptr():
                full.copy_(master.detach())
            works = []
        else:
            works = launch_all_gather(
                full, master.detach(), self.group, by_broadcast=self._gather_by_broadcast
            )
        return bucket, full, works, in_place

    def owned_device_target(self, bucket: Bucket) -> torch.Tensor:
        """The device tensor that holds this rank's part of ``bucket``'s parameters."""
        if self.params_still_view_flat(bucket):
            return bucket.flat.narrow(0, bucket.owned_start, bucket.owned_size)
        device = self.params[0].device
        return torch.empty(bucket.owned_size, dtype=bucket.gather_dtype, device=device)

    @staticmethod
    def params_still_view_flat(bucket: Bucket) -> bool:
        """Whether ``bucket``'s parameters are still views of its flat tensor (their data was
        not replaced since, e.g. by ``module.half()``)."""
        return bucket.flat is not None and all(
            p.data_ptr() == pointer and p.dtype == bucket.flat.dtype
            for p, pointer in zip(bucket.params, bucket.view_pointers)
        )
