"""Every rank agrees on its set-up at ``initialize()`` before the engine's first collective.

Data parallelism assumes that every rank runs the same config on the same model. A rank that
does not (another lr, another micro-batch size, a layer 33 wide instead of 32, parameters
registered in another order) either trains silently with mixed hyper-parameters, or reaches a
collective with tensors the others do not have: gloo then aborts the process (another dtype) or
waits on a key nobody writes (another ZeRO stage). So ``initialize()`` first describes this
rank's set-up as ``(key, value)`` entries and agrees on them with the other ranks
(``comm/entry_agreement.py``: one 32-byte all-gather when they agree; on a mismatch a
``RankDisagreementError`` on every rank naming the keys and parameters that differ and each
rank's value).

Described (and so required to agree): every key of the resolved config except the few that are
local to one rank's machine (``PER_RANK_CONFIG_KEYS``); the names, shapes, dtypes, trainability
and expert group of the parameters and buffers, in registration order (values are not compared:
rank 0's are broadcast to the others; expert parameters of ep_size > 1 differ in value between
expert-parallel ranks but have the same local names and shapes on every rank, so they are
compared like the dense ones); an optimizer or scheduler object passed to ``initialize()`` (its
class and hyper-parameters) and parameter groups given as ``model_parameters``.

With model parallelism (``initialize(mpu=...)``) the ranks of one data-parallel group hold the
same part of the model, and other model-parallel ranks other parts (other slices, other
shapes): the parameters and buffers are compared within the data-parallel group
(``model_group``), everything else across the world.
"""

from __future__ import annotations

import json
import os

import torch

from ..comm.entry_agreement import FAILED, RankDisagreementError, agree_on_entries

# Config keys (dotted paths; a path names its whole section) that may differ between ranks
# because they only concern the rank's own machine: where its NVMe is mounted, how its host
# buffers are allocated, how its I/O and CPU threads are tuned, and what it logs. None of them
# changes the numbers computed, the layout of shards or the collectives run.
PER_RANK_CONFIG_KEYS = frozenset(
    {
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        # Observability: written or printed by each rank alone (monitors by rank 0), never a
        # collective of their own; a per-rank output file name is common.
        "tensorboard",
        "csv_monitor",
        "wandb",
        "comet",
        "flops_profiler",
        "comms_logger",
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.cpuadam_cores_perc",
        "zero_optimization.offload_param.nvme_path",
        "zero_optimization.offload_param.pin_memory",
        "aio",
    }
)

_WHAT = "at deepspeed_cpp.initialize()"
_ADVICE = "every rank must use the same config and build the same model"

__all__ = ["PER_RANK_CONFIG_KEYS", "RankDisagreementError", "check_ranks_agree"]


def check_ranks_agree(
    config,
    model: torch.nn.Module | None,
    *,
    optimizer=None,
    model_parameters=None,
    lr_scheduler=None,
    args=None,
    group=None,
    model_group=None,
) -> None:
    """Raises ``RankDisagreementError`` on every rank unless all ranks of ``group`` describe the
    same set-up; with ``model_group`` (a data-parallel group of model parallelism) the model's
    parameters and buffers only need to agree within it. Collective: every rank must call it
    (or ``report_setup_failure``)."""
    split = model_group is not None
    entries = describe_setup(
        config,
        model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        include_model=not split,
    )
    parts = [(entries, group)]
    if split:
        parts.append((_model_entries(model), model_group))
    for these, over in parts:
        agree_on_entries(
            these,
            what=_WHAT,
            advice=_ADVICE,
            readable=readable_entries,
            device=_collective_device(args),
            group=over,
        )


def report_setup_failure(error: BaseException, *, args=None, group=None) -> None:
    """Takes this rank's part in the agreement when its set-up failed before it could be
    described (a config that does not load): the other ranks then raise naming this rank and
    its error instead of waiting for it in a later collective. The caller re-raises ``error``."""
    failure = [(FAILED, f"{type(error).__name__}: {error}")]
    try:
        agree_on_entries(
            failure, what=_WHAT, advice=_ADVICE, device=_collective_device(args), group=group
        )
    except Exception:  # noqa: BLE001 - this rank's own error is the one to raise, whatever
        pass  # the others said (or a peer that never came, which the timeout reported)


def describe_setup(
    config,
    model,
    *,
    optimizer=None,
    model_parameters=None,
    lr_scheduler=None,
    include_model: bool = True,
) -> list[tuple[str, object]]:
    """This rank's set-up as ordered ``(key, value)`` entries (what ``check_ranks_agree``
    compares). Values are text, except parameters' and buffers' (plain tuples, formatted by
    ``readable_entries`` only when an error needs them: formatting hundreds of them would cost
    more than the whole agreement)."""
    entries = [(f"config {path}", value) for path, value in _config_entries(config)]
    if include_model:
        entries += _model_entries(model)
    groups = None
    if isinstance(model_parameters, (list, tuple)) and model_parameters:
        if all(isinstance(item, dict) for item in model_parameters):
            groups = model_parameters
    names = _parameter_names(model) if optimizer is not None or groups else {}
    if optimizer is not None:
        entries += _optimizer_entries(optimizer, names)
    if groups:
        entries += _group_entries("model_parameters", groups, names)
    if lr_scheduler is not None:
        entries.append(("lr_scheduler passed to initialize()", _type_name(lr_scheduler)))
    return entries


# --- describing a rank's set-up ---------------------------------------------------------------
def _config_entries(config) -> list[tuple[str, str]]:
    dumped = config.model_dump(by_alias=True, mode="json")
    return [
        (path, json.dumps(value, sort_keys=True))
        for path, value in _flatten(dumped, "")
        if not _is_per_rank(path)
    ]


def _flatten(value, prefix: str):
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def _is_per_rank(path: str) -> bool:
    parts = path.split(".")
    return any(".".join(parts[: i + 1]) in PER_RANK_CONFIG_KEYS for i in range(len(parts)))


def _model_entries(model) -> list[tuple[str, object]]:
    if not isinstance(model, torch.nn.Module):
        return [("model", _type_name(model))]
    params, buffers = _tensor_facts(model)
    return [
        ("model class", _type_name(model)),
        ("number of parameters", str(len(params))),
        *((f"parameter #{index}", facts) for index, facts in enumerate(params)),
        ("number of buffers", str(len(buffers))),
        *((f"buffer #{index}", facts) for index, facts in enumerate(buffers)),
    ]


def _tensor_facts(model: torch.nn.Module) -> tuple[list[tuple], list[tuple]]:
    """Facts of every parameter and buffer, in ``named_parameters()``/``named_buffers()``
    order (each tensor once), from one walk over the modules instead of two."""
    params, buffers, seen = [], [], set()
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for name, param in module._parameters.items():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                params.append(_parameter_facts(dot + name, param))
        for name, buffer in module._buffers.items():
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                buffers.append((dot + name, tuple(buffer.shape), _dtype(buffer.dtype)))
    return params, buffers


def _parameter_facts(name: str, param: torch.Tensor) -> tuple:
    """(name, shape, dtype, requires_grad, expert group or None). A ZeRO-3 parameter (built
    under zero.Init) holds an empty tensor: its whole shape is ds_shape, its dtype its shard's.
    The attributes are read from ``__dict__``: a missing one costs an exception in getattr."""
    own = param.__dict__
    shape = own.get("ds_shape") or tuple(param.shape)
    dtype = own["ds_tensor"].dtype if "ds_tensor" in own else param.dtype
    expert = own.get("group_name") if own.get("allreduce", True) is False else None
    return (name, shape, _dtype(dtype), param.requires_grad, expert)


def readable_entries(entries: list[tuple[str, object]]) -> list[tuple[str, str]]:
    """The entries with parameters' and buffers' facts as text: ``'name' shape [33, 8],
    float32, trainable``."""
    return [(key, _readable(value)) for key, value in entries]


def _readable(value) -> str:
    if not isinstance(value, (tuple, list)):
        return str(value)
    name, shape, dtype, *rest = value
    text = f"'{name}' shape {list(shape)}, {dtype}"
    if rest:
        requires_grad, expert = rest
        text += ", trainable" if requires_grad else ", frozen"
        if expert is not None:
            text += f", expert group {expert}"
    return text


def _optimizer_entries(optimizer, names: dict[int, str]) -> list[tuple[str, str]]:
    what = "optimizer passed to initialize()"
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [(what, f"callable {_type_name(optimizer)}")]
    return [(what, _type_name(optimizer))] + _group_entries(what, optimizer.param_groups, names)


def _group_entries(what: str, param_groups, names: dict[int, str]) -> list[tuple[str, str]]:
    entries = [(f"{what}: number of parameter groups", str(len(param_groups)))]
    for index, group in enumerate(param_groups):
        for key in sorted(k for k in group if k != "params"):
            entries.append((f"{what}: group {index} {key}", _plain(group[key])))
        members = [names.get(id(p), "(not in the model)") for p in group.get("params", [])]
        entries.append((f"{what}: group {index} parameters", ", ".join(members)))
    return entries


def _parameter_names(model) -> dict[int, str]:
    if not isinstance(model, torch.nn.Module):
        return {}
    return {id(param): name for name, param in model.named_parameters()}


def _plain(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.tolist()}" if value.numel() <= 16 else f"tensor {list(value.shape)}"
    if isinstance(value, (bool, int, float, str, type(None))):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_plain(item) for item in value) + "]"
    return _type_name(value)


def _type_name(value) -> str:
    kind = type(value)
    return "None" if value is None else f"{kind.__module__}.{kind.__qualname__}"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _collective_device(args) -> torch.device:
    """This rank's accelerator by the engine's rule (``args.local_rank``, else ``LOCAL_RANK``):
    the engine has not made it the current device yet."""
    from ..accelerator import get_accelerator

    local_rank = getattr(args, "local_rank", None)
    if local_rank is None or int(local_rank) < 0:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(get_accelerator().device_name(int(local_rank)))
