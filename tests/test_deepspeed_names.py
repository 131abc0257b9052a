"""DeepSpeed's public names under its module paths (issue 26), as scripts and DeepSpeed's own
test suite import them with ``import deepspeed`` aliased to deepspeed_cpp: each import resolves,
and each name does what DeepSpeed's does (the optimizer class names answer ``isinstance`` for
the engines real ranks build; the config classes are the ones the config parses into).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import deepspeed_cpp

ALIAS_IMPORTS = """
import deepspeed_cpp.compat
deepspeed_cpp.compat.activate()
import deepspeed
from deepspeed.accelerator import get_accelerator, is_current_accelerator_supported
from deepspeed.git_version_info import (version, git_hash, git_branch, installed_ops,
                                        compatible_ops, torch_info)
from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadParamConfig,
    DeepSpeedZeroOffloadOptimizerConfig, OffloadDeviceEnum)
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from deepspeed.utils.torch import required_torch_version, register_grad_hook
from deepspeed.runtime.lr_schedules import (WARMUP_LR, WARMUP_DECAY_LR, ONE_CYCLE, LR_RANGE_TEST,
    WARMUP_COSINE_LR, WARMUP_NUM_STEPS, WARMUP_MAX_LR, TOTAL_NUM_STEPS, CYCLE_MIN_LR)
from deepspeed.utils import RepeatingLoader, OnDevice
from deepspeed.runtime.dataloader import RepeatingLoader
from deepspeed.runtime.config import get_gradient_clipping, ADAM_OPTIMIZER
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from deepspeed.pipe import PipelineModule, LayerSpec, TiedLayerSpec
from deepspeed.comm import destroy_process_group, all_reduce, broadcast, new_group
import deepspeed.checkpointing
from deepspeed.runtime.activation_checkpointing.checkpointing import (checkpoint, configure,
    is_configured, reset, get_cuda_rng_tracker, model_parallel_cuda_manual_seed,
    CudaRNGStatesTracker, non_reentrant_checkpoint)
assert deepspeed.checkpointing.checkpoint is checkpoint
assert deepspeed.OnDevice is OnDevice
assert deepspeed.ops.__compatible_ops__["cpu_adam"] is True
assert is_current_accelerator_supported()
print("ok")
"""


def test_every_name_imports_under_the_deepspeed_alias():
    run = subprocess.run(
        [sys.executable, "-c", ALIAS_IMPORTS], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_git_version_info_reports_without_compiling():
    from deepspeed_cpp import git_version_info as info
    from deepspeed_cpp.ops.op_builder import ALL_OPS

    assert info.version == deepspeed_cpp.__version__
    assert isinstance(info.git_hash, str) and isinstance(info.git_branch, str)
    assert set(info.installed_ops) == set(ALL_OPS)
    assert info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    for key in ("cuda_version", "nccl_version", "hip_version", "bf16_support"):
        assert key in info.torch_info
    assert info.compatible_ops["cpu_adam"] is True
    # DeepSpeed ops we do not have read as not compatible (tests skip on them), not KeyError.
    assert info.compatible_ops["fused_lamb"] is False
    assert deepspeed_cpp.ops.__compatible_ops__ is info.compatible_ops


def test_zero_config_classes_are_the_parsed_sections():
    from deepspeed_cpp.runtime.config import DeepSpeedConfig
    from deepspeed_cpp.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from deepspeed_cpp.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
        OffloadDeviceEnum,
    )

    config = DeepSpeedConfig.parse(
        {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
        }
    )
    zero = config.zero_optimization
    assert isinstance(zero, DeepSpeedZeroConfig) and zero.stage == ZeroStageEnum.weights
    assert isinstance(zero.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert isinstance(zero.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert zero.offload_optimizer.device == OffloadDeviceEnum.cpu
    assert DeepSpeedZeroConfig(stage=2).offload_optimizer is None
    with pytest.raises(ValueError, match="nvme_path"):
        DeepSpeedZeroOffloadOptimizerConfig(device=OffloadDeviceEnum.nvme)


def test_lr_schedule_constants_build_their_schedules():
    from deepspeed_cpp.runtime import lr_schedules as ls

    assert set(ls.VALID_LR_SCHEDULES) == {
        ls.LR_RANGE_TEST, ls.ONE_CYCLE, ls.WARMUP_LR, ls.WARMUP_DECAY_LR, ls.WARMUP_COSINE_LR
    }  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    params = {ls.WARMUP_MIN_LR: 0.0, ls.WARMUP_MAX_LR: 1.0, ls.WARMUP_NUM_STEPS: 4,
              ls.WARMUP_TYPE: ls.WARMUP_LINEAR_RATE, ls.TOTAL_NUM_STEPS: 8}  # fmt: skip
    schedule = ls.build_lr_scheduler(ls.WARMUP_DECAY_LR, params, optimizer)
    schedule.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25)


def test_repeating_loader_restarts_and_on_device_builds_on_the_device():
    from deepspeed_cpp.utils import OnDevice, RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(StopIteration):
        next(RepeatingLoader([]))
    default = torch.get_default_dtype()
    with OnDevice(dtype=torch.bfloat16, device="meta"):
        layer = torch.nn.Linear(3, 4)
        index = torch.arange(3)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.bfloat16
    assert index.dtype == torch.int64  # only floating-point tensors take the dtype
    assert torch.get_default_dtype() == default and torch.zeros(1).device.type == "cpu"
    with OnDevice(dtype=torch.float16, device="meta", enabled=False):
        assert torch.nn.Linear(1, 1).weight.device.type == "cpu"


def test_required_torch_version():
    from deepspeed_cpp.utils.torch import required_torch_version

    assert required_torch_version(min_version=1.0)
    assert not required_torch_version(min_version="999.0")
    assert not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError, match="min_version"):
        required_torch_version()


def test_pipeline_names_import_and_refuse_when_used():
    from deepspeed_cpp.pipe import LayerSpec, PipelineModule

    class MyPipeline(PipelineModule):  # defining a subclass must work (test helpers do)
        pass

    with pytest.raises(NotImplementedError, match="issue 28"):
        MyPipeline(layers=[])
    with pytest.raises(NotImplementedError, match="LayerSpec"):
        LayerSpec(torch.nn.Linear, 2, 2)


# --- the optimizer class names, on engines built by 2 real ranks -------------------------------

KINDS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer",
         "FP16_Optimizer", "FP16_UnfusedOptimizer")  # fmt: skip


def optimizer_kind_job(stage: int, precision: str, optimizer_name: str) -> list[str]:
    import deepspeed_cpp as ds
    from deepspeed_cpp.runtime import bf16_optimizer
    from deepspeed_cpp.runtime.fp16 import fused_optimizer, unfused_optimizer
    from deepspeed_cpp.runtime.zero import stage3, stage_1_and_2

    classes = {
        "DeepSpeedZeroOptimizer": stage_1_and_2.DeepSpeedZeroOptimizer,
        "DeepSpeedZeroOptimizer_Stage3": stage3.DeepSpeedZeroOptimizer_Stage3,
        "BF16_Optimizer": bf16_optimizer.BF16_Optimizer,
        "FP16_Optimizer": fused_optimizer.FP16_Optimizer,
        "FP16_UnfusedOptimizer": unfused_optimizer.FP16_UnfusedOptimizer,
    }
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    if precision != "fp32":
        config[precision] = {"enabled": True}
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    engine, returned, _, _ = ds.initialize(model=model, optimizer=optimizer, config=config)
    assert returned is engine.optimizer
    kinds = [name for name, cls in classes.items() if isinstance(returned, cls)]
    assert not isinstance(object(), classes["DeepSpeedZeroOptimizer"])
    return kinds


@pytest.mark.parametrize(
    "stage, precision, optimizer_name, expected",
    [
        (1, "fp32", "adam", ["DeepSpeedZeroOptimizer"]),
        (2, "bf16", "adam", ["DeepSpeedZeroOptimizer"]),
        (3, "fp32", "adam", ["DeepSpeedZeroOptimizer_Stage3"]),
        (0, "bf16", "adam", ["BF16_Optimizer"]),
        (0, "fp16", "adam", ["FP16_Optimizer"]),
        (0, "fp16", "sgd", ["FP16_UnfusedOptimizer"]),
    ],
)
def test_optimizer_class_names_match_the_engines_configuration(
    pool2, stage, precision, optimizer_name, expected
):
    for kinds in pool2.run(optimizer_kind_job, stage, precision, optimizer_name):
        assert kinds == expected


def test_optimizer_class_names_cannot_be_constructed():
    from deepspeed_cpp.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(TypeError, match="deepspeed.initialize"):
        DeepSpeedZeroOptimizer(None)
