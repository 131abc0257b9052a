"""``param.ds_summary()`` on a real 2-rank ZeRO-3 engine: DeepSpeed 0.19.8's keys, with values
that follow the parameter through partitioned, gathered and persisted states; shapes checked
against the single-process model, shard sizes against the padding rule computed here."""

from __future__ import annotations

import torch
import zero3_helpers as h

# DeepSpeed 0.19.8's ds_summary() keys (partition_parameters.py), in its order.
DEEPSPEED_KEYS = [
    "id", "status", "numel", "ds_numel", "shape", "ds_shape", "requires_grad",
    "grad_shape", "persist", "active_sub_modules", "ds_tensor.shape",
]  # fmt: skip


def summary_job(config: dict, seed: int):
    import deepspeed_cpp as deepspeed

    engine, _, _, _ = deepspeed.initialize(model=h.make_model(seed), config=config)
    named = dict(engine.module.named_parameters())
    before = {name: p.ds_summary() for name, p in named.items()}
    debug_ids = {name: p.ds_summary(use_debug_name=True)["id"] for name, p in named.items()}
    with deepspeed.zero.GatheredParameters(list(named.values())):
        gathered = {name: p.ds_summary() for name, p in named.items()}
    ids = {name: p.ds_id for name, p in named.items()}
    return {"before": before, "gathered": gathered, "debug_ids": debug_ids, "ids": ids}


def shard_numel(numel: int, world: int) -> int:
    # Shards are equal and a multiple of 16 elements (zero padding at the end).
    return max(1, -(-numel // (16 * world))) * 16


def test_ds_summary_has_deepspeeds_keys_and_our_values(pool2):
    seed, threshold = int(torch.randint(0, 2**30, (1,))), h.HIDDEN + 1
    reference = dict(h.reference(seed, 0, 1, 2, 0.0).named_parameters())
    for result in pool2.run(summary_job, h.config(threshold=threshold), seed):
        assert set(result["before"]) == set(reference)
        for name, ref in reference.items():
            before, gathered = result["before"][name], result["gathered"][name]
            assert list(before) == DEEPSPEED_KEYS and list(gathered) == DEEPSPEED_KEYS
            persist = ref.numel() < threshold
            whole = tuple(ref.shape)
            assert before["id"] == gathered["id"] == result["ids"][name]
            assert result["debug_ids"][name] == f"name={name} id={result['ids'][name]}"
            assert before["ds_numel"] == ref.numel() and before["ds_shape"] == whole
            assert before["persist"] is persist and before["requires_grad"] is ref.requires_grad
            assert before["grad_shape"] is None and before["active_sub_modules"] == 0
            if persist:
                assert before["status"] == "AVAILABLE" and before["shape"] == whole
                assert before["ds_tensor.shape"] == ref.shape
            else:
                assert before["status"] == "NOT_AVAILABLE"
                assert before["shape"] == (0,) and before["numel"] == 0
                assert before["ds_tensor.shape"] == (shard_numel(ref.numel(), 2),)
            assert gathered["status"] == "AVAILABLE" and gathered["shape"] == whole
            assert gathered["numel"] == ref.numel()
            assert gathered["active_sub_modules"] == 1  # GatheredParameters holds each
