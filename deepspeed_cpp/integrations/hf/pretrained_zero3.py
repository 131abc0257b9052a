"""``from_pretrained_zero3``: a saved transformers model loaded straight into ZeRO-3 partitions.

transformers' own ``from_pretrained`` partitions at ZeRO-3 only when *its*
``is_deepspeed_zero3_enabled()`` says so, and then imports the ``deepspeed`` distribution; ours
answers for deepspeed_cpp instead (see zero3_config.py). This is the same pattern on our engine::

    keeper = HfDeepSpeedConfig(ds_config)      # stage 3; keep it alive
    model = from_pretrained_zero3(AutoModelForCausalLM, "path/to/saved")

The model is built under ``zero.Init`` (no rank ever holds it whole) and the weights are copied
in one module at a time: each module's own parameters are gathered, rank 0 reads exactly those
tensors from the safetensors file(s) and its values are written back to every rank's shard. Only
rank 0 reads tensors (every rank reads the file names, to fail together when they are missing).
Only safetensors are read (``pytorch_model.bin`` would mean unpickling).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ...comm.collective_errors import named_collective

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def from_pretrained_zero3(model_class, pretrained_path, **config_overrides):
    """Builds ``model_class`` (a transformers model class or an ``AutoModel*`` class) from a local
    folder saved by ``save_pretrained`` (``config.json`` + ``model.safetensors`` or its sharded
    index), partitioned at ZeRO-3 under the live ``HfDeepSpeedConfig``. Collective: every rank
    calls it. ``config_overrides`` go to ``AutoConfig.from_pretrained``. Returns the model in
    eval mode, as ``from_pretrained`` does."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from deepspeed_cpp import zero

    from .zero3_config import _live_config

    live = _live_config()
    if live is None or not live.is_zero3():
        stage = None if live is None else live.config.get("zero_optimization", {}).get("stage")
        found = "none is alive" if live is None else f"the live one has stage {stage!r}"
        raise ValueError(
            "from_pretrained_zero3 builds a ZeRO-3 partitioned model: it needs a live "
            f"HfDeepSpeedConfig with zero_optimization.stage = 3 ({found}); below stage 3 use "
            "the model class's own from_pretrained"
        )
    folder = Path(pretrained_path)
    files = _weight_files(folder)
    config = AutoConfig.from_pretrained(folder, **config_overrides)
    with live.zero_init():
        # The model's own initialisation runs on empty shards here; every weight is then
        # overwritten from the files, so nothing it drew survives.
        if hasattr(model_class, "from_config"):
            model = model_class.from_config(config)
        else:
            model = model_class(config)

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    readers = _Readers(files) if rank0 else None
    problems: list[str] = []
    try:
        missing = _load_parameters(model, readers, rank0, zero, problems)
        _load_buffers(model, readers, rank0, problems)
    finally:
        if readers is not None:
            readers.close()
    # Only rank 0 saw the files: every rank raises the same error (none is left waiting).
    missing, problems = _from_rank0([sorted(missing), problems])
    if problems:
        raise ValueError(f"from_pretrained_zero3: {folder}: " + "; ".join(problems))
    if missing:
        raise ValueError(
            f"from_pretrained_zero3: {folder} has no weights for {missing}; expected "
            f"every parameter of {type(model).__name__} (a new head is built with from_config "
            "under HfDeepSpeedConfig.zero_init() and initialize_weights_zero3 instead)"
        )
    model.eval()
    return model


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (an index maps names to shards)."""
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return {name: folder / shard for name, shard in weight_map.items()}
    if (folder / SINGLE_FILE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE_FILE), framework="pt") as handle:
            return {name: folder / SINGLE_FILE for name in handle.keys()}  # noqa: SIM118
    present = sorted(os.listdir(folder)) if folder.is_dir() else "not a folder"
    raise FileNotFoundError(
        f"from_pretrained_zero3: expected {SINGLE_FILE} or {INDEX_FILE} in {folder}; found "
        f"{present} (only safetensors weights are read: pickled .bin files are never loaded)"
    )


class _Readers:
    """Open safetensors files (rank 0 only), one handle per shard, read tensor by tensor."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self._handles: dict[Path, object] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path].get_tensor(name)

    def close(self) -> None:
        self._handles.clear()


def _load_parameters(model, readers, rank0: bool, zero, problems: list[str]) -> set[str]:
    """Copies every parameter's values in, one module's own parameters at a time; returns the
    names with no tensor in the files. A tied parameter (one tensor under several names, as an
    output layer sharing the input embedding) is read once, under whichever name was saved."""
    names_of: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    saved = set(readers.files) if readers is not None else None
    done: set[int] = set()
    missing: set[str] = set()
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in done]
        if not params:
            continue
        done.update(id(p) for p in params)
        with zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            if not rank0:
                continue
            for param in params:
                names = names_of[id(param)]
                found = [name for name in names if name in saved]
                if not found:
                    missing.add(names[0])
                    continue
                _copy_checked(param, readers.get(found[0]), found[0], problems)
    return missing


def _load_buffers(model, readers, rank0: bool, problems: list[str]) -> None:
    """Saved (persistent) buffers: rank 0 reads them, every rank receives them."""
    import torch.distributed as dist

    spread = dist.is_initialized() and dist.get_world_size() > 1
    saved = set(readers.files) if readers is not None else set()
    persistent = set(model.state_dict().keys())
    for name, buffer in model.named_buffers():
        if name not in persistent:
            continue
        present = torch.tensor([int(name in saved)])
        if spread:
            with named_collective(f"broadcast of whether buffer '{name}' is saved (rank 0)"):
                dist.broadcast(present, src=0)
        if not present.item():
            continue
        with torch.no_grad():
            if rank0:
                _copy_checked(buffer, readers.get(name), name, problems)
            if spread:
                with named_collective(f"broadcast of buffer '{name}' from rank 0"):
                    dist.broadcast(buffer.data, src=0)


def _copy_checked(target: torch.Tensor, value: torch.Tensor, name: str, problems: list) -> None:
    """Copies ``value`` in, or (a shape that differs) records why not: an exception here, on rank
    0 alone, would leave the other ranks waiting in the collective that ends the module."""
    if tuple(value.shape) != tuple(target.shape):
        problems.append(
            f"'{name}' has shape {list(value.shape)} in the file, the model built from its "
            f"config expects {list(target.shape)}"
        )
        return
    target.copy_(value)


def _from_rank0(value: list) -> list:
    """Rank 0's ``value`` (plain lists of strings) on every rank, sent as JSON bytes."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
    size = torch.tensor([payload.numel()])
    with named_collective("broadcast of rank 0's list of checkpoint names (from_pretrained)"):
        dist.broadcast(size, src=0)
        if dist.get_rank() != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0)
    return json.loads(bytes(payload.tolist()).decode())
