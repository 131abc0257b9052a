"""Rank 1 stops answering at several places; rank 0 must name each collective it waited in.

Run by test_collective_timeout.py as two processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
set). Both keep one TCP store for the whole run and give every scenario a process group of its
own (under a prefix of that store, so the failure reports of one scenario are not seen by the
next). In a scenario rank 1 stalls at a chosen point (it sleeps until rank 0 is done) and then
abandons the scenario; rank 0 runs the same code and records the error it got. Unlike SIGSTOP
(test_collective_timeout.py's launcher test) the stalled rank's gloo threads still finish what
was launched before the stall: the stall starts no new collective. Before the
stalled scenarios, one run without a stall loads every op, so that no scenario's collective
waits on a rank that is still compiling.

``python named_timeout_scenarios.py OUT TIMEOUT_S`` writes ``OUT/errors.json`` on rank 0:
scenario -> the error's type and text ("no error" when nothing was raised).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # test_checkpoint's model, config and data

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from moe_parallel_jobs import HIDDEN, make_expert  # noqa: E402
from test_checkpoint import build_engine, config, global_batches, make_model, train  # noqa: E402

from deepspeed_cpp.comm.collective_errors import set_configured_timeout  # noqa: E402


class _Abandoned(Exception):
    """Rank 1 leaves a scenario in which it played the stopped rank."""


class Scenario:
    def __init__(self, base: dist.Store, name: str, timeout_s: float, stalled: bool = True):
        self.base, self.name, self.rank = base, name, int(os.environ["RANK"])
        self.stalled = stalled
        self.timeout = timedelta(seconds=timeout_s)

    def __enter__(self):
        store = dist.PrefixStore(self.name, self.base)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=2,
                                timeout=self.timeout)  # fmt: skip
        set_configured_timeout(self.timeout)
        return self

    def stall(self, when: bool = True) -> None:
        """On rank 1 (when ``when``): answer nothing until rank 0 has its error, then leave."""
        if self.rank == 1 and when:
            self.base.wait([f"{self.name}/rank0_done"], timedelta(seconds=120))
            raise _Abandoned

    def __exit__(self, kind, error, _traceback):
        if self.rank == 0:
            outcome = "no error" if error is None else f"{kind.__name__}: {error}"
            self.base.set(f"{self.name}/outcome", outcome)
            self.base.set(f"{self.name}/rank0_done", "1")
        self.base.set(f"{self.name}/left/{self.rank}", "1")
        self.base.wait([f"{self.name}/left/{r}" for r in range(2)], timedelta(seconds=120))
        dist.destroy_process_group()
        # A stalled scenario ends in an error on both ranks (recorded above); any other fails.
        return error is None or (self.stalled and isinstance(error, (_Abandoned, RuntimeError)))


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

    settings = config(2, 3)
    # Every parameter partitioned (none kept whole below the persistence threshold).
    settings["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed_cpp.initialize(model=make_model(7), config=settings)
    train(engine, global_batches(3, 1))
    # In a forward, a silent rank is first missed by the unit check that precedes each fetch
    # (named too); GatheredParameters gathers with no check, so its wait is the one that fails.
    stall()
    with deepspeed_cpp.zero.GatheredParameters(list(engine.module.parameters())):
        pass


def initialize(stall) -> None:
    stall()
    build_engine(7, 2, 2)


SCENARIOS = {
    "initialize": initialize,
    "zero3_gather": zero3_gather,
    "moe_all_to_all": moe_forward,
}


def main(out: Path, timeout_s: float) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 2,
                         is_master=rank == 0, timeout=timedelta(seconds=300))  # fmt: skip
    with Scenario(base, "warm_up", 300, stalled=False):  # loads the ops on both ranks
        for run in SCENARIOS.values():
            run(lambda when=False: None)
    outcomes = {}
    for name, run in SCENARIOS.items():
        with Scenario(base, name, timeout_s) as scenario:
            run(scenario.stall)
        outcomes[name] = base.get(f"{name}/outcome").decode()
    if rank == 0:
        (out / "errors.json").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
