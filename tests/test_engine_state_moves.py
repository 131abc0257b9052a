"""DeepSpeed's ``engine.offload_states()`` / ``reload_states()`` on CPU engines (2 gloo ranks):
every state is on the host already, so the calls move nothing and training goes on bitwise as
without them; the arguments and the engines DeepSpeed refuses are refused by name."""

from __future__ import annotations

import pytest
import torch
from zero3_helpers import config, make_model, train

SEED = 5


def _between(engine, step):
    from deepspeed_cpp.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
    from deepspeed_cpp.runtime.zero.offload_states import get_state_devices

    if step == 0:
        engine.offload_states()
        engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device="cpu")
        engine.offload_states(device=OffloadDeviceEnum.none)  # warns, does nothing
        states = (OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
                  OffloadStateTypeEnum.lp_params)  # fmt: skip
        for state in states:
            assert get_state_devices(engine, state) == {torch.device("cpu")}, state
        engine.reload_states()


def _errors(engine) -> dict:
    found = {}
    for name, call in {
        "include": lambda: engine.offload_states(include=["optim_states", "masters"]),
        "nvme": lambda: engine.offload_states(device="nvme"),
        "gpu": lambda: engine.offload_states(device="cuda"),
    }.items():
        try:
            call()
            found[name] = "no error"
        except ValueError as error:
            found[name] = str(error)
    return found


def states_job(stage: int, offload_optimizer: bool) -> dict:
    import deepspeed_cpp

    cfg = config(stage=stage)
    if offload_optimizer:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    results = {}
    for moved in (False, True):
        engine, *_ = deepspeed_cpp.initialize(model=make_model(SEED), config=cfg)
        results[moved] = train(engine, SEED, 3, between=_between if moved else None)
        if moved:
            results["errors"] = _errors(engine)
        engine.destroy()
    inference_cfg = config(stage=3)
    del inference_cfg["optimizer"]
    inference, *_ = deepspeed_cpp.initialize(model=make_model(SEED), config=inference_cfg)
    try:
        inference.offload_states()
        results["no_optimizer"] = "no error"
    except RuntimeError as error:
        results["no_optimizer"] = str(error)
    inference.destroy()
    param_cfg = config(stage=3)
    param_cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    param_cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    engine, *_ = deepspeed_cpp.initialize(model=make_model(SEED), config=param_cfg)
    try:
        engine.offload_states()
        results["offload_param"] = "no error"
    except RuntimeError as error:
        results["offload_param"] = str(error)
    engine.destroy()
    return results


@pytest.mark.parametrize("stage, offload_optimizer", [(2, False), (3, True)])
def test_offload_and_reload_states_on_a_cpu_engine(pool2, stage, offload_optimizer):
    for result in pool2.run(states_job, stage, offload_optimizer):
        for name, value in result[False].items():
            assert torch.equal(result[True][name], value), name
        errors = result["errors"]
        assert (
            "'masters' is not a state; expected some of optim_states, hp_params"
            in errors["include"]
        )
        assert "device='nvme'): only the host (cpu) is supported" in errors["nvme"]
        assert "device='cuda'): expected OffloadDeviceEnum.cpu" in errors["gpu"]
        assert "the engine has no optimizer" in result["no_optimizer"]
        assert "offload_param.device = 'cpu'" in result["offload_param"]
