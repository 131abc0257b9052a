"""Times the collectives issued through ``torch.distributed`` while the comms logger is on.

deepspeed_cpp's modules call ``torch.distributed.<op>`` (``dist.all_reduce``, ...) by attribute,
so swapping those attributes catches every Python-side collective (ZeRO-3's gathers, norms,
overflow checks, broadcasts) without touching the callers; calls torch makes internally (through
``distributed_c10d``'s globals) are not counted twice. The originals are put back when the
logger is turned off: when off, nothing here runs.

A synchronous op's latency is its call (the device synchronized after it, as DeepSpeed does);
an asynchronous op (``async_op=True``) returns a handle whose ``wait()`` records the time from
launch to completion.
"""

from __future__ import annotations

import inspect
import time

import torch
import torch.distributed as dist

from .comms_logger import comms_logger

# op -> which argument is the buffer whose size is the message (see comms_logger.py).
_SIZE_ARGUMENT = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",  # one rank's part, as DeepSpeed logs it
    "all_gather_into_tensor": "input_tensor",
    "all_gather_single": "input_tensor",  # torch 2.14's name of the same collective
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "all_to_all_single": "input",
    "barrier": None,
}
_originals: dict[str, object] = {}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item) for item in value)
    return 0


def _world_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _synchronize() -> None:
    from ..accelerator import get_accelerator

    get_accelerator().synchronize()


def record_name(op: str) -> str:
    """``op``, with the calling function when ``debug`` is on (DeepSpeed's debug names)."""
    if not comms_logger.debug:
        return op
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame and frame.f_back else None
    while caller is not None and caller.f_globals.get("__name__", "").startswith(
        ("deepspeed_cpp.comm.", "torch.distributed")
    ):
        caller = caller.f_back
    where = caller.f_code.co_name if caller is not None else "?"
    return f"{op} | [Caller Func: {where}]"


class _TimedWork:
    """An async collective's handle: ``wait()`` records its latency once, then delegates."""

    def __init__(self, work, op: str, name: str, size: int, world: int, start: float):
        self._work, self._op, self._name = work, op, name
        self._size, self._world, self._start = size, world, start
        self._recorded = False

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        if not self._recorded:
            self._recorded = True
            _synchronize()
            latency = (time.perf_counter() - self._start) * 1e3
            comms_logger.append(self._op, self._name, latency, self._size, self._world)
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _argument_reader(original, name: str | None):
    """A reader of argument ``name`` from a call's (args, kwargs): positions are looked up once
    here, not bound per call (binding a signature cost most of the logger's time per op)."""
    if name is None:
        return lambda args, kwargs: None
    parameters = list(inspect.signature(original).parameters.values())
    names = [parameter.name for parameter in parameters]
    if name not in names:
        return lambda args, kwargs: kwargs.get(name)
    index = names.index(name)
    default = parameters[index].default
    default = None if default is inspect.Parameter.empty else default

    def read(args, kwargs):
        if name in kwargs:
            return kwargs[name]
        return args[index] if index < len(args) else default

    return read


# Recorded under DeepSpeed's table name: torch 2.14 renamed the collective, DeepSpeed did not.
_REPORTED_AS = {"all_gather_single": "all_gather_into_tensor"}


def _timed(called: str, original):
    op = _REPORTED_AS.get(called, called)
    size_of = _argument_reader(original, _SIZE_ARGUMENT[called])
    group_of = _argument_reader(original, "group")
    async_of = _argument_reader(original, "async_op")

    def collective(*args, **kwargs):
        if not comms_logger.wants(op):
            return original(*args, **kwargs)
        size = _nbytes(size_of(args, kwargs))
        world = _world_size(group_of(args, kwargs))
        name = record_name(op)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if async_of(args, kwargs) and result is not None:
            return _TimedWork(result, op, name, size, world, start)
        _synchronize()
        comms_logger.append(op, name, (time.perf_counter() - start) * 1e3, size, world)
        return result

    collective.__wrapped__ = original
    collective.__name__ = getattr(original, "__name__", called)
    collective.__doc__ = getattr(original, "__doc__", None)
    return collective


def install() -> None:
    """Wraps torch.distributed's collectives (idempotent)."""
    for op in _SIZE_ARGUMENT:
        if op in _originals or not hasattr(dist, op):
            continue
        _originals[op] = getattr(dist, op)
        setattr(dist, op, _timed(op, _originals[op]))


def uninstall() -> None:
    """Puts torch.distributed's own functions back."""
    for op, original in _originals.items():
        setattr(dist, op, original)
    _originals.clear()


def installed() -> bool:
    return bool(_originals)
