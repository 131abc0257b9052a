"""ZeRO-3 moves whole units: collectives per training step, counted by every process group's own
sequence number (2 real gloo processes), stay within a bound set by the number of fetch units,
not the number of parameters or uses."""

from __future__ import annotations

import torch
import torch.distributed as dist

JOB_TIMEOUT = 180.0


def _collectives(groups) -> int:
    return sum(int(group._get_sequence_number_for_group()) for group in groups)


def count_job(layers: int, steps: int, width: int = 32, feedforward: int = 64):
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, feedforward, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        torch.nn.Linear(width, 4),
    )
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        coordinator = engine._zero_stage.coordinator
        fetching = [coordinator.fetch_group, coordinator.check_group]
        everything = list(dist.distributed_c10d._world.pg_map)
        generator = torch.Generator().manual_seed(dist.get_rank())
        counts, checks = [], []
        for _ in range(steps):
            x = torch.randn(2, 8, width, generator=generator)
            before = (_collectives(fetching), _collectives(everything))
            checked = _collectives([coordinator.check_group])
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            after = (_collectives(fetching), _collectives(everything))
            counts.append((after[0] - before[0], after[1] - before[1]))
            checks.append(_collectives([coordinator.check_group]) - checked)
        partitioned = sum(1 for u in coordinator.units for _ in u)
        return {
            "units": len(coordinator.units),
            "names": list(coordinator.unit_names),
            "params": partitioned,
            "counts": counts,
            "checks": checks,
        }
    finally:
        engine.destroy()


def test_gathers_and_checks_per_step_are_bounded_by_units(pool2):
    first, second = pool2.run(count_job, 3, 3, timeout=JOB_TIMEOUT)
    assert first["counts"] == second["counts"]  # every collective is paired across the ranks
    units = first["units"]
    recording, *traced = first["counts"]
    # The first pass records the order and fetches on demand: one check per gather.
    assert recording[0] <= 2 * (2 * units) + 4, (recording, first)
    for fetching, total in traced:
        # Then one gather per unit in the forward and at most one in the backward, and a few use
        # checks: not one collective per parameter (x ranks on gloo) plus one per use, as before
        # units.
        assert fetching <= 2 * units + 4, (fetching, first)
        # Gradients too: one reduction per unit (a run of its parameters), not per parameter;
        # the rest is the step's norm all-reduce and the use checks.
        assert total <= 3 * units + 8, (total, first)
        assert first["params"] > units  # else the bound above would not tell units from params
    # The first replay checks its uses and records its gathers; from the next replay on the
    # check rides on the gathers (pass_agreement.py): one check per pass, at its end.
    assert first["checks"][1] > 1 and first["checks"][2:] == [1], first["checks"]


def test_a_small_encoder_layer_is_one_unit(pool2):
    """Width 64: a layer's attention alone (16,640 elements) passes the default
    stage3_unit_min_numel (16,384), but the whole layer (33,472) fits in the merge cap (4x), so
    the layer is one unit whole, as FSDP2 wraps it (it was two: its attention and the rest), and
    the head joins the root. The two layers, repeated blocks below 16 x 16,384 elements together,
    share one unit (``unit_tree.py``)."""
    first, second = pool2.run(count_job, 2, 2, 64, 128, timeout=JOB_TIMEOUT)
    assert first["counts"] == second["counts"]
    assert first["names"] == ["<root>", "0.layers.0..0.layers.1"], first
    for fetching, total in first["counts"][1:]:
        assert fetching <= 2 * first["units"] + 4, (fetching, first)
        assert total <= 3 * first["units"] + 8, (total, first)
