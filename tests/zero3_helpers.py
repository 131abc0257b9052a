"""The model, batches, configs and single-process reference shared by the ZeRO-3 engine tests
(test_engine_zero3.py, test_engine_zero3_api.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from kernel_order_adamw import KernelOrderAdamW, clip_as_the_engine

MICRO_BATCH = 4
VOCAB, HIDDEN = 23, 37
# As test_engine_zero.py: eps 1e-6 keeps Adam from amplifying float32 rounding beyond 1e-6.
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.05, (0.9, 0.99), 1e-6


class Zero3Net(torch.nn.Module):
    """Odd sizes; the output layer's weight is the embedding's (tied); a frozen layer, one never
    used, one used only when ``use_rare`` is set, one used only in evaluation, outside forward;
    ``flip`` swaps the order in which two layers run (set the same on every rank: ZeRO-3's
    gathers follow the order modules run in)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.left = torch.nn.Linear(HIDDEN, HIDDEN)
        self.right = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(HIDDEN, 3)
        self.rare = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.head.weight = self.embed.weight
        self.eval_head = torch.nn.Linear(VOCAB, 2)
        self.flip = False
        self.use_rare = False

    def forward(self, tokens):
        h = torch.tanh(self.embed(tokens))
        if self.flip:
            r = self.right(h)
            left = self.left(h)
        else:
            left = self.left(h)
            r = self.right(h)
        h = torch.tanh(left + r) + self.frozen(h)
        if self.use_rare:
            h = h + torch.tanh(self.rare(h))
        return self.head(h)


def make_model(seed: int) -> Zero3Net:
    torch.manual_seed(seed)
    model = Zero3Net()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)  # larger weights: gradients well above rounding noise
    return model


def global_batches(seed: int, steps: int, gas: int, world: int):
    generator = torch.Generator().manual_seed(seed + 1)
    size = MICRO_BATCH * world
    return [
        [(torch.randint(0, VOCAB, (size,), generator=generator),
          torch.randn(size, VOCAB, generator=generator))
         for _ in range(gas)]
        for _ in range(steps)
    ]  # fmt: skip


def rank_slice(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[rank * MICRO_BATCH : (rank + 1) * MICRO_BATCH]


def config(dtype: str = "fp32", gas: int = 1, clip: float = 0.0, threshold: int = 0, **zero):
    result = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 700,
            "stage3_param_persistence_threshold": threshold,
            **zero,
        },
    }
    if dtype == "bf16":
        result["bf16"] = {"enabled": True}
    return result


def set_micro_step(model: Zero3Net, micro: int, flip_every: bool, rare_at: int | None) -> None:
    """The per-micro-step switches, the same on every rank and in the reference."""
    model.flip = flip_every and micro % 2 == 1
    model.use_rare = micro == rare_at


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output.float(), target.float())


@contextlib.contextmanager
def one_thread():
    """As each worker: matmul results depend on how the work is split between threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference(seed, steps, gas, world, clip, dtype=torch.float32, *, flip_every=False,
              rare_at=None, eps=EPS, model=None, delayed_after=None):  # fmt: skip
    """One process, the same global batch, AdamW over fp32 masters rounding as the kernels do
    (tests/kernel_order_adamw.py); gradients are summed as ZeRO-2/3 sum them (over ranks per
    micro-step, then over micro-steps: the order matters at 1e-6, see
    test_engine_zero._reference) and unused parameters get zero gradients.

    ``delayed_after``: the delayed parameter update after that many ordinary steps: step t's
    update reaches the model only at step t+1, after step t+1's gradients were computed (and
    at the end, as reading the engine's parameters finishes the last one)."""
    with one_thread():
        model = (model if model is not None else make_model(seed)).to(dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        masters = [p.detach().float().clone().requires_grad_(True) for p in params]
        # AdamW rounding as the engine's kernels round (tests/kernel_order_adamw.py).
        optimizer = KernelOrderAdamW(
            masters, lr=LR, betas=BETAS, eps=eps, weight_decay=WEIGHT_DECAY
        )
        micro = 0

        def write_masters():
            with torch.no_grad():
                for p, master in zip(params, masters):
                    p.copy_(master)

        for step, micro_batches in enumerate(global_batches(seed, steps, gas, world), start=1):
            for master in masters:
                master.grad = torch.zeros_like(master)
            for x, y in micro_batches:
                set_micro_step(model, micro, flip_every, rare_at)
                micro += 1
                per_rank = []
                for rank in range(world):
                    model.zero_grad()
                    out = model(rank_slice(x, rank))
                    (loss_of(out, rank_slice(y, rank).to(dtype)) / gas).backward()
                    per_rank.append([p.grad for p in params])
                for i, master in enumerate(masters):
                    grads = [g[i].float() for g in per_rank if g[i] is not None]
                    if grads:
                        total = grads[0].clone()
                        for grad in grads[1:]:
                            total += grad
                        master.grad += total * (1.0 / world)
            delayed = delayed_after is not None and step > delayed_after
            if delayed and step > delayed_after + 1:
                write_masters()  # the previous step's update, applied now
            norm = clip_as_the_engine(masters, clip)
            model.last_grad_norm = float(norm)  # the engine's get_global_grad_norm()
            optimizer.step()
            if not delayed:
                write_masters()
        write_masters()
        return model


def named_state(model: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_relative_difference(ours: dict, reference: dict) -> float:
    """max |ours - reference| / max |reference| over all parameters (the issue's measure)."""
    difference = max((ours[n].float() - r.float()).abs().max().item() for n, r in reference.items())
    return difference / max(r.float().abs().max().item() for r in reference.values())


def tolerance(dtype: str) -> float:
    # bf16: parameters are their fp32 masters rounded; masters equal to ~1e-7 can still round to
    # neighbouring bf16 values, one unit in the last place: up to 2^-7 of the largest element.
    return 1e-6 if dtype == "fp32" else 2**-7


def train(engine, seed: int, steps: int, *, flip_every=False, rare_at=None, between=None):
    """Trains ``engine`` (wrapping a Zero3Net) on this rank's part of the global batches;
    ``between(engine, step)`` runs after every step. Returns the full parameters (gathered)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    dtype = engine.module.left.weight.dtype
    micro = 0
    for step, micro_batches in enumerate(global_batches(seed, steps, gas, world)):
        for x, y in micro_batches:
            set_micro_step(engine.module, micro, flip_every, rare_at)
            micro += 1
            loss = loss_of(engine(rank_slice(x, rank)), rank_slice(y, rank).to(dtype))
            engine.backward(loss)
            engine.step()
        if between is not None:
            between(engine, step)
    return full_params(engine)


def full_params(engine) -> dict:
    """Every trainable and frozen parameter, whole, under its model name (collective)."""
    state = engine.full_module_state_dict()
    return {n: state[n].clone() for n, _ in engine.module.named_parameters()}


def assert_same_shard_states(ours: list[dict], theirs: list[dict]) -> None:
    """Two engines' ``optimizer.shard_state()`` lists (master slice and per-element state per
    sub-group or bucket) are bitwise equal."""
    assert len(ours) == len(theirs)
    for mine, other in zip(ours, theirs):
        assert torch.equal(mine["master"], other["master"])
        assert mine["state"].keys() == other["state"].keys()
        for key, value in other["state"].items():
            assert torch.equal(mine["state"][key], value), key
