"""ZeRO-3 units from a model's repeated blocks (2 real gloo processes, the session pool): the
blocks of an ``nn.ModuleList`` are fetch units whole (not one per large Linear), also above
``stage3_prefetch_bucket_size``, consecutive small ones grouped into one unit (up to 16 x
``stage3_unit_min_numel`` elements: all three blocks by default, one unit per block with a smaller
minimum); a block above ``stage3_max_live_parameters``, and ``stage3_unit_min_numel`` 0, fall back
to the per-module rules; the blocks' gathers and reductions are coalesced into a few collectives
per step; and training equals one process with torch's AdamW on the global batch in every case."""

from __future__ import annotations

import torch
import torch.distributed as dist
from zero3_block_model import (
    BLOCKS,
    EPS,
    LR,
    MICRO_BATCH,
    Block,
    batches,
    collectives_so_far,
    loss_of,
    make_model,
    reference,
)

JOB_TIMEOUT = 180.0


def blocks_job(zero_extra: dict) -> dict:
    import deepspeed_cpp as deepspeed

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.01}},
        "gradient_clipping": 0.0,  # the torch AdamW reference does not clip
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            **zero_extra,
        },
    }
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    try:
        coordinator = engine._zero_stage.coordinator
        everything = list(dist.distributed_c10d._world.pg_map)
        counts = []
        for x in batches(world):
            before = collectives_so_far(everything)
            engine.backward(loss_of(engine(x[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH])))
            engine.step()
            counts.append(collectives_so_far(everything) - before)
        state = engine.full_module_state_dict()
        return {
            "names": list(coordinator.unit_names),
            "counts": counts,
            "peak_live": coordinator.peak_live_numel(),
            "params": {name: state[name].clone() for name, _ in engine.module.named_parameters()},
        }
    finally:
        engine.destroy()


def _max_difference(ours: dict, theirs: dict) -> float:
    assert ours.keys() == theirs.keys()
    return max((ours[name] - theirs[name]).abs().max().item() for name in theirs)


def test_repeated_blocks_are_units_and_train_like_one_process(pool2):
    expected = reference(2)
    block = sum(p.numel() for p in Block().parameters())
    cases = {
        "blocks": {},
        # A minimum of 4,096 elements groups blocks up to 65,536: each 74,496-element block alone.
        "blocks alone": {"stage3_unit_min_numel": 4096},
        # A block above the live budget is split by the per-module rules.
        "over the cap": {"stage3_max_live_parameters": block - 1},
        # One above the prefetch bucket stays whole (prefetched alone).
        "over the bucket": {"stage3_prefetch_bucket_size": block - 1},
        # DeepSpeed's unit per module.
        "per module": {"stage3_unit_min_numel": 0},
    }
    results = {}
    for case, extra in cases.items():
        first, second = pool2.run(blocks_job, extra, timeout=JOB_TIMEOUT)
        assert first["counts"] == second["counts"], case  # every collective paired
        assert first["names"] == second["names"], case
        assert _max_difference(first["params"], expected) <= 2e-6, case
        assert _max_difference(second["params"], first["params"]) == 0.0, case
        results[case] = first

    blocks = results["blocks"]
    assert blocks["names"] == ["<root>", "blocks.0..blocks.2"], blocks["names"]
    alone = results["blocks alone"]["names"]
    assert alone == ["<root>", "blocks.0", "blocks.1", "blocks.2"], alone
    split = results["over the cap"]["names"]
    assert "blocks.0" in split and "blocks.0.up" in split and "blocks.0.down" in split, split
    assert "blocks.0.norm" not in split, split  # the norm still joins its block
    assert results["over the bucket"]["names"] == blocks["names"], results["over the bucket"]
    per_module = results["per module"]["names"]
    assert "blocks.0.norm" in per_module and len(per_module) == 3 * BLOCKS + 2, per_module

    # Traced steps: the whole model fits the prefetch and reduce buckets, so the units are
    # gathered by two all-gathers (the first unit on demand, the rest prefetched together) and
    # reduced by one reduce-scatter, plus a few use checks and the step's norm: fewer
    # collectives than units even with a unit per module (one gather and one reduction per unit
    # would be at least twice the units).
    assert max(blocks["counts"][1:]) <= 8, blocks["counts"]
    assert max(results["per module"]["counts"][1:]) < len(per_module), results["per module"]
    # Memory stays within the live budget when blocks are split for it.
    assert results["over the cap"]["peak_live"] <= 2 * block, results["over the cap"]["peak_live"]
