"""Real DeepSpeed on the model and config of ``tests/test_fp16_scale_growth.py``
(``tests/fp16_scale_growth_case.py``), held against its two float64 references (numbers for
README's "Known differences", not CI):

    PYTHONPATH=/work/ds_target DS_ACCELERATOR=cpu python -m torch.distributed.run \
        --nproc_per_node 2 benchmarks/fp16_scale_growth_vs_deepspeed.py

Per ZeRO stage (1, 2) and step: the loss scale after the step and the largest difference of
DeepSpeed's fp16 weights from the reference that unscales a step's gradients by the scale its
backward pass used (what deepspeed_cpp does, and what the test holds it to) and from the one that
unscales by the scale after that step's update (the order of DeepSpeed 0.19.8's ``step()``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fp16_scale_growth_case as case  # noqa: E402

SEED = 1234


def main() -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    _, used_order = case.reference_run(SEED, world, divide_by_new_scale=False)
    _, grown_order = case.reference_run(SEED, world, divide_by_new_scale=True)
    for stage in (1, 2):
        model = case.make_model(SEED)
        # SGD is not among the optimizers DeepSpeed's ZeRO lists as tested: allowed explicitly.
        config = {**case.make_config(stage), "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        for step, (x, y) in enumerate(case.make_batches(SEED, world)):
            rows = slice(rank * case.MICRO, (rank + 1) * case.MICRO)
            loss = torch.nn.functional.mse_loss(engine(x[rows].half()).float(), y[rows])
            engine.backward(loss)
            engine.step()
            weights = [p.detach().double() for p in engine.module.parameters()]
            used = max((w - r).abs().max().item() for w, r in zip(weights, used_order[step]))
            grown = max((w - r).abs().max().item() for w, r in zip(weights, grown_order[step]))
            scale = float(engine.optimizer.loss_scale)
            if rank == 0:
                print(f"stage {stage} step {step} scale {scale:5.1f}: "
                      f"|DeepSpeed - unscaled by the scale used| {used:.2e}   "
                      f"|DeepSpeed - unscaled by the grown scale| {grown:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
