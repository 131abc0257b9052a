"""ZeRO-3 gathers are collectives: ranks that run different modules must fail clearly on every
rank, never hang or pair one rank's parameter with another's (2 real gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# A hang would show as the pool's timeout; a correct run takes well under a second per job.
JOB_TIMEOUT = 120.0


class BranchNet(torch.nn.Module):
    """``mode`` picks which modules run, per rank: 'same' (a then c), 'different' (rank 0 runs
    a, rank 1 runs b, at the same point), 'extra' (rank 1 also runs d at the end)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 3)
        self.d = torch.nn.Linear(3, 3)

    def forward(self, x):
        rank = dist.get_rank()
        h = self.b(x) if self.mode == "different" and rank == 1 else self.a(x)
        out = self.c(torch.tanh(h))
        if self.mode == "extra" and rank == 1:
            out = self.d(out)
        return out


def branch_job(mode: str, steps: int):
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        # A unit per module: merged into the root's unit, the branches would gather alike.
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_unit_min_numel": 0,
        },
    }
    engine, *_ = deepspeed.initialize(model=BranchNet(mode), config=config)
    try:
        for _ in range(steps):
            loss = engine(torch.randn(2, 8)).square().mean()
            engine.backward(loss)
            engine.step()
        return "trained"
    except RuntimeError as error:
        return str(error)
    finally:
        engine.destroy()


def test_same_modules_train(pool2):
    assert pool2.run(branch_job, "same", 3, timeout=JOB_TIMEOUT) == ["trained", "trained"]


def test_different_branches_raise_on_every_rank_naming_the_modules(pool2):
    messages = pool2.run(branch_job, "different", 2, timeout=JOB_TIMEOUT)
    for message in messages:
        assert "ranks ran different modules" in message, message
        assert "rank 0: 'a'" in message and "rank 1: 'b'" in message, message
    # The pool (and its process group) is still usable: nothing was left half-way.
    assert pool2.run(branch_job, "same", 1, timeout=JOB_TIMEOUT) == ["trained", "trained"]


def test_a_module_run_on_one_rank_only_raises_on_every_rank(pool2):
    # Rank 1 runs d after c; rank 0's next use is c's backward: the uses disagree there.
    messages = pool2.run(branch_job, "extra", 2, timeout=JOB_TIMEOUT)
    for message in messages:
        assert "ranks ran different modules" in message, message
        assert "rank 1: 'd'" in message, message
    assert pool2.run(branch_job, "same", 1, timeout=JOB_TIMEOUT) == ["trained", "trained"]


class OrderNet(torch.nn.Module):
    """Runs ``a`` then ``b`` (two modules of one size: their gathers pair without a size
    mismatch), or ``b`` then ``a`` from forward number ``swap_from`` on the ranks in
    ``swapping``; rank 1 also runs ``d`` at the end from then on if ``extra``."""

    def __init__(self, swap_from: int, swapping: tuple[int, ...], extra: bool = False):
        super().__init__()
        self.swap_from, self.swapping, self.extra = swap_from, swapping, extra
        self.calls = 0
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 3)
        self.d = torch.nn.Linear(3, 3)

    def forward(self, x):
        late = self.calls >= self.swap_from
        self.calls += 1
        rank = dist.get_rank()
        if late and rank in self.swapping:
            h = self.a(torch.tanh(self.b(x)))
        else:
            h = self.b(torch.tanh(self.a(x)))
        out = self.c(torch.tanh(h))
        if late and self.extra and rank == 1:
            out = self.d(out)
        return out


def order_job(swap_from: int, swapping: tuple[int, ...], extra: bool, steps: int):
    """Trains ``steps`` steps of ``OrderNet`` with ZeRO-3 on the same batches on every rank;
    returns ("trained", largest difference from torch's AdamW on one process) or
    (the error text, the number of steps completed before it)."""
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    model = OrderNet(swap_from, swapping, extra)
    reference = OrderNet(swap_from, (0, 1) if swapping else (), False)
    reference.load_state_dict(model.state_dict())
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_unit_min_numel": 0,  # a unit per module, so a and b gather apart
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01)
    generator = torch.Generator().manual_seed(torch.initial_seed())
    completed = 0  # steps
    try:
        for _ in range(steps):
            x = torch.randn(2, 8, generator=generator)  # the same on every rank
            engine.backward(engine(x).square().mean())
            engine.step()
            optimizer.zero_grad()
            reference(x).square().mean().backward()
            optimizer.step()
            completed += 1
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            ours = {name: p.detach().clone() for name, p in model.named_parameters()}
        # d never runs here: torch's AdamW skips it, ours decays it (a zero gradient).
        difference = max(
            (ours[name] - p).abs().max().item()
            for name, p in reference.named_parameters()
            if not name.startswith("d.")
        )
        return "trained", difference
    except RuntimeError as error:
        return str(error), completed
    finally:
        engine.destroy()


def test_a_module_order_change_on_one_rank_in_a_replayed_pass_raises_on_every_rank(pool2):
    # Steps 0-2 record the trace, check its first replay and fold the checks of the next
    # into the gathers; from forward 4 rank 1 runs b before a. The folded check (the only
    # one naming the use) catches it in that pass, on both ranks.
    results = pool2.run(order_job, 4, (1,), False, 6, timeout=JOB_TIMEOUT)
    for message, step in results:
        assert "ranks ran different modules" in message, message
        assert "of the pass)" in message, message
        assert "rank 1: 'b'" in message, message
        assert step == 4, (step, message)
    # A module run on one rank only after the last planned gather: the end-of-pass check.
    results = pool2.run(order_job, 4, (), True, 6, timeout=JOB_TIMEOUT)
    for message, step in results:
        assert "ranks ran different modules" in message and "rank 1: 'd'" in message, message
        assert step == 4, (step, message)
    assert pool2.run(branch_job, "same", 1, timeout=JOB_TIMEOUT) == ["trained", "trained"]


def test_an_order_change_on_every_rank_in_a_replayed_pass_trains_as_one_process(pool2):
    # Every rank swaps a and b at forward 4: the ranks agree on leaving the plan, the pass
    # goes on checked and training matches torch's AdamW on one process.
    for result, difference in pool2.run(order_job, 4, (0, 1), False, 7, timeout=JOB_TIMEOUT):
        assert result == "trained", result
        assert difference < 1e-6, difference
