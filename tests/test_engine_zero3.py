"""ZeRO stage 3 through the engine on real gloo groups of 2 and 3 processes, against one process
training on the same global batch with torch.optim.AdamW (tests/zero3_helpers.py): tied, frozen,
unused parameters, an execution order that changes between steps, partitioned and persistent
parameters, gradient accumulation and clipping; the fetch schedule's prefetch and re-recording;
manual accumulation boundaries."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import zero3_helpers as h


def train_job(config: dict, seed: int, steps: int, flip_every: bool, rare_at):
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.zero import partition_parameters as pp

    model = h.make_model(seed + dist.get_rank())  # initialize takes rank 0's values
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    params = h.train(engine, seed, steps, flip_every=flip_every, rare_at=rare_at)
    persistent = sorted(n for n, p in engine.module.named_parameters() if not pp.is_partitioned(p))
    return {"params": params, "persistent": persistent, "grad_norm": engine.get_global_grad_norm()}


def _seed() -> int:
    return int(torch.randint(0, 2**30, (1,)))


# dtype, accumulation, clipping and persistence threshold 0 (everything partitioned, even
# 23-element biases) or 50 (biases stay whole): every pair of values of any two of them (a
# covering array of 5 rows, not the 8 of the dtype x accumulation x clipping grid).
CASES = [
    ("fp32", 1, 0.0, 0),
    ("fp32", 3, 0.5, 50),
    ("bf16", 1, 0.5, 50),
    ("bf16", 3, 0.0, 50),
    ("bf16", 3, 0.5, 0),
]
assert all(
    {(a[i], a[j]) for a in CASES}
    == {(x, y) for x in {r[i] for r in CASES} for y in {r[j] for r in CASES}}
    for i, j in itertools.combinations(range(4), 2)
)


@pytest.mark.parametrize("dtype, gas, clip, threshold", CASES)
def test_matches_single_process_adamw_2_ranks(pool2, dtype, gas, clip, threshold):
    seed, steps = _seed(), 4
    # eps 1e-5 as with 3 ranks: at 1e-6 one fresh seed gave 1.09e-6 (fp32, gas 1, clip 0.5): the
    # rare layer's gradient nearly cancels, and Adam's m / sqrt(v) enlarges any rounding
    # difference from the reference (then torch.optim.AdamW's) past the tolerance.
    eps = 1e-5
    config = h.config(dtype, gas, clip, threshold)
    config["optimizer"]["params"]["eps"] = eps
    # The order flips every micro-step and "rare" runs in one micro-step only.
    results = pool2.run(train_job, config, seed, steps, True, 2)
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    reference = h.reference(
        seed, steps, gas, 2, clip, torch_dtype, flip_every=True, rare_at=2, eps=eps
    )
    ours = results[0]["params"]
    assert ours.keys() == h.named_state(reference).keys()
    for other in results[1:]:
        for name, tensor in other["params"].items():
            assert torch.equal(tensor, ours[name]), f"ranks disagree on {name}"
    worst = h.max_relative_difference(ours, h.named_state(reference))
    # fp32: DS_TEST_SEED=1715069634 gave 2.02e-6 ([fp32-1-0.0-0]) while the reference stepped
    # with torch.optim.AdamW, whose float32 rounding differs from the kernels' (the gradients
    # were bitwise equal); with the kernels' rounding (h.reference) 0.0, as for 4 fresh seeds.
    assert worst <= h.tolerance(dtype), f"seed {seed}: {worst}"
    small = [n for n, p in h.make_model(0).named_parameters() if p.numel() <= threshold]
    assert results[0]["persistent"] == sorted(small)
    assert len(small) == (0 if threshold == 0 else 7)  # 6 biases and eval_head's 46 weights


@pytest.mark.parametrize("gas, threshold", [(1, 0), (2, 50)])
def test_matches_single_process_adamw_3_ranks(pool3, gas, threshold):
    seed, steps = _seed(), 4
    # gloo's ring sums three ranks in an order of its own; a larger eps keeps Adam from
    # amplifying that float32 rounding (see test_engine_zero._reference) beyond the tolerance
    # (1e-5 let test_engine_zero's 3-rank case reach 1.37e-6 once; 1e-4 there too).
    eps = 1e-4
    config = h.config("fp32", gas, 0.5, threshold)
    config["optimizer"]["params"]["eps"] = eps
    results = pool3.run(train_job, config, seed, steps, True, 1)
    reference = h.reference(seed, steps, gas, 3, 0.5, flip_every=True, rare_at=1, eps=eps)
    for result in results:
        assert h.max_relative_difference(result["params"], h.named_state(reference)) <= 1e-6


def schedule_job(config: dict, seed: int, steps: int, rare_at: int):
    """Trains with a stable order except one step that also runs "rare"; records what the fetch
    schedule did after every step and whether any gather was still in flight when a module
    started (only a prefetch is: an on-demand gather is waited for at once)."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.zero import partition_parameters as pp

    model = h.make_model(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    schedule = engine._zero_stage.coordinator.schedule
    partitioned = [p for p in model.parameters() if pp.is_partitioned(p)]
    in_flight = [0]

    def count_in_flight(module, inputs):
        in_flight[0] += sum(p.ds_status == pp.ZeroParamStatus.INFLIGHT for p in partitioned)

    for module in model.modules():  # after the engine's hooks: its gathers were launched
        module.register_forward_pre_hook(count_in_flight)
    after = []

    def record(engine, step):
        after.append(
            {"recording": schedule.recording(), "trace": len(schedule.trace()),
             "divergences": schedule.divergences(), "in_flight": in_flight[0]}
        )  # fmt: skip
        in_flight[0] = 0

    params = h.train(engine, seed, steps, rare_at=rare_at, between=record)
    return {"params": params, "after": after}


def test_schedule_prefetches_and_records_again_when_the_order_changes(pool2):
    seed, steps, rare_at = _seed(), 6, 3
    # eps 1e-3: the rare layer gets one gradient (step 3), and Adam then keeps stepping it on
    # m/sqrt(v) of that one gradient: where it nearly cancels (~1e-8), eps 1e-6 turned float32
    # rounding into updates of either sign, 1.7e-3 apart (DS_TEST_SEED=3131279757, on the commit
    # before the units too), and eps 1e-4 still 6.1e-6 (DS_TEST_SEED=3263446975, the same on the
    # commit before and after this session's changes). This test is about the schedule; the
    # equality tests cover eps.
    eps = 1e-3
    config = h.config("fp32", 1, 0.0, 0)
    config["optimizer"]["params"]["eps"] = eps
    config["zero_optimization"]["stage3_unit_min_numel"] = 0  # a unit per module to prefetch
    results = pool2.run(schedule_job, config, seed, steps, rare_at)
    reference = h.reference(seed, steps, 1, 2, 0.0, rare_at=rare_at, eps=eps)
    after = results[0]["after"]
    assert [r["after"] for r in results[1:]] == [after]  # same decisions on every rank
    # Step 0 recorded (on demand: nothing in flight when a module starts) ...
    assert not after[0]["recording"] and after[0]["trace"] > 0 and after[0]["in_flight"] == 0
    # ... steps 1-2 replayed with prefetch, without diverging.
    for step in (1, 2):
        assert after[step]["in_flight"] > 0 and after[step]["divergences"] == 0
    # Step 3 also ran "rare": it diverged and dropped the trace; step 4 recorded the usual order
    # again, which step 5 replays with prefetch.
    assert after[rare_at]["divergences"] == 1 and after[rare_at]["recording"]
    assert after[4]["divergences"] == 1 and not after[4]["recording"]
    assert after[5]["divergences"] == 1 and after[5]["in_flight"] > 0
    assert h.max_relative_difference(results[0]["params"], h.named_state(reference)) <= 1e-6


def boundary_job(config: dict, seed: int, steps: int, manual: bool):
    import deepspeed_cpp as deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, _, _, _ = deepspeed.initialize(model=h.make_model(seed), config=config)
    gas = engine.gradient_accumulation_steps()
    for micro_batches in h.global_batches(seed, steps, gas, world):
        for index, (x, y) in enumerate(micro_batches):
            if manual:
                engine.set_gradient_accumulation_boundary(index == gas - 1)
            loss = h.loss_of(engine(h.rank_slice(x, rank)), h.rank_slice(y, rank))
            engine.backward(loss)
            engine.step()
    return {"params": h.full_params(engine), "global_steps": engine.global_steps}


def test_manual_accumulation_boundaries_equal_automatic_ones(pool2):
    seed, steps = _seed(), 3
    config = h.config("fp32", 2, 0.5, 0)
    automatic = pool2.run(boundary_job, config, seed, steps, False)
    manual = pool2.run(boundary_job, config, seed, steps, True)
    for auto_rank, manual_rank in zip(automatic, manual):
        assert manual_rank["global_steps"] == auto_rank["global_steps"] == steps
        for name, tensor in auto_rank["params"].items():
            assert torch.equal(manual_rank["params"][name], tensor), name
    reference = h.reference(seed, steps, 2, 2, 0.5)
    assert h.max_relative_difference(manual[0]["params"], h.named_state(reference)) <= 1e-6


def fp16_job(stage: int, seed: int, steps: int, overflow_step: int):
    """fp16 with dynamic loss scaling; the last rank's gradient overflows at ``overflow_step``."""
    import deepspeed_cpp as deepspeed

    config = h.config("fp32", 1, 0.5, 50)
    config["zero_optimization"]["stage"] = stage
    config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    model = h.make_model(seed)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    history, overflows = [], []
    for step, micro_batches in enumerate(h.global_batches(seed, steps, 1, world)):
        x, y = micro_batches[0]
        handle = None
        if step == overflow_step and rank == world - 1:
            handle = engine.module.left.weight.register_hook(lambda g: g * float("inf"))
        loss = h.loss_of(engine(h.rank_slice(x, rank)), h.rank_slice(y, rank).half())
        engine.backward(loss)
        engine.step()
        if handle is not None:
            handle.remove()
        history.append((engine.get_loss_scale(), h.full_params(engine)))
        overflows.append(engine.optimizer.overflow)
    return {"history": history, "skipped": engine.skipped_steps, "overflows": overflows}


def test_fp16_at_stage3_equals_stage2_and_skips_the_overflowing_step(pool2):
    seed, steps, overflow_step = _seed(), 5, 2
    zero2 = pool2.run(fp16_job, 2, seed, steps, overflow_step)
    zero3 = pool2.run(fp16_job, 3, seed, steps, overflow_step)
    for two, three in zip(zero2, zero3):
        assert three["skipped"] == two["skipped"] == 1
        expected_overflows = [step == overflow_step for step in range(steps)]
        assert three["overflows"] == two["overflows"] == expected_overflows
        scales = [scale for scale, _ in three["history"]]
        assert scales == [scale for scale, _ in two["history"]]
        assert scales[overflow_step] == scales[overflow_step - 1] / 2
        before, during = three["history"][overflow_step - 1][1], three["history"][overflow_step][1]
        assert all(torch.equal(before[n], during[n]) for n in before), "changed on overflow"
        final2, final3 = two["history"][-1][1], three["history"][-1][1]
        assert all(t.dtype == torch.float16 for t in final3.values())
        # Same fp32 masters and updates; the fp16 copies agree to within one fp16 rounding.
        assert h.max_relative_difference(final3, final2) <= 2**-10
        initial = {n: p.detach().half() for n, p in h.make_model(seed).named_parameters()}
        assert any(not torch.equal(final3[n], initial[n]) for n in final3), "nothing trained"
