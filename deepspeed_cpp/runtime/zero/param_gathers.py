"""Writing the updated fp32 master slices back into every rank's parameters (a mixin of
``ZeroPartitionedOptimizer``, which owns every attribute used here).

After a step each rank holds the new values of its own slice of every bucket; one all-gather per
bucket (``shard_gather.py``: broadcasts on gloo) spreads them, straight into the bucket's flat
tensor where the parameters still view it, else through a temporary one copied out. Gathers are
launched bucket by bucket as the step goes, and waited for together (``_finish_gathers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...comm.collective_errors import named_collective
from ...ops.zero import unflatten_from
from .shard_gather import launch_all_gather

if TYPE_CHECKING:
    from .partitioned_optimizer import _Bucket


class MasterGathers:
    """The gather side of ``ZeroPartitionedOptimizer`` (see the module docstring)."""

    def gather_params(self) -> None:
        """Writes every in-memory master into every rank's parameters, after a step that the
        caller ran on ``optimizer`` itself (the expert-parallel stage steps all its sets at
        once, then each set gathers over its group)."""
        self._finish_gathers(
            [self._launch_gather(b, m) for b, m in zip(self.buckets, self.masters)]
        )

    def write_params_from_masters(self) -> None:
        """Writes the fp32 master slices into every rank's parameters (after a load)."""
        self.apply_pending_update()
        pending = []
        with torch.no_grad():
            for members in self.home.sub_groups:
                with self.home.resident(members, write_back=False):
                    pending.extend(self._gather_from_master(b) for b in members)
            self._finish_gathers(pending)

    @staticmethod
    def _finish_gathers(pending) -> None:
        for index, (bucket, full, works, in_place) in enumerate(pending):
            with named_collective(
                lambda index=index: f"all_gather of parameter bucket {index} of {len(pending)}"
            ):
                for work in works:
                    work.wait()
            if not in_place:
                unflatten_from(full, [p.data for p in bucket.params], bucket.offsets)

    def _launch_gather(self, bucket: _Bucket, master: torch.Tensor):
        """Starts writing ``master`` (this rank's updated slice of ``bucket``) and the other
        ranks' slices into the bucket's flat parameters, or into a temporary flat tensor that is
        copied into the parameters when they no longer view theirs."""
        in_place = self._params_still_view_flat(bucket)
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
