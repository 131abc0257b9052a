"""Building our optimizers (and an engine) does not import torch._dynamo, whose import was most
of a process's start (deepspeed_cpp/optim/optimizer_base.py); their param groups are torch's."""

import json
import subprocess
import sys

import pytest
import torch

from deepspeed_cpp.optim import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam

FRESH_PROCESS = """
import json, os, sys
import torch
import deepspeed_cpp
from deepspeed_cpp.optim import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam

model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
built = {}
for kind in (FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion):
    kind(model.parameters(), lr=0.1)
    built[kind.__name__] = "torch._dynamo" in sys.modules
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1])
engine, *_ = deepspeed_cpp.initialize(model=model, config={
    "train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2}})
engine.backward(engine(torch.randn(2, 5)).sum())
engine.step()
built["engine"] = "torch._dynamo" in sys.modules
print(json.dumps(built))
"""


def test_building_optimizers_and_an_engine_leaves_torch_dynamo_unimported():
    from launch_helpers import free_port, launch_env

    run = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(free_port())],
                         env=launch_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    imported = json.loads(run.stdout.strip().splitlines()[-1])
    assert imported == {
        "FusedAdam": False, "DeepSpeedCPUAdam": False, "DeepSpeedCPUAdagrad": False,
        "DeepSpeedCPULion": False, "engine": False,
    }  # fmt: skip


OURS = [FusedAdam, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion]


@pytest.mark.parametrize("kind", OURS)
def test_param_groups_are_torchs(kind):
    """Groups filled with the defaults, and torch's own refusals, with torch._dynamo imported
    (here: the wrapped function) as without it (the fresh process above)."""
    first, second = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)
    ours = kind([{"params": first.parameters()}, {"params": [second.weight], "lr": 0.5}], lr=0.25)
    reference = torch.optim.SGD(
        [{"params": first.parameters()}, {"params": [second.weight], "lr": 0.5}], lr=0.25
    )
    for group, expected in zip(ours.param_groups, reference.param_groups, strict=True):
        assert all(p is q for p, q in zip(group["params"], expected["params"], strict=True))
        assert group["lr"] == expected["lr"]
        assert set(group) == {"params", *ours.defaults}
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        ours.add_param_group({"params": [second.weight]})
    ours.add_param_group({"params": [second.bias], "lr": 0.125})
    assert ours.param_groups[-1]["lr"] == 0.125
    assert ours.param_groups[-1]["params"][0] is second.bias
