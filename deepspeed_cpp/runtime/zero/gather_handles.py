"""DeepSpeed's names for waiting on several parameter gathers at once, and for the shape a
partitioned parameter shows, under ``deepspeed.runtime.zero.partition_parameters``.

Code written against DeepSpeed's ZeRO-3 (custom fetch logic, tests of a model built under
``zero.Init``) reads ``partitioned_param_data_shape`` to check that a parameter is partitioned and
groups wait handles with ``MultipleAllGatherHandles``; both mean here what they mean there.
"""

from __future__ import annotations

from collections.abc import Iterable

# ``param.data`` of a partitioned (not available) parameter is an empty 1-D tensor, so its
# ``shape`` is ``torch.Size(partitioned_param_data_shape)``; the whole shape is ``ds_shape``.
partitioned_param_data_shape = [0]


class MultipleAllGatherHandles:
    """Several gather handles waited for as one: ``wait(handle_dependency=...)`` waits for each in
    order, passing ``handle_dependency`` by keyword (handles take it positionally, keyword-only or
    through ``**kwargs``)."""

    def __init__(self, handles: Iterable) -> None:
        self.handles = list(handles)
        for index, handle in enumerate(self.handles):
            if not callable(getattr(handle, "wait", None)):
                raise TypeError(
                    f"MultipleAllGatherHandles: handles[{index}] is a {type(handle).__name__} "
                    f"with no wait() method; expected gather handles (objects with wait())"
                )

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)
