"""ZeRO-3 units keep their shards in one storage (``runtime/zero/unit_shards.py``), 2 and 3 real
gloo processes: which units do (not a unit with a tied parameter), that training through gathers
sent from those storages equals one process, that a shard replaced behind the unit's back is
gathered by packing again (still equal), and that a checkpoint writes each master alone, not the
unit's whole storage."""

from __future__ import annotations

import contextlib
import glob
import os

import pytest
import torch
import torch.distributed as dist
import zero3_helpers as z3

JOB_TIMEOUT = 240.0
STEPS = 4


def _layout(engine) -> dict:
    """Per unit name: whether its shards are in one storage, and whether each parameter's
    ``ds_tensor`` views that storage, one after another."""
    layout = {}
    for unit in engine._zero_stage.coordinator.units:
        if unit.shards is None:
            layout[unit.name] = None
            continue
        base = unit.shards.storage.data_ptr()
        offsets, expected = [], 0
        for param in unit.params:
            size = param.ds_tensor.element_size()
            offsets.append((param.ds_tensor.data_ptr() - base) // size == expected)
            expected += param.ds_tensor.numel()
        layout[unit.name] = all(offsets) and unit.shards.intact(unit.params)
    return layout


@contextlib.contextmanager
def _backend_all_gather(calls: list):
    """Gathers by the backend's all-gather (what NCCL runs; gloo runs it too) instead of gloo's
    in-place exchange, counting the all-gathers launched in ``calls``."""
    from deepspeed_cpp.runtime.zero import pass_agreement, shard_gather, unit

    saved = (unit.gathers_by_exchange, pass_agreement.gathers_by_exchange)
    all_gather_flat = shard_gather.all_gather_flat

    def counted(*args, **kwargs):
        calls.append(1)
        return all_gather_flat(*args, **kwargs)

    unit.gathers_by_exchange = pass_agreement.gathers_by_exchange = lambda *_: False
    shard_gather.all_gather_flat = counted
    try:
        yield
    finally:
        unit.gathers_by_exchange, pass_agreement.gathers_by_exchange = saved
        shard_gather.all_gather_flat = all_gather_flat


def _job(dtype: str, replace_at: int | None, folder: str, collective: str) -> dict:
    calls = []
    chosen = _backend_all_gather(calls) if collective == "all_gather" else contextlib.nullcontext()
    with chosen:
        result = _train_and_save(dtype, replace_at, folder)
    return {**result, "all_gathers": len(calls)}


def _train_and_save(dtype: str, replace_at: int | None, folder: str) -> dict:
    import deepspeed_cpp as deepspeed

    seed = 11
    model = z3.make_model(seed)
    # Every unit gathered alone (no prefetch coalescing): in the passes whose rank agreement
    # rides on the gathers, each unit's gather sends the header from its storage.
    config = z3.config(dtype, stage3_unit_min_numel=0, stage3_prefetch_bucket_size=0)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        layout = _layout(engine)
        replaced = {}

        def between(engine, step):
            if step != replace_at:
                return
            # A shard moved elsewhere (as unpartitioning or a move would): the unit is no
            # longer intact and its gathers pack again.
            unit = next(u for u in engine._zero_stage.coordinator.units if u.name == "left")
            param = unit.params[0]
            param.ds_tensor = param.ds_tensor.clone()
            replaced["intact"] = unit.shards.intact(unit.params)

        with z3.one_thread():
            final = z3.train(engine, seed, STEPS, between=between)
        engine.save_checkpoint(folder, tag="saved")
        dist.barrier()
        written = {}
        for path in glob.glob(os.path.join(folder, "saved", "*.pt")):
            state = torch.load(path, map_location="cpu", weights_only=True)
            written[os.path.basename(path)] = _whole_storages(state)
        return {"layout": layout, "replaced": replaced, "final": final, "written": written}
    finally:
        engine.destroy()


def _whole_storages(value) -> bool:
    """Whether every tensor in ``value`` (nested dicts and lists) owns its storage alone."""
    if torch.is_tensor(value):
        return value.untyped_storage().nbytes() == value.nbytes
    if isinstance(value, dict):
        return all(_whole_storages(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_whole_storages(v) for v in value)
    return True


@pytest.mark.parametrize(
    "world, dtype, replace_at, collective",
    [
        (2, "fp32", None, "exchange"),
        (2, "fp32", 1, "exchange"),
        (2, "bf16", 1, "exchange"),
        # 3 ranks: the middle rank's copy-out reads its own row between two received ones.
        (3, "fp32", None, "exchange"),
        # The backend's all-gather (NCCL's path), on gloo: sent from the storage, every row
        # received, the agreement's headers riding along.
        (2, "fp32", None, "all_gather"),
    ],
)
def test_units_gather_from_one_storage(pools, tmp_path, world, dtype, replace_at, collective):
    results = pools(world).run(
        _job, dtype, replace_at, str(tmp_path), collective, timeout=JOB_TIMEOUT
    )
    reference = z3.named_state(
        z3.reference(11, STEPS, 1, world, 0.0, torch.bfloat16 if dtype == "bf16" else torch.float32)
    )
    for result in results:
        layout = result["layout"]
        # The embedding and the head share the tied weight: neither unit holds it alone.
        assert layout["embed"] is None and layout["head"] is None, layout
        # Every other unit (odd sizes, weight and bias) keeps its shards together.
        together = {"left", "right", "frozen", "unused", "rare", "eval_head"}
        assert together <= {name for name, kept in layout.items() if kept}, layout
        if replace_at is not None:
            assert result["replaced"] == {"intact": False}
        difference = z3.max_relative_difference(result["final"], reference)
        assert difference <= z3.tolerance(dtype), difference
        assert result["written"] and all(result["written"].values()), result["written"]
        if collective == "all_gather":  # every training step gathered (STEPS forwards)
            assert result["all_gathers"] >= STEPS, result["all_gathers"]
