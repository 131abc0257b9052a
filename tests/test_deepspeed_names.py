"""DeepSpeed's public names under its module paths (issue 26), as scripts and DeepSpeed's own
test suite import them with ``import deepspeed`` aliased to deepspeed_cpp: each import resolves,
and each name does what DeepSpeed's does (the optimizer class names answer ``isinstance`` for
the engines real ranks build; the config classes are the ones the config parses into).
"""

from __future__ import annotations

import logging
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
from deepspeed.moe.sharded_moe import (top1gating, top2gating, topkgating, TopKGate, MOELayer,
    _AllToAll, _route_slots, _sparse_encode, _sparse_decode)
from deepspeed.runtime.utils import (see_memory_usage, clip_grad_norm_, CheckOverflow,
    get_weight_norm, partition_uniform, partition_balanced, prefix_sum_inc, move_to_device,
    is_model_parallel_parameter, call_to_str, count_used_parameters_in_backward)
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.runtime.zero.linear import (zero3_linear_wrap, LinearModuleForZeroStage3,
    LinearFunctionForZeroStage3)
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
from deepspeed.runtime.zero.offload_states import get_state_devices, _make_offload_state_key
from deepspeed.checkpoint.ds_to_universal import main as convert_to_universal
from deepspeed.utils.numa import parse_range_list
from deepspeed.utils.pin_memory import get_active_native_pinned_memory
from deepspeed.utils.groups import _get_expert_parallel_ranks
from deepspeed.launcher.runner import parse_resource_filter, _parse_hostfile, main
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
    # CUDA counts only where it can run (DeepSpeed's tests skip their CUDA bf16 checks on "0.0").
    if torch.cuda.is_available():
        assert info.torch_info["cuda_version"] == ".".join(torch.version.cuda.split(".")[:2])
    else:
        assert info.torch_info["cuda_version"] == info.torch_info["nccl_version"] == "0.0"
        assert info.torch_info["bf16_support"] is False
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


def test_zero_config_built_directly_translates_deprecated_keys_as_the_config_does(caplog):
    """``DeepSpeedZeroConfig(**section)`` gives what the same section inside a whole config
    gives: deprecated keys moved to their new names (with a warning), refusals named."""
    from deepspeed_cpp.runtime.config import DeepSpeedConfig
    from deepspeed_cpp.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed_cpp.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    for section in (
        {"stage": 3, "cpu_offload_param": True, "cpu_offload": True},
        {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
        {"stage": 2, "round_robin_gradients": True, "reduce_bucket_size": 77},
    ):
        direct = DeepSpeedZeroConfig(**section)
        whole = DeepSpeedConfig.parse({"train_batch_size": 1, "zero_optimization": section})
        assert direct == whole.zero_optimization, section
    direct = DeepSpeedZeroConfig(cpu_offload_param=True, cpu_offload=True)
    assert isinstance(direct.offload_param, DeepSpeedZeroOffloadParamConfig)
    assert isinstance(direct.offload_optimizer, DeepSpeedZeroOffloadOptimizerConfig)
    assert direct.offload_optimizer.device == "cpu" and direct.offload_param.device == "cpu"
    assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).model_dump()[
        "gather_16bit_weights_on_model_save"
    ]
    logger = logging.getLogger("deepspeed_cpp")  # it does not propagate to the root logger
    logger.addHandler(caplog.handler)
    try:
        DeepSpeedZeroConfig(cpu_offload=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert "'zero_optimization.cpu_offload' is deprecated in DeepSpeed" in caplog.text
    with pytest.raises(ValueError, match="zero_optimization.legacy_stage1 = true: not supported"):
        DeepSpeedZeroConfig(legacy_stage1=True)
    with pytest.raises(ValueError, match="cpu_offlad"):
        DeepSpeedZeroConfig(cpu_offlad=True)
    # DeepSpeed's derived read-only flags.
    assert DeepSpeedZeroConfig(stage=1).pipeline_loading_checkpoint is False
    assert DeepSpeedZeroOffloadOptimizerConfig().pipeline is False
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline is True


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


def test_pipeline_names_import_and_subclass():
    from deepspeed_cpp.pipe import LayerSpec, PipelineError, PipelineModule

    class MyPipeline(PipelineModule):  # defining a subclass must work (test helpers do)
        pass

    with pytest.raises(PipelineError, match="num_stages=<int> or topology"):
        MyPipeline(layers=[])
    assert isinstance(LayerSpec(torch.nn.Linear, 2, 2).build(), torch.nn.Linear)
    import deepspeed_cpp.runtime.pipe.engine as pipe_engine

    assert issubclass(pipe_engine.PipelineEngine, deepspeed_cpp.runtime.engine.DeepSpeedEngine)


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
    elif optimizer_name == "config":  # the config's Adam: FusedAdam, as DeepSpeed builds it
        optimizer = None
        config["optimizer"] = {"type": "Adam", "params": {"lr": 0.1}}
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
        (0, "bf16", "adam", ["FP16_UnfusedOptimizer"]),
        (0, "bf16", "config", ["FP16_Optimizer"]),
        (0, "fp16", "adam", ["FP16_UnfusedOptimizer"]),
        (0, "fp16", "config", ["FP16_Optimizer"]),
        (0, "fp16", "sgd", ["FP16_UnfusedOptimizer"]),
    ],
)
def test_optimizer_class_names_match_the_engines_configuration(
    pool2, stage, precision, optimizer_name, expected
):
    """The expected names are what DeepSpeed 0.19.8 returned for the same configurations
    (measured with ``DS_ACCELERATOR=cpu`` on 2 gloo ranks): at stage 0, fp16 and bf16 alike,
    ``FP16_Optimizer`` over its FusedAdam (the config's Adam) and ``FP16_UnfusedOptimizer``
    over a client's torch optimizer."""
    for kinds in pool2.run(optimizer_kind_job, stage, precision, optimizer_name):
        assert kinds == expected


def test_optimizer_class_names_cannot_be_constructed():
    from deepspeed_cpp.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with pytest.raises(TypeError, match="deepspeed.initialize"):
        DeepSpeedZeroOptimizer(None)


# --- DeepSpeed's helpers that depend on other ranks, on the same 2 ranks ----------------------


def test_sharded_moe_no_drop_capacity_is_agreed_over_the_expert_group(pool2):
    from deepspeed_names_jobs import no_drop_capacity_is_the_group_maximum

    for rank_result in pool2.run(no_drop_capacity_is_the_group_maximum, 11):
        for name, width, local, everyone, routes, tokens in rank_result:
            # top-1 caps it at the rank's own token count, as DeepSpeed's does
            assert width == (min(everyone, tokens) if name == "top1" else everyone), name
            assert everyone >= local, name
            assert routes == int(name[-1]) * tokens, name  # nothing dropped


def test_clip_grad_norm_averages_the_ranks_norms_and_overflow_is_agreed(pool2):
    from deepspeed_names_jobs import grad_norm_helpers

    seed = int(torch.randint(0, 2**31, ()))
    results = pool2.run(grad_norm_helpers, seed)
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(5, generator=generator).double()  # the draws the job made, in float64
    experts = [(torch.randn(3, generator=generator) * 3).double() for _ in range(2)]
    norms = [torch.cat([shared, e]).norm() for e in experts]
    average = sum(norms) / 2
    coefficient = min(1.0, 0.5 / (float(average) + 1e-6))
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["norm"].double(), average, rtol=1e-6, atol=0)
        torch.testing.assert_close(
            result["shared"].double(), shared * coefficient, rtol=1e-6, atol=0
        )
        torch.testing.assert_close(
            result["expert"].double(), experts[rank] * coefficient, rtol=1e-6, atol=0
        )
        assert result["overflow"] is True  # rank 1's expert gradient has an inf
        assert result["overflow_by_norm"] is True


# --- small helpers under DeepSpeed's names, one process -----------------------------------------


def test_zero3_linear_is_an_exact_linear():
    from deepspeed_cpp.runtime.zero.linear import LinearModuleForZeroStage3, zero3_linear_wrap

    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, 4, dtype=torch.float64)
    for bias in (b, None):
        ours = zero3_linear_wrap(x, w, bias)
        reference = torch.nn.functional.linear(x, w, bias)
        torch.testing.assert_close(ours, reference)
        inputs = (x, w) if bias is None else (x, w, bias)
        mine = torch.autograd.grad(ours, inputs, grad)
        theirs = torch.autograd.grad(reference, inputs, grad)
        for a, r in zip(mine, theirs):
            torch.testing.assert_close(a, r)
    layer = LinearModuleForZeroStage3(5, 4).double()
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_ds_to_universal_refuses_naming_what_to_do(tmp_path):
    from types import SimpleNamespace

    from deepspeed_cpp.checkpoint.ds_to_universal import UniversalCheckpointNotNeeded, main

    (tmp_path / "global_step4").mkdir()
    args = SimpleNamespace(input_folder=str(tmp_path / "global_step4"), output_folder="out")
    with pytest.raises(UniversalCheckpointNotNeeded, match="tag='global_step4'"):
        main(args)
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder"):
        main(SimpleNamespace(input_folder=str(tmp_path / "missing"), output_folder="out"))


def test_launcher_resource_filter_hostfile_and_argument_mix():
    from deepspeed_cpp.launcher import runner

    hosts = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
    assert runner.parse_resource_filter(hosts) == hosts
    assert runner.parse_resource_filter(hosts, include_str="worker-1:3,0") == {"worker-1": [0, 3]}
    assert runner.parse_resource_filter(hosts, include_str="worker-0:1@worker-0:0,1") == {
        "worker-0": [0, 1]
    }
    assert runner.parse_resource_filter(hosts, exclude_str="worker-0:0,1@worker-1:3") == {
        "worker-0": [2, 3],
        "worker-1": [0, 1, 2],
    }
    assert runner.parse_resource_filter(hosts, exclude_str="worker-1") == {"worker-0": [0, 1, 2, 3]}
    for kwargs, message in [
        ({"include_str": "A", "exclude_str": "B"}, "exclude each other"),
        ({"include_str": "jeff"}, "host 'jeff' is not one of"),
        ({"exclude_str": "worker-1:4"}, "has no slot 4"),
        ({"exclude_str": "worker-1@worker-0:1@5"}, "host '5'"),
    ]:
        with pytest.raises(ValueError, match=message):
            runner.parse_resource_filter(hosts, **kwargs)
    assert runner.parse_inclusion_exclusion({"a": 2, "b": 1}, "", "a:0") == {"a": [1], "b": [0]}
    parsed = runner._parse_hostfile(["", "worker-1 slots=2", "# c", "10.0.0.2 slots=4"])
    assert list(parsed.items()) == [("worker-1", 2), ("10.0.0.2", 4)]
    for bad in (["a slots=1", "a slots=2"], ["this is bad slots=1"], ["missingslots"], [""]):
        with pytest.raises(ValueError):
            runner._parse_hostfile(bad)
    for argv in ("--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"):
        with pytest.raises(ValueError, match="cannot be combined with -i/--include"):
            runner.main(args=argv.split())


def test_parse_range_list_expert_rank_layout_and_small_utilities():
    from deepspeed_cpp.accelerator import get_accelerator
    from deepspeed_cpp.runtime.zero import utils as zero_utils
    from deepspeed_cpp.utils.groups import _get_expert_parallel_ranks
    from deepspeed_cpp.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "3-1", "a"):
        with pytest.raises(ValueError, match="bad range"):
            parse_range_list(bad)
    # DeepSpeed's documented E + M + D example: 16 ranks, tensor parallel 2, expert parallel 4.
    ep, edp = _get_expert_parallel_ranks(16, 2, 4)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    ep, edp = _get_expert_parallel_ranks(8, 1, 2, use_data_before_expert_parallel_=True)
    assert ep == [[0, 4], [1, 5], [2, 6], [3, 7]] and edp == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="not divisible by expert_parallel_size_=3"):
        _get_expert_parallel_ranks(8, 1, 3)
    assert get_accelerator().unpin_memory(torch.ones(2)) is None
    assert issubclass(zero_utils.ZeRORuntimeException, Exception)
    assert zero_utils.is_zero_supported_optimizer(
        torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    )
    assert not zero_utils.is_zero_supported_optimizer(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
    )
    doubled = zero_utils.apply_to_tensors_only(lambda t: t * 2, {"a": [torch.ones(1), 3]})
    assert doubled["a"][0].item() == 2 and doubled["a"][1] == 3


def test_offload_adam_states_round_trip_keeps_the_state_tensors():
    from deepspeed_cpp.runtime.zero import offload_states

    param = torch.nn.Parameter(torch.randn(6))
    optimizer = torch.optim.Adam([param])
    param.grad = torch.randn(6)
    optimizer.step()
    state = optimizer.state[param]
    exp_avg, before = state["exp_avg"], state["exp_avg"].clone()
    offload_states.offload_adam_states(optimizer, "cpu")
    assert state["exp_avg"] is exp_avg and "exp_avg_offload_buffer" in state
    offload_states.reload_adam_states(optimizer, "cpu")
    torch.testing.assert_close(state["exp_avg"], before, rtol=0, atol=0)
    replaced = offload_states.reload_optimizer_states(optimizer, "cpu")
    assert len(replaced) == 5  # step, exp_avg, exp_avg_sq and the two buffers


def test_checkpoint_file_helpers_and_unavailable_ops(tmp_path):
    import deepspeed_cpp
    from deepspeed_cpp.checkpoint.utils import get_model_ckpt_name_for_rank
    from deepspeed_cpp.ops.op_builder import FusedLambBuilder, OpNotAvailableError
    from deepspeed_cpp.utils.zero_to_fp32 import get_optim_files

    names = [f"zero_{i}_optim_states.pt" for i in (0, 2, 10, 11, 1)]
    for name in names:
        (tmp_path / name).write_text(name)
    # Natural order: rank 2 before rank 10.
    assert [p.rsplit("/", 1)[1] for p in get_optim_files(str(tmp_path))] == [
        "zero_0_optim_states.pt", "zero_1_optim_states.pt", "zero_2_optim_states.pt",
        "zero_10_optim_states.pt", "zero_11_optim_states.pt",
    ]  # fmt: skip
    with pytest.raises(FileNotFoundError, match="_optim_states.pt"):
        get_optim_files(str(tmp_path / "empty"))
    assert get_model_ckpt_name_for_rank("d", "00") == "d/mp_rank_00_model_states.pt"
    assert FusedLambBuilder().is_compatible()[0] is False
    assert deepspeed_cpp.ops.__compatible_ops__[FusedLambBuilder.NAME] is False
    with pytest.raises(OpNotAvailableError, match="no LAMB"):
        FusedLambBuilder().load()
    assert deepspeed_cpp.get_accelerator().device_name() in ("cpu", "cuda")
    from deepspeed_cpp.accelerator import cpu_accelerator, cuda_accelerator

    assert cpu_accelerator.CPU_Accelerator is cpu_accelerator.CPUAccelerator
    assert cuda_accelerator.CUDA_Accelerator is cuda_accelerator.CUDAAccelerator


def test_swap_threshold_zero_param_status_and_fused_lion_names():
    from deepspeed_cpp.ops.lion import FusedLion
    from deepspeed_cpp.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from deepspeed_cpp.runtime.zero import ZeroParamStatus
    from deepspeed_cpp.runtime.zero.partition_parameters import ZeroParamStatus as status

    assert ZeroParamStatus is status and MIN_SWAPPABLE_BYTES == 1 << 20
    # DeepSpeed 0.19.8 on its CPU accelerator raises ValueError ("This op had not been
    # implemented on CPU backend."); ours is that type too.
    with pytest.raises(ValueError, match="DeepSpeedCPULion"):
        FusedLion([torch.nn.Parameter(torch.ones(1))])


def test_unwrap_model_for_generation_gathers_a_zero3_model(pool2):
    from deepspeed_names_jobs import unwrap_for_generation

    seed = int(torch.randint(0, 2**31, ()))
    for result in pool2.run(unwrap_for_generation, seed):
        for whole, reference in zip(result["whole"], result["reference"]):
            torch.testing.assert_close(whole, reference, rtol=0, atol=0)
        w1, b1, w2, b2 = result["reference"]
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed + 1))
        expected = torch.tanh(x @ w1.t() + b1) @ w2.t() + b2
        for output in result["outputs"]:
            torch.testing.assert_close(output, expected, rtol=1e-6, atol=1e-6)
        assert result["after"] == ["NOT_AVAILABLE"] * 4  # partitioned again after the block
        # The gathering hooks are gone inside the block (DeepSpeed removes them) and back after.
        before, inside, after = result["hooks"]
        assert before > 0 and inside == 0 and after == before
        # Two SGD steps after the block match torch's on the whole model (identical data on
        # both ranks: the averaged gradient is the single-process one).
        reference = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
        )
        with torch.no_grad():
            for param, value in zip(reference.parameters(), result["reference"]):
                param.copy_(value)
        sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(2):
            sgd.zero_grad()
            reference(x).pow(2).mean().backward()
            sgd.step()
        for trained, expected in zip(result["trained"], reference.parameters()):
            torch.testing.assert_close(trained, expected.detach(), rtol=1e-5, atol=1e-6)
        assert result["clipping"] == 0.0  # deepspeed_cpp's default (DeepSpeed 0.19.8's is 1.0)


def test_precision_config_names_are_the_parsed_sections():
    from pydantic import ValidationError

    from deepspeed_cpp.runtime.config.sections import BF16Config, FP16Config
    from deepspeed_cpp.runtime.config_utils import DeepSpeedConfigModel
    from deepspeed_cpp.runtime.precision_config import (
        DeepSpeedFP16Config,
        get_bfloat16_config,
        get_float16_config,
    )

    assert DeepSpeedFP16Config is FP16Config and issubclass(FP16Config, DeepSpeedConfigModel)
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled is True
    assert isinstance(get_bfloat16_config({}), BF16Config)
    assert get_float16_config({"fp16": {"loss_scale": 128}}).loss_scale == 128
    with pytest.raises(ValidationError):
        DeepSpeedFP16Config(loss_scale=-1)
