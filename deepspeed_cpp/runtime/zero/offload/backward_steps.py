"""Which optimizer sub-groups were stepped during this step's backward
(``offload_optimizer.step_during_backward``, a deepspeed_cpp extension).

The gradient reducer harvests buckets strictly in index order and, at the accumulation boundary,
a harvested bucket's shard gradient is final. Sub-groups are runs of consecutive buckets, so a
sub-group may be stepped as soon as the reducer has harvested its last bucket: with NVMe
offload its reads and writes then overlap the rest of backward instead of following it. Only the
step runs early: the all-gathers of the updated parameters wait for ``engine.step()``, so every
rank issues its collectives in one order whatever its backward timing, and no parameter changes
while autograd may still read it. Stepping early is the same arithmetic on the same gradients
with the same hyper-parameters (set before backward), so parameters are bitwise those of a step
taken at ``engine.step()``.

The sub-groups are stepped by one worker thread, in order (the NVMe home claims its buffers in
sub-group order), so that backward never waits for a swap read or a CPU Adam pass: autograd
goes on producing gradients while the worker brings in and steps what is final. The worker only
touches the masters, state and host buffers of the sub-group it steps and shard gradients the
reducer has finished with; ``engine.step()`` waits for it before touching anything else.

These steps are tentative: they run before the step's global gradient norm is known, and a NaN
or inf may appear after them (later in backward, or only in another rank's shards). The home
keeps the state from before them (``optimizer_homes.py``) until ``engine.step()`` commits them,
or discards them to skip the step whole. Of the designs that give an exact skip, this one keeps
the overlap (stepping only after backward would give up what the option is for) and costs NVMe
no host memory and no extra I/O: the new state goes to a second swap file instead of over the
first, so only disk space is doubled, for the stepped sub-groups and for one step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

KEY = "zero_optimization.offload_optimizer.step_during_backward"


class BackwardSteps:
    """The sub-groups stepped in the current boundary backward and, per bucket, the tensor
    holding this rank's updated part of its parameters until ``engine.step()`` gathers it."""

    def __init__(self, sub_groups: Sequence[Sequence[int]], optimizer) -> None:
        for group, members in enumerate(sub_groups):
            expected = list(range(members[0], members[0] + len(members)))
            if list(members) != expected or (group and members[0] != sub_groups[group - 1][-1] + 1):
                raise ValueError(
                    f"{KEY}: sub-group {group} holds buckets {list(members)}; expected runs of "
                    f"consecutive buckets in order"
                )
        self._last_bucket = [members[-1] for members in sub_groups]
        self._optimizer = optimizer
        # The hyper-parameters the first early step of this backward saw (lr, betas, ...): a
        # change before engine.step() would have reached only some sub-groups.
        self._hyper_parameters: list[dict] | None = None
        # Per bucket stepped early, the norm of its shard gradient, taken before the step
        # reused that gradient's storage.
        self.shard_grad_norms: dict[int, torch.Tensor] = {}
        self._stepped: dict[int, Future] = {}  # sub-group -> its step on the worker
        self._worker: ThreadPoolExecutor | None = None
        self._next = 0  # the first sub-group not yet stepped in this backward
        self._declined = False  # the worker saw a gradient that is not finite: steps no more
        self.active = False  # inside a boundary backward
        self._awaiting_step = False  # a boundary backward ran: engine.step() must come next

    def begin_backward(self, boundary: bool) -> None:
        if self._awaiting_step:
            raise RuntimeError(
                f"{KEY}: backward() was called again before engine.step() at an accumulation "
                f"boundary, whose backward steps the optimizer ({len(self._stepped)} "
                f"sub-group(s) stepped already); call engine.step() after each boundary's "
                f"backward"
            )
        self.active = self._awaiting_step = boundary
        self._next = 0
        self._declined = False

    def end_backward(self) -> None:
        self.active = False

    def ready(self, harvested: int) -> Iterator[int]:
        """The sub-groups, in order, whose every bucket is among the first ``harvested``
        (each yielded once per backward)."""
        while self._next < len(self._last_bucket) and self._last_bucket[self._next] < harvested:
            self._next += 1
            yield self._next - 1

    def submit(
        self,
        group: int,
        step: Callable[[], list[tuple[int, torch.Tensor]]],
        grad_norms: Sequence[torch.Tensor],
    ) -> None:
        """Queues ``step`` (which steps ``group`` and returns its (bucket, updated part) pairs)
        on the worker; sub-groups run in the order they are submitted. ``grad_norms``: the
        norms of the group's shard gradients. From the first group whose norms are not all
        finite on, the worker steps nothing in this backward (``take`` gives None): engine.step()
        will skip the step (``runtime/nonfinite_gradients.py``) and discard what was stepped."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="deepspeed_cpp-sdb")
        if self._hyper_parameters is None:
            self._hyper_parameters = _hyper_parameters(self._optimizer.param_groups)

        def run() -> list[tuple[int, torch.Tensor]] | None:
            # On the worker: reading the norms waits for them without holding backward up.
            if self._declined or not bool(torch.stack(list(grad_norms)).isfinite().all()):
                self._declined = True  # only this one thread writes it during backward
                return None
            with torch.no_grad():  # grad mode is per thread
                return step()

        self._stepped[group] = self._worker.submit(run)

    def take(self, group: int) -> list[tuple[int, torch.Tensor]] | None:
        """``group``'s (bucket, updated part) pairs if it was stepped during backward, once the
        worker is done with it (None: it was not, or was declined); re-raises what stepping
        it raised."""
        future = self._stepped.pop(group, None)
        if future is None:
            return None
        try:
            return future.result()
        except Exception as error:
            raise RuntimeError(
                f"{KEY}: stepping optimizer sub-group {group} during backward failed: {error}"
            ) from error

    def wait_for_worker(self) -> int:
        """Waits for every sub-group submitted in this backward; how many were stepped (not
        declined). Re-raises what stepping one raised."""
        return sum(self.take(group) is not None for group in sorted(self._stepped))

    def check_hyper_parameters(self, param_groups: Sequence[dict]) -> None:
        """At ``engine.step()``: raises if a hyper-parameter changed after sub-groups were
        stepped with its old value during backward (the step would mix both values)."""
        if self._hyper_parameters is None:
            return
        for index, (then, now) in enumerate(
            zip(self._hyper_parameters, _hyper_parameters(param_groups))
        ):
            for key in then.keys() | now.keys():
                if not _same(then.get(key), now.get(key)):
                    raise RuntimeError(
                        f"{KEY}: param_groups[{index}][{key!r}] changed from {then.get(key)!r} "
                        f"to {now.get(key)!r} between backward and engine.step(), after "
                        f"{len(self._stepped)} optimizer sub-group(s) were stepped during "
                        f"backward with the old value; change hyper-parameters before backward "
                        f"(or after engine.step()), or set {KEY} to false"
                    )

    def close(self) -> None:
        """Waits for the worker (its errors were for engine.step() to report) and stops it."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.end_step()

    def check_between_steps(self, what: str) -> None:
        """Raises if a boundary backward ran (and may have stepped sub-groups) but
        ``engine.step()`` has not: the optimizer state would be ahead of the parameters."""
        if self._awaiting_step:
            raise RuntimeError(
                f"{KEY}: {what} between an accumulation boundary's backward and engine.step() "
                f"would see {len(self._stepped)} optimizer sub-group(s) already stepped and the "
                f"parameters not yet updated; call engine.step() first"
            )

    @property
    def stepped_count(self) -> int:
        return len(self._stepped)

    def end_step(self) -> None:
        self._stepped.clear()
        self.shard_grad_norms.clear()
        self._hyper_parameters = None
        self._awaiting_step = False


def _hyper_parameters(param_groups: Sequence[dict]) -> list[dict]:
    return [
        {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in group.items()
            if k != "params"
        }
        for group in param_groups
    ]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
