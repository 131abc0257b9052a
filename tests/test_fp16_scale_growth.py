"""fp16 dynamic loss scaling at the steps where the scale grows, ZeRO stages 0-3 on 2 gloo ranks.

A step's gradients were computed with the scale in force during its backward pass, so they are
divided by that scale, also on the step after which the scale doubles. DeepSpeed 0.19.8 doubles
the scale first and then divides by the new one (``stage_1_and_2.py``/``stage3.py`` ``step()``:
``_update_scale`` before ``unscale_and_clip_grads``), which halves those steps' gradients; we do
not copy that (README, "Known differences from DeepSpeed"). Plain SGD makes the difference a
factor of two in the update, so the test tells the two rules apart, and it checks that it does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from fp16_scale_growth_case import (
    MICRO,
    STAGES,
    make_batches,
    make_config,
    make_model,
    reference_run,
)


def scale_growth_job(seed: int) -> dict:
    """Every rank: one engine per stage, STEPS steps; the fp16 weights (gathered at stage 3)
    and the loss scale after every step."""
    import deepspeed_cpp as deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for stage in STAGES:
        model = make_model(seed)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=make_config(stage)
        )
        scales, weights = [], []
        for x, y in make_batches(seed, world):
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            loss = torch.nn.functional.mse_loss(engine(x[rows].half()).float(), y[rows])
            engine.backward(loss)
            engine.step()
            scales.append(engine.get_loss_scale())
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
                weights.append([p.detach().double().clone() for p in params])
        report[stage] = {"scales": scales, "weights": weights}
    return report


def test_steps_where_the_scale_grows_are_unscaled_by_the_scale_of_their_backward(pool2):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    results = pool2.run(scale_growth_job, seed)
    scales, expected = reference_run(seed, 2, divide_by_new_scale=False)
    _, deepspeed_order = reference_run(seed, 2, divide_by_new_scale=True)
    assert scales == [16.0, 16.0, 32.0, 32.0, 64.0]  # grows on steps 2 and 4
    for stage in STAGES:
        ours, other_rank = results[0][stage], results[1][stage]
        assert ours["scales"] == scales, stage
        for step, (got, want, quirk) in enumerate(zip(ours["weights"], expected, deepspeed_order)):
            for param, twin in zip(got, other_rank["weights"][step]):
                assert torch.equal(param, twin), (stage, step)  # the ranks agree
            gap_to_quirk = 0.0
            for param, reference, other in zip(got, want, quirk):
                # fp32 masters against float64, seen through fp16: within 2 fp16 ulps.
                tolerance = 2 * 2.0**-10 * reference.abs().clamp(min=2.0**-4)
                assert ((param - reference).abs() <= tolerance).all(), (stage, step, param)
                gap_to_quirk = max(gap_to_quirk, (param - other).abs().max().item())
            if step >= 2:  # from the first growth on, the two orders are far apart
                assert gap_to_quirk > 1e-2, (stage, step, gap_to_quirk)
