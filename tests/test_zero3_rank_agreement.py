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
