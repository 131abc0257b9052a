"""Jobs run on every rank of a 2-process gloo pool by tests/test_moe_expert_parallel.py."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 11


def make_expert():
    return nn.Sequential(nn.Linear(HIDDEN, 19), nn.GELU(), nn.Linear(19, HIDDEN))


def group_layout(ep_size: int, use_data_before_expert_parallel: bool) -> dict:
    from deepspeed_cpp.utils import groups

    groups._reset_for_tests()
    groups._create_expert_and_data_parallel(ep_size, use_data_before_expert_parallel)
    name = groups.expert_group_name(ep_size)
    return {
        "ep_ranks": groups.expert_parallel_ranks(name),
        "ep_world": groups._get_expert_parallel_world_size(name),
        "ep_rank": groups._get_expert_parallel_rank(name),
        "edp_ranks": dist.get_process_group_ranks(groups._get_expert_data_parallel_group(name)),
        "edp_world": groups._get_expert_data_parallel_world_size(name),
        "edp_rank": groups._get_expert_data_parallel_rank(name),
        "src": groups._get_expert_broadcast_src_rank(name),
        "max": groups._get_max_expert_size_name(),
    }


def bad_ep_size() -> str:
    from deepspeed_cpp.moe.layer import MoE

    try:
        MoE(HIDDEN, make_expert(), num_experts=4, ep_size=4)
    except ValueError as error:
        return str(error)
    return "no error"


def expert_parallel_matches_one_rank(k: int, drop_tokens: bool, use_residual: bool, seed: int):
    """MoE(ep_size=2) on this rank vs MoE(ep_size=1) holding all experts, run here on both ranks'
    batches: max abs differences of outputs, l_aux, exp_counts and gradients."""
    from deepspeed_cpp.moe.layer import MoE

    rank = dist.get_rank()
    kwargs = dict(num_experts=4, k=k, capacity_factor=0.8, min_capacity=2,
                  drop_tokens=drop_tokens, use_residual=use_residual)  # fmt: skip
    torch.manual_seed(seed)  # the same weights and batches on both ranks
    full = MoE(HIDDEN, make_expert(), ep_size=1, **kwargs)
    split = MoE(HIDDEN, make_expert(), ep_size=2, **kwargs)
    full_experts = full.deepspeed_moe.experts.deepspeed_experts
    split_experts = split.deepspeed_moe.experts.deepspeed_experts
    assert len(split_experts) == 2 and len(full_experts) == 4
    with torch.no_grad():
        # Rank r holds global experts 2r and 2r + 1.
        for name, param in split.named_parameters():
            if ".deepspeed_experts." not in name:
                param.copy_(dict(full.named_parameters())[name])
        for local, expert in enumerate(split_experts):
            expert.load_state_dict(full_experts[2 * rank + local].state_dict())
    batches = [torch.randn(3, 13, HIDDEN) for _ in range(2)]
    upstreams = [torch.randn(3, 13, HIDDEN) for _ in range(2)]

    def run(model, r):
        x = batches[r].clone().requires_grad_(True)
        torch.manual_seed(seed + 1 + r)  # the gate's draws (RTS priorities, Gumbel noise)
        out, l_aux, counts = model(x)
        ((out * upstreams[r]).sum() + 0.1 * l_aux).backward()
        return out.detach(), l_aux.detach(), counts, x.grad

    out, l_aux, counts, x_grad = run(split, rank)
    diffs = {}
    expert_grads = [None] * 4
    for r in range(2):
        full.zero_grad(set_to_none=True)
        ref_out, ref_l_aux, ref_counts, ref_x_grad = run(full, r)
        for e in range(4):
            grads = [p.grad.clone() for p in full_experts[e].parameters()]
            if expert_grads[e] is None:
                expert_grads[e] = grads
            else:
                expert_grads[e] = [a + b for a, b in zip(expert_grads[e], grads)]
        if r == rank:
            diffs["output"] = (out - ref_out).abs().max().item()
            diffs["l_aux"] = (l_aux - ref_l_aux).abs().item()
            diffs["counts_equal"] = bool(torch.equal(counts, ref_counts))
            diffs["input_grad"] = (x_grad - ref_x_grad).abs().max().item()
            shared = [n for n, _ in split.named_parameters() if ".deepspeed_experts." not in n]
            full_params = dict(full.named_parameters())
            split_params = dict(split.named_parameters())
            diffs["shared_grad"] = max(
                (split_params[n].grad - full_params[n].grad).abs().max().item() for n in shared
            )
            diffs["output_scale"] = out.abs().max().item()
    # An expert's gradient sums both ranks' tokens: in one matmul here, in two there; the
    # summation order differs, so the difference is relative to the gradient's size (>= 1).
    diffs["expert_grad"] = max(
        (p.grad - g).abs().max().item() / max(1.0, g.abs().max().item())
        for local, expert in enumerate(split_experts)
        for p, g in zip(expert.parameters(), expert_grads[2 * rank + local])
    )
    return diffs


class _MoENet(nn.Module):
    def __init__(self, ep_size: int):
        from deepspeed_cpp.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(7, HIDDEN)
        self.moe = MoE(HIDDEN, make_expert(), num_experts=2, ep_size=ep_size, k=2)
        self.out = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(hidden), l_aux


def _engine_config(stage: int) -> dict:
    return {
        "gradient_clipping": 0.0,
        "train_batch_size": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }


class _ExpertNet(nn.Module):
    """Dense layers around an MoE layer of 4 experts (top-1 or top-2)."""

    def __init__(self, ep_size: int, k: int):
        from deepspeed_cpp.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(7, HIDDEN)
        self.moe = MoE(HIDDEN, make_expert(), num_experts=4, ep_size=ep_size, k=k, min_capacity=2)
        self.out = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(hidden), l_aux


def _loss(model, step: int, r: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Rank r's loss at ``step``: its batch and the gate's draws depend on (seed, step, r) only."""
    generator = torch.Generator().manual_seed(seed * 1000 + step * 10 + r)
    x = torch.randn(6, 7, generator=generator).to(dtype)
    y = torch.randint(0, 3, (6,), generator=generator)
    torch.manual_seed(seed + 7 * step + r)  # RTS priorities
    logits, l_aux = model(x)
    return nn.functional.cross_entropy(logits, y) + 0.01 * l_aux


def engine_expert_parallel_matches_reference(
    stage: int, ep_size: int, k: int, clip: float, optimizer_kind: str, seed: int, gas: int = 1
) -> dict:
    """Engine training of ``_ExpertNet(ep_size)`` for 4 steps on this rank's batches vs a
    one-process model holding all 4 experts, trained with the same torch optimizer
    (``optimizer_kind``: "adamw" or "sgd" passed to initialize, or "config": the config's AdamW)
    on both ranks' batches:
    the loss is the mean of the two ranks' losses, so dense gradients are the average over the
    ranks and expert gradients the sum over the ranks that routed tokens to them divided by the
    world size (DeepSpeed's averaging), clipped by the global norm. Returns max abs differences
    of the dense and expert parameters after the steps, and the grad norms."""
    import deepspeed_cpp
    from deepspeed_cpp.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    reference = _ExpertNet(ep_size=1, k=k)
    model = _ExpertNet(ep_size=ep_size, k=k)
    local = 4 // ep_size
    ep_rank = rank % ep_size  # DeepSpeed's default layout: expert-parallel groups are consecutive
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".deepspeed_experts." in name:
                prefix, rest = name.split(".deepspeed_experts.")
                index, tail = rest.split(".", 1)
                name = f"{prefix}.deepspeed_experts.{ep_rank * local + int(index)}.{tail}"
            param.copy_(ref_params[name])
    initial = {name: param.detach().clone() for name, param in ref_params.items()}
    options = {"lr": 0.3, "weight_decay": 0.01}
    if optimizer_kind != "sgd":
        # Adam divides by sqrt(v): an element whose gradient is ~0 by cancellation carries
        # float-rounding differences (another summation order) of its own size, which eps=1e-8
        # would turn into lr-sized steps; eps=1e-4 keeps such elements' steps small.
        options = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4}
    # SGD sees any error in the gradients' scale; Adam normalises most of it away.
    make = (lambda g: torch.optim.SGD(g, momentum=0.9)) if optimizer_kind == "sgd" else (
        torch.optim.AdamW)  # fmt: skip

    def groups_of(net):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": list(net.parameters()), "name": "parameters", **options}
        )

    config = {
        "train_batch_size": 6 * world * gas,
        "train_micro_batch_size_per_gpu": 6,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
    }
    if optimizer_kind != "config":
        engine, *_ = deepspeed_cpp.initialize(
            model=model, optimizer=make(groups_of(model)), config=config
        )
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"torch_adam": True, **options}}
        engine, *_ = deepspeed_cpp.initialize(
            model=model, model_parameters=groups_of(model), config=config
        )
    optimizer = make(groups_of(reference))
    norms, ref_norms = [], []
    for step in range(4):
        for micro in range(gas):  # gas micro-steps, then the optimizer step
            engine.backward(_loss(engine, step * gas + micro, rank, seed))
            engine.step()
        norms.append(engine.get_global_grad_norm())
        optimizer.zero_grad()
        for micro in range(gas):
            total = sum(_loss(reference, step * gas + micro, r, seed) for r in range(world))
            (total / (world * gas)).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(
            reference.parameters(), clip if clip > 0 else float("inf"))))  # fmt: skip
        optimizer.step()
    diffs = {"dense": 0.0, "expert": 0.0, "norms": norms, "ref_norms": ref_norms}
    with torch.no_grad():
        for name, param in model.named_parameters():
            kind = "dense"
            if ".deepspeed_experts." in name:
                kind = "expert"
                prefix, rest = name.split(".deepspeed_experts.")
                index, tail = rest.split(".", 1)
                name = f"{prefix}.deepspeed_experts.{ep_rank * local + int(index)}.{tail}"
            diff = (param - ref_params[name]).abs().max().item()
            diffs[kind] = max(diffs[kind], diff)
        diffs["trained"] = max(
            (param - initial[name]).abs().max().item() for name, param in ref_params.items()
        )
    sets = getattr(engine.optimizer, "sets", None)  # the expert-parallel composite's sets
    if sets is not None:
        diffs["set_sizes"] = dict(zip(engine.optimizer.keys, [m.world_size for m in sets]))
    return diffs


def engine_trains_moe_with_ep_size_1(stage: int, seed: int) -> list[float]:
    """ep_size=1 experts through the engine with DeepSpeed's MoE parameter groups: a few steps;
    returns a digest of every parameter (equal on both ranks when gradients were averaged)."""
    import deepspeed_cpp
    from deepspeed_cpp.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(seed)
    model = _MoENet(ep_size=1)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    engine, *_ = deepspeed_cpp.initialize(model=model, model_parameters=groups,
                                          config=_engine_config(stage))  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(seed + 1 + dist.get_rank())  # different data (and gate draws) per rank
    for _ in range(3):
        x = torch.randn(4, 7)
        logits, l_aux = engine(x)
        loss = nn.functional.cross_entropy(logits, torch.randint(0, 3, (4,))) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
    moved = [not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters())]
    assert all(moved), moved
    return [float(p.detach().double().sum()) for p in model.parameters()]


def engine_offload_matches_in_memory(
    stage: int, clip: float, dtype: str, device: str, folder: str, optimizer_kind: str
) -> dict:
    """``_ExpertNet(ep_size=2)`` through the engine for 4 steps, in memory and with
    ``offload_optimizer`` (``device`` cpu or nvme, several sub-groups per set): every parameter
    after each run, the grad norms, and the offloaded engine's homes. ``optimizer_kind``:
    "config" (the config's Adam: cpu_adam, stepped one sub-group at a time) or "adamw"
    (torch.optim.AdamW passed to initialize: one step over every set's host masters)."""
    import deepspeed_cpp
    from deepspeed_cpp.moe.utils import split_params_into_different_moe_groups_for_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    options = {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4}
    seed, results = 5, []
    for offload in (None, device):
        torch.manual_seed(seed)  # the same start in both runs
        model = _ExpertNet(ep_size=2, k=2)
        groups_of = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters", **options}
        )
        config = {
            "train_batch_size": 6 * world,
            "train_micro_batch_size_per_gpu": 6,
            "gradient_clipping": clip,
            # torch's AdamW stepping the host masters (DeepSpeed's default refuses it).
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 200,
                "sub_group_size": 150,
            },  # fmt: skip
        }
        if dtype == "bf16":
            config["bf16"] = {"enabled": True}
        elif dtype == "fp16":  # the loss scaler's overflow check and unscaling over every set
            config["fp16"] = {"enabled": True, "initial_scale_power": 8}
        if offload == "cpu":
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        elif offload == "nvme":
            config["zero_optimization"]["offload_optimizer"] = {
                "device": "nvme", "nvme_path": folder, "buffer_count": 2, "pipeline_read": True,
            }  # fmt: skip
        if optimizer_kind == "config":
            config["optimizer"] = {"type": "Adam", "params": options}
            engine, *_ = deepspeed_cpp.initialize(
                model=model, model_parameters=groups_of, config=config
            )
        else:
            engine, *_ = deepspeed_cpp.initialize(
                model=model, optimizer=torch.optim.AdamW(groups_of), config=config
            )
        initial = [p.detach().float().clone() for p in model.parameters()]
        norms = []
        for step in range(4):
            engine.backward(_loss(engine, step, rank, seed, model.inp.weight.dtype))
            engine.step()
            norms.append(engine.get_global_grad_norm())
        run = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "norms": norms,
            "trained": max(
                (p.detach().float() - i).abs().max().item()
                for p, i in zip(model.parameters(), initial)
            ),
        }
        if offload is not None:
            run["homes"] = [(m.home.kind, len(m.home.sub_groups)) for m in engine.optimizer.sets]
            run["describe"] = engine.optimizer.describe()
        engine.destroy()
        results.append(run)
    dist.barrier()
    return {"in_memory": results[0], "offloaded": results[1],
            "left": [f for _, _, files in os.walk(folder) for f in files]}  # fmt: skip


def offload_refusals(folder: str) -> list[str]:
    """The errors of the offload settings that expert-parallel MoE refuses."""
    import deepspeed_cpp

    adam = {"lr": 1e-2}
    cases = [
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_param_update": True}}, adam),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, adam),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, adam),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, adam),
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": folder}},
         {**adam, "torch_adam": True}),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "step_during_backward": True}}, adam),
    ]  # fmt: skip
    messages = []
    for zero, params in cases:
        config = {"gradient_clipping": 0.0, "train_batch_size": 2 * dist.get_world_size(),
                  "optimizer": {"type": "Adam", "params": params},
                  "zero_optimization": zero}  # fmt: skip
        try:
            deepspeed_cpp.initialize(model=_ExpertNet(ep_size=2, k=1), config=config)
        except Exception as error:  # noqa: BLE001 - the message is what the test checks
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append("no error")
    return messages
