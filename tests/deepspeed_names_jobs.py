"""Two-rank jobs of tests/test_deepspeed_names.py (DeepSpeed's helpers whose behaviour depends on
other ranks), run on every rank of its gloo pool (tests/dist_pool.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def no_drop_capacity_is_the_group_maximum(seed: int) -> list:
    """Each gating function with drop_tokens=False over a two-rank ep_group: the capacity of
    every rank is the busiest expert's count over both ranks (rank 1 has 5x the tokens)."""
    from deepspeed_cpp.moe.sharded_moe import top1gating, top2gating, topkgating

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    generator = torch.Generator().manual_seed(seed + rank)
    logits = torch.randn(6 * (1 + 4 * rank), 4, generator=generator, dtype=torch.float64)
    results = []
    for name, call in (
        (
            "top1",
            lambda: top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False, ep_group=group),
        ),
        (
            "top2",
            lambda: top2gating(
                logits, 1.0, 0, drop_tokens=False, ep_group=group, top2_2nd_expert_sampling=False
            ),
        ),
        ("top3", lambda: topkgating(logits, 3, 1.0, 0, drop_tokens=False, ep_group=group)),
    ):
        _, combine, _, exp_counts = call()
        local = int(exp_counts.max())
        everyone = torch.tensor([local])
        dist.all_reduce(everyone, op=dist.ReduceOp.MAX)
        routes = int(combine.bool().sum())
        results.append((name, combine.shape[-1], local, int(everyone), routes, logits.shape[0]))
    return results


def grad_norm_helpers(seed: int) -> dict:
    """deepspeed.runtime.utils' clip_grad_norm_ and CheckOverflow with an expert (MoE) parameter
    whose gradient differs between the ranks."""
    from deepspeed_cpp.runtime import utils as ds_utils
    from deepspeed_cpp.utils import groups

    rank = dist.get_rank()
    groups._create_expert_and_data_parallel(2)
    generator = torch.Generator().manual_seed(seed)
    shared_grad = torch.randn(5, generator=generator)
    expert_grads = [torch.randn(3, generator=generator) * 3 for _ in range(2)]
    shared, expert = torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))
    expert.allreduce = False  # how DeepSpeed (and deepspeed_cpp) mark expert parameters
    shared.grad, expert.grad = shared_grad.clone(), expert_grads[rank].clone()
    norm = ds_utils.clip_grad_norm_([shared, expert], max_norm=0.5)
    result = {"norm": norm, "shared": shared.grad.clone(), "expert": expert.grad.clone()}
    if rank == 1:
        expert.grad[1] = float("inf")
    result["overflow"] = ds_utils.CheckOverflow([[shared, expert]]).check()
    norm_of_grads = ds_utils.get_weight_norm([shared.grad, expert.grad])
    checker = ds_utils.CheckOverflow([[shared, expert]])
    result["overflow_by_norm"] = checker.check_using_norm([norm_of_grads], reduce_overflow=False)
    return result


def unwrap_for_generation(seed: int) -> dict:
    """A ZeRO-3 engine inside unwrap_model_for_generation: every parameter whole, forwards
    (twice, as generate() does) equal the unpartitioned model's, shards again afterwards."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.zero import unwrap_model_for_generation

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    # Threshold 0: no parameter is kept whole (persistent) for being small.
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + 1))
    offload = engine.optimizer.parameter_offload  # DeepSpeed's (and trl's) way to the hooks
    hooks_before = len(offload.forward_hooks)
    with torch.no_grad():
        engine(x)  # an evaluation forward: its pass is still open when the block starts
    with unwrap_model_for_generation(engine) as unwrapped:
        hooks_inside = len(offload.forward_hooks) + len(offload.backward_hooks)
        whole = [p.detach().clone() for p in unwrapped.module.parameters()]
        outputs = [unwrapped(x).detach(), unwrapped(x).detach()]
    after = [p.ds_status.name for p in engine.module.parameters()]
    hooks_after = len(offload.forward_hooks)
    for _ in range(2):  # training goes on with the hooks back (same data on every rank)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        trained = [p.detach().clone() for p in engine.module.parameters()]
    clipping = engine.gradient_clipping()  # DeepSpeed's accessor; the config sets none
    return {"whole": whole, "reference": reference, "outputs": outputs, "after": after,
            "clipping": clipping, "hooks": (hooks_before, hooks_inside, hooks_after),
            "trained": trained}  # fmt: skip
