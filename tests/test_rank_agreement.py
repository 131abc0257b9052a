"""Ranks that call initialize() with different set-ups fail on every rank, at once and by name,
before any collective can abort or hang (2 real gloo processes; the pool is reused)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

# A mismatch must raise well within this on every rank; the pool's own timeout only catches a
# hang (which would take the collective timeout, minutes).
ERROR_WITHIN_S = 10.0
JOB_TIMEOUT = 120.0


class Net(torch.nn.Module):
    def __init__(self, hidden: int = 32, swapped: bool = False):
        super().__init__()
        if swapped:  # the same layers, registered in the other order
            self.head = torch.nn.Linear(hidden, 4)
            self.body = torch.nn.Linear(8, hidden)
        else:
            self.body = torch.nn.Linear(8, hidden)
            self.head = torch.nn.Linear(hidden, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _config(**changes) -> dict:
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
    }
    for key, value in changes.items():
        config[key] = value
    return config


# case -> (rank 0's set-up, rank 1's set-up), each (Net kwargs, config).
CASES = {
    "lr": (
        ({}, _config()),
        ({}, _config(optimizer={"type": "AdamW", "params": {"lr": 2e-3}})),
    ),
    "optimizer_type": (
        ({}, _config()),
        ({}, _config(optimizer={"type": "Adam", "params": {"lr": 1e-3}})),
    ),
    "gradient_clipping": (({}, _config()), ({}, _config(gradient_clipping=1.0))),
    "micro_batch": (({}, _config()), ({}, _config(train_micro_batch_size_per_gpu=4))),
    "hidden_size": (({"hidden": 33}, _config()), ({"hidden": 32}, _config())),
    "registration_order": (({}, _config()), ({"swapped": True}, _config())),
    "precision": (({}, _config()), ({}, _config(bf16={"enabled": True}))),
    "zero_stage": (
        ({}, _config(zero_optimization={"stage": 3})),
        ({}, _config(zero_optimization={"stage": 1})),
    ),
}

# case -> texts every rank's message must hold: the key or parameter, then both ranks' values.
EXPECTED = {
    "lr": ["config optimizer.params.lr", "rank 0: 0.001", "rank 1: 0.002"],
    "optimizer_type": ["config optimizer.type", 'rank 0: "adamw"', 'rank 1: "adam"'],
    "gradient_clipping": ["config gradient_clipping", "rank 0: 0.0", "rank 1: 1.0"],
    "micro_batch": ["config train_micro_batch_size_per_gpu", "rank 0: 2", "rank 1: 4"],
    "hidden_size": [
        "parameter #0",
        "rank 0: 'body.weight' shape [33, 8]",
        "rank 1: 'body.weight' shape [32, 8]",
    ],
    "registration_order": [
        "parameter #0",
        "rank 0: 'body.weight' shape [32, 8]",
        "rank 1: 'head.weight' shape [4, 32]",
        "registered in a different order",
    ],
    "precision": ["config bf16.enabled", "rank 0: false", "rank 1: true"],
    "zero_stage": ["config zero_optimization.stage", "rank 0: 3", "rank 1: 1"],
}


def _train(engine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), 8)
        loss = engine(x).float().square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def initialize_job(case: str):
    """Builds rank r's set-up of ``case`` and initializes; returns what happened and when."""
    import deepspeed_cpp as deepspeed

    rank = dist.get_rank()
    torch.manual_seed(100 + rank)  # values differ per rank: only rank 0's count (broadcast)
    net_kwargs, config = CASES[case][rank] if case in CASES else ({}, _config())
    model = Net(**net_kwargs)
    start = time.monotonic()
    try:
        engine, *_ = deepspeed.initialize(model=model, config=config)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return ("raised", type(error).__name__, str(error), time.monotonic() - start)
    try:
        return ("trained", _train(engine, 3), [p.detach().clone() for p in model.parameters()])
    finally:
        engine.destroy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_disagreement_raises_on_every_rank_naming_it(pool2, case):
    outcomes = pool2.run(initialize_job, case, timeout=JOB_TIMEOUT)
    for rank, (what, error_type, message, seconds) in enumerate(outcomes):
        assert what == "raised", (rank, what)
        assert error_type == "RankDisagreementError", (rank, error_type, message)
        for text in EXPECTED[case]:
            assert text in message, (rank, text, message)
        assert seconds < ERROR_WITHIN_S, (rank, seconds)
    # The pool's process group is still sound: nothing was left half-way.
    after = pool2.run(initialize_job, "agree", timeout=JOB_TIMEOUT)
    assert [outcome[0] for outcome in after] == ["trained", "trained"]


def test_agreeing_ranks_train_from_rank0s_weights(pool2):
    (what0, losses0, params0), (what1, losses1, params1) = pool2.run(
        initialize_job, "agree", timeout=JOB_TIMEOUT
    )
    assert what0 == what1 == "trained"
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)  # initialised differently, broadcast from rank 0, in step
    assert losses0 != losses1  # each rank saw its own data


def failing_config_job():
    """Rank 1's batch sizes contradict each other: its config does not load."""
    import deepspeed_cpp as deepspeed

    config = _config(train_batch_size=4)
    if dist.get_rank() == 1:
        config["train_micro_batch_size_per_gpu"] = 3
    start = time.monotonic()
    try:
        deepspeed.initialize(model=Net(), config=config)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return (type(error).__name__, str(error), time.monotonic() - start)
    return ("no error", "", 0.0)


def test_a_config_that_fails_on_one_rank_fails_on_every_rank(pool2):
    (type0, message0, seconds0), (type1, message1, seconds1) = pool2.run(
        failing_config_job, timeout=JOB_TIMEOUT
    )
    assert type1 == "DeepSpeedConfigError", message1  # the rank's own error, unchanged
    assert type0 == "RankDisagreementError", message0
    assert "rank 1 could not set up: DeepSpeedConfigError" in message0, message0
    assert "train_batch_size" in message0, message0
    assert max(seconds0, seconds1) < ERROR_WITHIN_S


def client_optimizer_job(weight_decay_on_rank1: float):
    """An optimizer object passed to initialize(): its hyper-parameters must agree too."""
    import deepspeed_cpp as deepspeed

    model = Net()
    decay = weight_decay_on_rank1 if dist.get_rank() == 1 else 0.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=decay)
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
    }
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return str(error)
    try:
        _train(engine, 1)
        return "trained"
    finally:
        engine.destroy()


def test_client_optimizer_hyper_parameters_must_agree(pool2):
    assert pool2.run(client_optimizer_job, 0.0, timeout=JOB_TIMEOUT) == ["trained"] * 2
    for message in pool2.run(client_optimizer_job, 0.1, timeout=JOB_TIMEOUT):
        assert "optimizer passed to initialize(): group 0 weight_decay" in message, message
        assert "rank 0: 0.0" in message and "rank 1: 0.1" in message, message


def per_rank_paths_job(tmp: str):
    """NVMe folders are each rank's own (a node's local disk): they may differ."""
    import deepspeed_cpp as deepspeed

    rank = dist.get_rank()
    os.makedirs(f"{tmp}/rank{rank}", exist_ok=True)
    config = _config(
        zero_optimization={
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": f"{tmp}/rank{rank}"},
        },
        steps_per_print=10 + rank,
        aio={"queue_depth": 8 * (rank + 1)},
    )
    engine, *_ = deepspeed.initialize(model=Net(), config=config)
    try:
        _train(engine, 1)
        return "trained"
    finally:
        engine.destroy()


def test_per_rank_keys_may_differ(pool2, tmp_path):
    assert pool2.run(per_rank_paths_job, str(tmp_path), timeout=300.0) == ["trained"] * 2


def zero_init_job(case: str):
    """Builds rank r's model of ``case`` under zero.Init (each module's parameters are
    broadcast from rank 0 as the module is built, before initialize() runs)."""
    import deepspeed_cpp as deepspeed

    net_kwargs, config = CASES[case][dist.get_rank()] if case in CASES else ({}, _config())
    config = dict(config, zero_optimization={"stage": 3})
    start = time.monotonic()
    try:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = Net(**net_kwargs)
        engine, *_ = deepspeed.initialize(model=model, config=config)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return ("raised", type(error).__name__, str(error), time.monotonic() - start)
    try:
        return ("trained", _train(engine, 2), None)
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "case, expected",
    [
        ("hidden_size", ["parameter #0", "'weight' shape [33, 8]", "'weight' shape [32, 8]"]),
        ("registration_order", ["parameter #0", "'weight' shape [32, 8]", "shape [4, 32]"]),
        ("precision", ["parameter #0", "float32", "bfloat16"]),
    ],
)
def test_zero_init_disagreement_raises_on_every_rank_instead_of_aborting(pool2, case, expected):
    # Without the agreement gloo aborts the process: "Received data size doesn't match".
    for rank, (what, error_type, message, seconds) in enumerate(
        pool2.run(zero_init_job, case, timeout=JOB_TIMEOUT)
    ):
        assert (what, error_type) == ("raised", "RankDisagreementError"), (rank, message)
        assert "in zero.Init, partitioning the parameters of a Linear" in message, message
        for text in expected:
            assert text in message, (rank, text, message)
        assert seconds < ERROR_WITHIN_S, (rank, seconds)
    after = pool2.run(zero_init_job, "agree", timeout=JOB_TIMEOUT)
    assert [outcome[0] for outcome in after] == ["trained", "trained"]


class MoENet(torch.nn.Module):
    def __init__(self, num_experts: int):
        from deepspeed_cpp.moe.layer import MoE

        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = MoE(8, torch.nn.Linear(8, 8), num_experts=num_experts, ep_size=2, k=1)
        self.out = torch.nn.Linear(8, 4)

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.tanh(self.inp(x)))
        return self.out(hidden), l_aux


def expert_parallel_job(experts_on_rank1: int):
    """ep_size=2: each rank holds other experts (other values, same local names and shapes)."""
    import deepspeed_cpp as deepspeed

    rank = dist.get_rank()
    torch.manual_seed(7 + rank)  # the experts of the two ranks differ, as they may
    model = MoENet(experts_on_rank1 if rank == 1 else 2)
    try:
        engine, *_ = deepspeed.initialize(
            model=model, config=_config(zero_optimization={"stage": 2})
        )
    except Exception as error:  # noqa: BLE001 - returned to the test
        return ("raised", type(error).__name__, str(error))
    try:
        for _ in range(2):
            out, l_aux = engine(torch.randn(4, 8))
            engine.backward(out.square().mean() + 0.01 * l_aux)
            engine.step()
        return ("trained", "", "")
    finally:
        engine.destroy()


def test_expert_parallel_ranks_agree_on_expert_shapes_not_values(pool2):
    assert [o[0] for o in pool2.run(expert_parallel_job, 2, timeout=JOB_TIMEOUT)] == ["trained"] * 2
    # 4 experts on rank 1 (2 per expert-parallel rank) against 2 on rank 0 (1 each).
    for what, error_type, message in pool2.run(expert_parallel_job, 4, timeout=JOB_TIMEOUT):
        assert (what, error_type) == ("raised", "RankDisagreementError"), message
        assert "number of parameters: rank 0: 7; rank 1: 9" in message, message
        # The gate comes first in registration order: one row per expert.
        assert "'moe.deepspeed_moe.gate.wg.weight' shape [2, 8]" in message, message
        assert "'moe.deepspeed_moe.gate.wg.weight' shape [4, 8]" in message, message


def moe_ep_size_job(ep_size_on_rank1: int):
    """Expert groups are made (collectively) when the MoE layer is built, before initialize()."""
    from deepspeed_cpp.moe.layer import MoE
    from deepspeed_cpp.utils import groups

    groups._reset_for_tests()
    ep_size = ep_size_on_rank1 if dist.get_rank() == 1 else 2
    start = time.monotonic()
    try:
        MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=ep_size)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return (type(error).__name__, str(error), time.monotonic() - start)
    return ("built", "", time.monotonic() - start)


def test_moe_layers_of_another_ep_size_raise_on_every_rank_when_built(pool2):
    assert [o[0] for o in pool2.run(moe_ep_size_job, 2, timeout=JOB_TIMEOUT)] == ["built"] * 2
    for error_type, message, seconds in pool2.run(moe_ep_size_job, 1, timeout=JOB_TIMEOUT):
        assert error_type == "RankDisagreementError", message
        assert "creating the expert-parallel process groups" in message, message
        assert "ep_size: rank 0: 2; rank 1: 1" in message, message
        assert seconds < ERROR_WITHIN_S


def zero_init_on_rank0_only_job():
    """Rank 0 builds under zero.Init (its agreement per module), rank 1 goes to initialize():
    the two agreements meet and must say that the ranks are at different points."""
    import deepspeed_cpp as deepspeed

    config = _config(zero_optimization={"stage": 3})
    start = time.monotonic()
    try:
        if dist.get_rank() == 0:
            with deepspeed.zero.Init(config_dict_or_path=config):
                model = Net()
        else:
            model = Net()
        deepspeed.initialize(model=model, config=config)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return (type(error).__name__, str(error), time.monotonic() - start)
    return ("no error", "", 0.0)


def test_ranks_at_different_set_up_steps_are_named(pool2):
    for error_type, message, seconds in pool2.run(zero_init_on_rank0_only_job, timeout=JOB_TIMEOUT):
        assert error_type == "RankDisagreementError", message
        assert "ranks disagree on where they are" in message, message
        assert "rank 0: in zero.Init, partitioning the parameters of a Linear" in message, message
        assert "rank 1: at deepspeed_cpp.initialize()" in message, message
        assert seconds < ERROR_WITHIN_S
    after = pool2.run(initialize_job, "agree", timeout=JOB_TIMEOUT)
    assert [outcome[0] for outcome in after] == ["trained", "trained"]
