"""One rank stops answering at several places; the others must name each collective they waited
in and that rank.

Run by test_collective_timeout.py as WORLD processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set). All keep one TCP store for the whole run and give every scenario a process group of its
own (under a prefix of that store, so the failure reports of one scenario are not seen by the
next). In a scenario the stalled rank stops at a chosen point (it waits until every other rank
is done) and then abandons the scenario; the others run the same code and record the error they
got. Unlike SIGSTOP (test_collective_timeout.py's launcher test) the stalled rank's gloo threads
still finish what was launched before the stall: the stall starts no new collective. Before the
stalled scenarios, one run without a stall loads every op, so that no scenario's collective
waits on a rank that is still compiling.

``python named_timeout_scenarios.py OUT TIMEOUT_S [STALLED_RANK [SCENARIO ...]]`` (stalled rank
1 and every scenario by default) writes ``OUT/errors.json`` on rank 0: scenario -> healthy rank
-> the error's type and text ("no error" when nothing was raised).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # checkpoint_training's model, config and data

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from checkpoint_training import (  # noqa: E402
    GLOBAL_BATCH,
    build_engine,
    config,
    global_batches,
    make_model,
    train,
)
from moe_parallel_jobs import HIDDEN, make_expert  # noqa: E402

from deepspeed_cpp.comm.collective_errors import set_configured_timeout  # noqa: E402


class _Abandoned(Exception):
    """Rank 1 leaves a scenario in which it played the stopped rank."""


class Scenario:
    def __init__(self, base: dist.Store, name: str, timeout_s: float, stalled_rank: int | None):
        self.base, self.name, self.rank = base, name, int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.stalled_rank = stalled_rank  # None: nobody stalls
        self.healthy = [r for r in range(self.world) if r != stalled_rank]
        self.timeout = timedelta(seconds=timeout_s)

    def __enter__(self):
        store = dist.PrefixStore(self.name, self.base)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world,
                                timeout=self.timeout)  # fmt: skip
        set_configured_timeout(self.timeout)
        return self

    def stall(self, when: bool = True) -> None:
        """On the stalled rank (when ``when``): answer nothing until every other rank has its
        error, then leave."""
        if self.rank == self.stalled_rank and when:
            done = [f"{self.name}/done/{r}" for r in self.healthy]
            self.base.wait(done, timedelta(seconds=120))
            raise _Abandoned

    def __exit__(self, kind, error, _traceback):
        if self.rank != self.stalled_rank:
            outcome = "no error" if error is None else f"{kind.__name__}: {error}"
            self.base.set(f"{self.name}/outcome/{self.rank}", outcome)
            self.base.set(f"{self.name}/done/{self.rank}", "1")
        self.base.set(f"{self.name}/left/{self.rank}", "1")
        left = [f"{self.name}/left/{r}" for r in range(self.world)]
        self.base.wait(left, timedelta(seconds=120))
        dist.destroy_process_group()
        # A stalled scenario ends in an error on every rank (recorded above); any other fails.
        stalled = self.stalled_rank is not None
        return error is None or (stalled and isinstance(error, (_Abandoned, RuntimeError)))


def moe_forward(stall) -> None:
    from deepspeed_cpp.moe.layer import MoE
    from deepspeed_cpp.utils import groups

    groups._reset_for_tests()
    torch.manual_seed(5)
    layer = MoE(HIDDEN, make_expert(), num_experts=4, ep_size=2, k=1, drop_tokens=True)
    stall()
    layer(torch.randn(2, 7, HIDDEN))[0].sum().backward()


def zero3_gather(stall) -> None:
    import deepspeed_cpp

    world = dist.get_world_size()
    settings = config(2, 3)
    if world != 2:  # checkpoint_training's global batch, without accumulation (3 rows at 4 ranks)
        settings.update(train_micro_batch_size_per_gpu=GLOBAL_BATCH // world,
                        gradient_accumulation_steps=1)  # fmt: skip
    # Every parameter partitioned (none kept whole below the persistence threshold).
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed_cpp.initialize(model=make_model(7), config=settings)
    train(engine, global_batches(3, 1))
    # In a forward, a silent rank is first missed by the unit check that precedes a fetch in a
    # checked pass, or by the fetch itself in a folded one (both named);
    # GatheredParameters gathers with no check, so its wait is the one that fails.
    stall()
    with deepspeed_cpp.zero.GatheredParameters(list(engine.module.parameters())):
        pass


def initialize(stall) -> None:
    stall()
    build_engine(7, 2, 2)


def pipeline_stage(stall) -> None:
    """2 pipeline stages; stage 1 stops in its forward of the second micro-batch of the second
    batch, after stage 0 sent it that micro-batch's activations (1F1B: stage 1 already sent the
    first micro-batch's gradients): stage 0 then waits to receive the second's from it."""
    from pipe_jobs import _config, layer_specs, loss_fn, make_batches

    import deepspeed_cpp
    from deepspeed_cpp.pipe import PipelineModule

    torch.manual_seed(3)
    pipe = PipelineModule(layer_specs(False), num_stages=2, loss_fn=loss_fn)
    engine, *_ = deepspeed_cpp.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1), config=_config(2, 1, 0, 0)
    )
    forwards = []

    def count_and_stall(*_) -> None:  # returns None: the forward's inputs stay as they are
        forwards.append(1)
        stall(len(forwards) == 4)

    pipe.register_forward_pre_hook(count_and_stall)
    for batch in make_batches(3, 2, 1, 2):
        engine.train_batch(iter(batch[0]))


SCENARIOS = {
    "initialize": initialize,
    "zero3_gather": zero3_gather,
    "moe_all_to_all": moe_forward,
    "pipeline_stage": pipeline_stage,
}


def main(out: Path, timeout_s: float, stalled_rank: int, names: list[str]) -> None:
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=rank == 0, timeout=timedelta(seconds=300))  # fmt: skip
    with Scenario(base, "warm_up", 300, stalled_rank=None):  # loads the ops on every rank
        for name in names:
            SCENARIOS[name](lambda when=False: None)
    outcomes = {}
    for name in names:
        with Scenario(base, name, timeout_s, stalled_rank) as scenario:
            SCENARIOS[name](scenario.stall)
        outcomes[name] = {r: base.get(f"{name}/outcome/{r}").decode() for r in scenario.healthy}
    if rank == 0:
        (out / "errors.json").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    stalled = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    main(Path(sys.argv[1]), float(sys.argv[2]), stalled, sys.argv[4:] or list(SCENARIOS))
