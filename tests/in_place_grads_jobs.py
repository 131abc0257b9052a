"""Jobs for tests/test_in_place_grads.py: ZeRO 0 with two replicas, gradients accumulated in the
flat buffers and all-reduced there (runtime/zero/in_place_grads.py), beside the reducer's path and
torch's own training on the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _TwoHeads(nn.Module):
    """A side head that some micro-steps leave unused (its gradient hooks do not fire)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.side = nn.Linear(6, 3)

    def forward(self, x, use_side: bool):
        out = self.body(x)
        return out + self.side(x) if use_side else out


def _engine(model, bucket_elements: int):
    import deepspeed_cpp as deepspeed

    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 3,
            "gradient_clipping": 0.0,  # torch's reference does not clip
            "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket_elements},
        },
    )
    return engine


def replicas_equal_reducer_and_torch(seed: int, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    in_place_model, reducer_model, reference = _TwoHeads(), _TwoHeads(), _TwoHeads()
    reducer_model.load_state_dict(in_place_model.state_dict())
    reference.load_state_dict(in_place_model.state_dict())
    # Buckets of ~40 elements: several per model, launched during the boundary backward.
    in_place = _engine(in_place_model, 40)
    reducer = _engine(reducer_model, 40)
    uses_in_place = in_place.optimizer._in_place_grads is not None
    reducer.optimizer._in_place_grads = None  # the reducer's path, for the comparison
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    flats = in_place.optimizer.shard_grads
    views_in_flat = []
    for step in range(steps):
        for micro in range(3):
            xs, ys = torch.randn(world, 2, 6), torch.randn(world, 2, 3)  # same on every rank
            uses = [(r + micro + step) % 2 == 0 for r in range(world)]
            for engine, model in ((in_place, in_place_model), (reducer, reducer_model)):
                loss = nn.functional.mse_loss(model(xs[rank], uses[rank]), ys[rank])
                engine.backward(loss)
                if micro == 1 and step == 1:
                    model.body[0].weight.grad = None  # user code clears one: honoured by both
            for r in range(world):
                loss = nn.functional.mse_loss(reference(xs[r], uses[r]), ys[r])
                (loss * (1.0 / (3 * world))).backward()
            if micro == 1 and step == 1:
                reference.body[0].weight.grad = None
            pointer = in_place_model.body[2].weight.grad.data_ptr()
            views_in_flat.append(
                any(f.data_ptr() <= pointer < f.data_ptr() + f.numel() * 4 for f in flats)
            )
            in_place.step()
            reducer.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    pairs = list(zip(in_place_model.parameters(), reducer_model.parameters()))
    worst = max(
        (mine - theirs).abs().max().item()
        for mine, theirs in zip(in_place_model.parameters(), reference.parameters())
    )
    result = {
        "uses_in_place": uses_in_place,
        "buckets": len(in_place.optimizer.buckets),
        "describe": in_place.optimizer.describe(),
        "bitwise_vs_reducer": all(torch.equal(a, b) for a, b in pairs),
        "worst_vs_torch": worst,
        "views_in_flat": all(views_in_flat),
    }
    in_place.destroy()
    reducer.destroy()
    return result


class _SharedInTwoCheckpoints(nn.Module):
    """One layer applied twice, each use in a reentrant checkpoint: its gradient is accumulated
    twice in one backward, the second time after the layer in front of it is done."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.shared = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = checkpoint(lambda t: torch.tanh(self.shared(t)), h, use_reentrant=True)
        return self.out(h)


def shared_layer_in_reentrant_checkpoints(seed: int, bucket_elements: int) -> dict:
    """Two replicas train a layer used twice in one backward: with one bucket the all-reduce
    waits for every gradient (each parameter counted once) and training equals torch's on the
    global batch; with a bucket per parameter, the shared one's all-reduce begins before its
    second accumulation, which is refused with the parameter named (was: silently partial)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model, reference = _SharedInTwoCheckpoints(), _SharedInTwoCheckpoints()
    reference.load_state_dict(model.state_dict())
    engine = _engine(model, bucket_elements)
    in_place = engine.optimizer._in_place_grads is not None
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    try:
        for _ in range(2):
            for _ in range(3):
                xs, ys = torch.randn(world, 2, 6), torch.randn(world, 2, 3)  # same on every rank
                engine.backward(nn.functional.mse_loss(model(xs[rank]), ys[rank]))
                engine.step()
                for r in range(world):
                    loss = nn.functional.mse_loss(reference(xs[r]), ys[r])
                    (loss * (1.0 / (3 * world))).backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
    except RuntimeError as error:
        result = {"in_place": in_place, "buckets": len(engine.optimizer.buckets)}
        engine.destroy()
        return {**result, "error": str(error)}
    worst = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters())
    )
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    result = {"in_place": in_place, "buckets": len(engine.optimizer.buckets), "worst": worst,
              "replicas_equal": all(torch.equal(g, gathered[0]) for g in gathered)}  # fmt: skip
    engine.destroy()
    return result
