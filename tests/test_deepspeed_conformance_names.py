"""DeepSpeed names and behaviours that its own unit tests (the conformance sample of issue 26)
showed missing, each checked for what it does under DeepSpeed's module path: the ZeRO-3
gather-handle combinator and partitioned shape, the multi-node launcher's base class with its
``export`` quoting, ``DeepSpeedConfig(config, mpu)``, and ``save_checkpoint`` refusing an empty
``save_dir``.
"""

from __future__ import annotations

import json
import random
import shlex
import subprocess
from types import SimpleNamespace

import pytest
import torch

from deepspeed_cpp.launcher.multinode_runner import MultiNodeRunner
from deepspeed_cpp.runtime.zero.partition_parameters import (
    MultipleAllGatherHandles,
    ZeroParamStatus,
    partition_parameter,
    partitioned_param_data_shape,
)


class _Recorder:
    """A gather handle in each of the three ``wait`` signatures DeepSpeed's handles use."""

    def __init__(self, order: list, name: str, style: str) -> None:
        self.order, self.name, self.style, self.seen = order, name, style, None

    def wait(self, *args, **kwargs):
        if self.style == "positional" and args:
            raise AssertionError("handle_dependency must come by keyword")
        self.seen = kwargs
        self.order.append(self.name)


def test_multiple_all_gather_handles_waits_each_in_order_by_keyword():
    order: list = []
    styles = ["positional", "keyword", "kwargs"] * 2
    random.shuffle(styles)
    handles = [_Recorder(order, f"h{i}", style) for i, style in enumerate(styles)]
    flag = random.choice([True, False])
    MultipleAllGatherHandles(handles).wait(handle_dependency=flag)
    assert order == [f"h{i}" for i in range(len(styles))]
    assert all(h.seen == {"handle_dependency": flag} for h in handles)
    MultipleAllGatherHandles(handles[:1]).wait()
    assert handles[0].seen == {"handle_dependency": True}
    with pytest.raises(TypeError, match=r"handles\[1\] is a int with no wait\(\)"):
        MultipleAllGatherHandles([handles[0], 3])


def test_partitioned_parameter_shows_deepspeeds_partitioned_shape():
    shape = (random.randint(2, 40), random.randint(2, 40))
    param = torch.nn.Parameter(torch.randn(shape))
    partition_parameter(param)
    assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert param.shape == torch.Size(partitioned_param_data_shape)
    assert param.ds_shape == shape


class _EchoRunner(MultiNodeRunner):
    def backend_exists(self):
        return True

    def get_cmd(self, environment, active_resources):
        exports = [f"export {k}={v};" for k, v in self.exports.items()]
        return [
            "bash",
            "-c",
            " ".join(exports) + ' printf "%s\\n" "$' + '" "$'.join(self.exports) + '"',
        ]


def test_multinode_runner_add_export_quotes_only_what_a_shell_would_misread():
    args = SimpleNamespace(user_args=["--lr", "0.1"], user_script="train.py")
    runner = _EchoRunner(args, "d29ybGQ=")
    assert (runner.user_arguments, runner.user_script, runner.name) == (
        ["--lr", "0.1"], "train.py", "_EchoRunner")  # fmt: skip
    values = {
        "SLURM_JOB_CPUS_PER_NODE": "64(x2)",
        "PYTHONPATH": "/usr/local/lib/python3.12/site-packages:/opt/x-1,y@z%+=",
        "WITH_SPACE": "a b  c",
    }
    for key, value in values.items():
        runner.add_export(f" {key} ", f"  {value} ")
    assert runner.exports["SLURM_JOB_CPUS_PER_NODE"] == '"64(x2)"'
    assert runner.exports["PYTHONPATH"] == values["PYTHONPATH"]
    assert runner.exports["WITH_SPACE"] == '"a b  c"'
    # What matters: a shell reading the export lines gets each value back as given.
    out = subprocess.run(runner.get_cmd({}, {}), capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == list(values.values()), shlex.join(runner.get_cmd({}, {}))
    with pytest.raises(TypeError, match="abstract"):
        MultiNodeRunner(args, "")


def test_deepspeed_config_positional_construction_as_in_deepspeed(tmp_path):
    from deepspeed_cpp.runtime.config import DeepSpeedConfig

    micro, gas, world = random.randint(1, 6), random.randint(1, 4), random.randint(2, 5)
    raw = {"train_batch_size": micro * gas * world, "gradient_accumulation_steps": gas}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(raw))

    # No process group: a world of one, as DeepSpeed's DeepSpeedConfig(config) assumes.
    alone = DeepSpeedConfig(str(path))
    assert isinstance(alone, DeepSpeedConfig)
    assert (alone.train_micro_batch_size_per_gpu, alone.gradient_accumulation_steps) == (
        micro * world, gas)  # fmt: skip
    assert alone.raw == raw and alone.model_dump() == DeepSpeedConfig.load(raw).model_dump()

    # mpu: its data-parallel size sets the micro-batch.
    mpu = SimpleNamespace(get_data_parallel_world_size=lambda: world)
    split = DeepSpeedConfig(dict(raw), mpu=mpu)
    assert split.train_micro_batch_size_per_gpu == micro
    assert split.model_dump() == DeepSpeedConfig.load(raw, world_size=world).model_dump()

    # Keyword fields alone still build the model as pydantic does; mixing is refused by name.
    assert DeepSpeedConfig(train_batch_size=8).train_batch_size == 8
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['steps_per_print'\]"):
        DeepSpeedConfig(raw, steps_per_print=3)
    with pytest.raises(ValueError, match="train_batch_size"):
        DeepSpeedConfig({"train_batch_size": 0})


@pytest.mark.parametrize("save_dir", [None, ""])
def test_save_checkpoint_refuses_an_empty_save_dir_before_any_collective(save_dir):
    from deepspeed_cpp.runtime.checkpoint.saver import save_checkpoint

    # DeepSpeed raises ValueError here; Path("") would have saved into the working folder. The
    # subject is never read: the check comes before the ranks' first collective.
    with pytest.raises(ValueError, match=rf"save_dir is {save_dir!r}; expected the folder"):
        save_checkpoint(None, save_dir)


def test_gradient_allreduce_op_read_as_deepspeed_reads_it():
    from deepspeed_cpp.runtime.config import DeepSpeedConfig

    base = {"train_batch_size": 2}
    assert DeepSpeedConfig.load(base).gradient_allreduce_op == "mean"
    spelled = random.choice(["mean", "MEAN", "Mean"])
    assert DeepSpeedConfig.load({**base, "gradient_allreduce_op": spelled}).raw == {
        **base, "gradient_allreduce_op": spelled}  # fmt: skip
    assert (
        DeepSpeedConfig(dict(base, gradient_allreduce_op=spelled)).gradient_allreduce_op == "mean"
    )
    with pytest.raises(ValueError, match=r"Invalid gradient_allreduce_op = \"max\": expected"):
        DeepSpeedConfig.load({**base, "gradient_allreduce_op": "max"})
    # "sum" is refused (gradients are averaged here), naming DeepSpeed's own conflicts too.
    conflicts = {
        "ZeRO stage 3": {"zero_optimization": {"stage": 3}},
        "ZenFlow": {"zero_optimization": {"stage": 2, "zenflow": {}}},
        "DeepCompile": {"zero_optimization": {"stage": 1}, "compile": {"deepcompile": True}},
    }
    for name, extra in conflicts.items():
        with pytest.raises(ValueError, match=f"'sum' is not supported with {name}") as caught:
            DeepSpeedConfig.load({**base, **extra, "gradient_allreduce_op": "SUM"})
        assert "not supported yet by deepspeed_cpp" in str(caught.value)
    with pytest.raises(ValueError, match=r"gradient_allreduce_op = \"sum\": not supported yet"):
        DeepSpeedConfig.load({**base, "gradient_allreduce_op": "sum"})


def engine_passthrough_job(hidden: int):
    import deepspeed_cpp as ds

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.moe_1 = torch.nn.Linear(hidden, hidden)
            self.head = torch.nn.Linear(hidden, 1)
            self.label_smoothing = 0.125
            self.step = "the model's own step attribute"

        def forward(self, x):
            return self.head(self.moe_1(x))

    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, _, _, _ = ds.initialize(model=model, config=config)
    found = {
        "submodule": engine.moe_1 is model.moe_1,
        "value": engine.label_smoothing,
        "engine_wins": callable(engine.step),  # the engine's own names come first
        "weight": engine.moe_1.weight is model.moe_1.weight,
    }
    try:
        _ = engine.no_such_name
    except AttributeError as error:
        found["missing"] = str(error)
    engine.destroy()
    return found


def test_engine_passes_unknown_attributes_through_to_the_model(pool2):
    hidden = random.randint(2, 9)
    for found in pool2.run(engine_passthrough_job, hidden):
        assert found["submodule"] and found["weight"] and found["engine_wins"]
        assert found["value"] == 0.125
        assert "no attribute 'no_such_name' (nor has its model, Net)" in found["missing"]


def zero_init_dtype_job(explicit: torch.dtype):
    import deepspeed_cpp as ds
    from deepspeed_cpp.accelerator import get_accelerator

    dtypes = {}
    with ds.zero.Init():
        dtypes["none"] = torch.nn.Linear(4, 3).weight.ds_tensor.dtype
    with ds.zero.Init(dtype=explicit):
        dtypes["explicit"] = torch.nn.Linear(4, 3).weight.ds_tensor.dtype
    with ds.zero.Init(config_dict_or_path={}):
        dtypes["config"] = torch.nn.Linear(4, 3).weight.ds_tensor.dtype
    with ds.zero.Init(config_dict_or_path={"bf16": {"enabled": True}}):
        dtypes["bf16"] = torch.nn.Linear(4, 3).weight.ds_tensor.dtype
    dtypes["fp16_supported"] = get_accelerator().is_fp16_supported()
    # initialize() inside the block (DeepSpeed's TestDSInitWZinit): the engine's own fp32
    # buffers are not cast, the engine is not partitioned, and the block is whole again after.
    config = {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    with ds.zero.Init():
        model = torch.nn.Linear(4, 4)
        engine, *_ = ds.initialize(model=model, config=config, model_parameters=model.parameters())
        dtypes["inside_after_initialize"] = torch.zeros(1).dtype
    before = engine.module.weight.detach().clone()
    engine.backward(engine(torch.randn(1, 4, dtype=before.dtype)).float().sum())
    engine.step()
    dtypes["engine_param"] = engine.module.weight.dtype
    dtypes["stepped"] = not torch.equal(before, engine.module.weight.detach())
    dtypes["after_block"] = torch.zeros(1).dtype
    engine.destroy()
    return dtypes


def test_zero_init_without_config_or_dtype_builds_half_precision_as_deepspeed(pool2):
    """DeepSpeed's zero.Init() given neither a config nor a dtype makes the parameters fp16
    where the accelerator supports it, else bf16; a dtype or a config decides otherwise."""
    explicit = random.choice([torch.float32, torch.float64])
    for found in pool2.run(zero_init_dtype_job, explicit):
        half = torch.float16 if found["fp16_supported"] else torch.bfloat16
        assert found["none"] == half, found
        assert found["explicit"] == explicit and found["config"] == torch.float32, found
        assert found["bf16"] == torch.bfloat16, found
        assert found["inside_after_initialize"] == half and found["engine_param"] == half, found
        assert found["stepped"] and found["after_block"] == torch.float32, found
