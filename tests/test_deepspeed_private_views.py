"""DeepSpeed's private names that scripts and monitoring callbacks read, as views of our state:
``engine._config`` (scripts size their DataLoader from ``_config.train_micro_batch_size_per_gpu``),
the stage-1/2 optimizer's ``bit16_groups`` / ``single_partition_of_fp32_groups`` and the stage-3
optimizer's ``fp16_groups`` / ``fp32_partitioned_groups_flat``. Checked on 2 gloo ranks against
the model and a float64 reference: the groups hold the model's own parameters, the fp32
partitions hold this rank's share of the real weights (their squares sum over the ranks to the
model's) and, after backward, of the reduced gradient (summing to the reference's squared norm).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MICRO, HIDDEN = 2, 6


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(2 * MICRO, HIDDEN, generator=generator), torch.randn(
        2 * MICRO, 1, generator=generator
    )


def _sum_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item())


def views_job(seed: int) -> dict:
    import deepspeed_cpp as deepspeed

    rank = dist.get_rank()
    x, y = _batch(seed)
    part = slice(rank * MICRO, (rank + 1) * MICRO)
    out = {}
    for stage in (2, 3):
        model = _net(seed)
        params = list(model.parameters())
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}]
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 20},
            "optimizer": {"type": "Adam", "params": {"lr": 0.1}},
        }
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=config
        )
        result = {
            "config": (
                engine._config is engine.config,
                engine._config.train_micro_batch_size_per_gpu,
                type(engine).gradient_clipping(engine),
            )
        }
        engine.backward(torch.nn.functional.mse_loss(engine(x[part]), y[part]))
        if stage == 2:
            result["bit16"] = [
                [p is q for p, q in zip(mine, group["params"])]
                + [len(mine) == len(group["params"])]
                for mine, group in zip(optimizer.bit16_groups, groups)
            ]
            shards = optimizer.single_partition_of_fp32_groups
        else:
            listed = [p for group in optimizer.fp16_groups for p in group]
            result["fp16"] = sorted(id(p) for p in listed) == sorted(id(p) for p in params)
            shards = optimizer.fp32_partitioned_groups_flat
            result["aligned"] = len(shards) == len(optimizer.fp16_groups)
        result["grad_sq"] = _sum_over_ranks(
            sum(s.grad.double().pow(2).sum().item() for s in shards)
        )
        engine.step()
        if stage == 3:  # DeepSpeed's tests' and callbacks' way to a sub-group's Adam state
            result["steps"] = [
                float(optimizer.optimizer.state[optimizer.fp32_partitioned_groups_flat[i]]["step"])
                for i, _ in enumerate(optimizer.fp16_groups)
            ]
        shard_sq = _sum_over_ranks(
            sum(s.double().pow(2).sum().item() for s in optimizer.single_partition_of_fp32_groups)
        )
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            model_sq = sum(p.double().pow(2).sum().item() for p in params)
        result["weights_sq"] = (shard_sq, model_sq)
        out[stage] = result
    return out


def test_deepspeed_private_names_view_the_engines_real_state(pool2):
    seed = int(torch.randint(0, 2**31, ()))
    results = pool2.run(views_job, seed)
    reference = _net(seed).double()
    x, y = _batch(seed)
    torch.nn.functional.mse_loss(reference(x.double()), y.double()).backward()
    grad_sq = sum(p.grad.pow(2).sum().item() for p in reference.parameters())
    for result in results:
        for stage in (2, 3):
            mine = result[stage]
            assert mine["config"] == (True, MICRO, 0.0)
            assert abs(mine["grad_sq"] - grad_sq) <= 1e-5 * grad_sq
            shard_sq, model_sq = mine["weights_sq"]
            assert abs(shard_sq - model_sq) <= 1e-6 * model_sq
        assert result[2]["bit16"] == [[True, True, True], [True, True, True]]
        assert result[3]["fp16"] and result[3]["aligned"]
        assert result[3]["steps"] and set(result[3]["steps"]) == {1.0}
