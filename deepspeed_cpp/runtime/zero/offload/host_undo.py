"""Copies of host-resident masters and optimizer state taken before a tentative step.

``offload_optimizer.step_during_backward`` steps sub-groups before the step's global gradient
norm is known (``backward_steps.py``); if that norm turns out not to be finite, the step must be
skipped whole, as if none of it ran. The NVMe home gets that for free from its double-buffered
swap files (the new state goes to the sub-group's other file). The host home
(``offload_optimizer.device: cpu`` with ``step_during_backward: true``, never on by default)
updates its masters and state in place, so it keeps a copy of what a tentative step overwrites
and puts it back when the step is discarded. The copies cost one more host copy of the stepped
sub-groups' masters and per-element state; their buffers are kept for the next step (the same
sizes every step) rather than reallocated.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class HostUndo:
    """Per bucket stepped tentatively: its master, per-element state and other state as they
    were before the step, until the step is committed (dropped) or discarded (restored)."""

    def __init__(self) -> None:
        # bucket -> (whether it had optimizer state, the state that is not per-element,
        # the per-element state keys, [master copy, state copies...])
        self._kept: dict[int, tuple[bool, dict, list[str], list[torch.Tensor]]] = {}
        self._buffers: dict[int, list[torch.Tensor]] = {}  # reused from step to step

    def keep(self, buckets: Iterable[int], masters: list[torch.nn.Parameter], optimizer) -> None:
        for bucket in buckets:
            if bucket in self._kept:
                raise RuntimeError(
                    f"host home: bucket {bucket} was stepped twice tentatively before the step "
                    f"was committed or discarded"
                )
            master = masters[bucket]
            state = optimizer.state.get(master)
            per_element = {
                key: value
                for key, value in (state or {}).items()
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == master.numel()
            }
            others = {
                key: value.clone() if torch.is_tensor(value) else value
                for key, value in (state or {}).items()
                if key not in per_element
            }
            sources = [master.data, *per_element.values()]
            copies = self._copies_like(bucket, sources)
            for copy, source in zip(copies, sources):
                copy.copy_(source)
            self._kept[bucket] = (state is not None, others, list(per_element), copies)

    def restore(self, masters: list[torch.nn.Parameter], optimizer) -> None:
        """Puts every kept bucket back as it was before its tentative step."""
        for bucket, (had_state, others, keys, copies) in self._kept.items():
            master = masters[bucket]
            master.data.copy_(copies[0])
            if not had_state:  # the step made the state: the next one makes it afresh
                optimizer.state.pop(master, None)
                continue
            stepped = optimizer.state.get(master, {})
            restored = dict(others)
            for key, copy in zip(keys, copies[1:]):
                target = stepped.get(key)
                if target is not None and target.shape == copy.shape:
                    restored[key] = target.copy_(copy)  # in place: keeps the optimizer's tensor
                else:
                    restored[key] = copy.clone()
            optimizer.state[master] = restored
        self._kept.clear()

    def drop(self) -> None:
        """The tentative steps are committed: the copies are no longer needed."""
        self._kept.clear()

    def _copies_like(self, bucket: int, sources: list[torch.Tensor]) -> list[torch.Tensor]:
        buffers = self._buffers.get(bucket, [])
        if len(buffers) != len(sources) or any(
            b.shape != s.shape or b.dtype != s.dtype for b, s in zip(buffers, sources)
        ):
            buffers = [torch.empty_like(source, device="cpu") for source in sources]
            self._buffers[bucket] = buffers
        return buffers

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bs in self._buffers.values() for b in bs)
