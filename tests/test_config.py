"""The ds_config schema: DeepSpeed's configs load, bad ones fail with messages naming the key,
the value and what was expected, and the batch-size rule matches DeepSpeed's."""

import argparse
import base64
import inspect
import itertools
import json
import logging
import random
from pathlib import Path

import pytest
import torch

from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed_cpp.runtime.lr_schedules import build_lr_scheduler

CONFIGS = Path(__file__).parent / "configs"

# What each shipped config gives once finalised for 2 ranks (after the Hugging Face fills):
# the three batch numbers, or the refusal that finalize() must produce.
FINALIZED_AT_2_RANKS = {
    "cifar10_tutorial.json": (16, 8, 1),
    "zero2_bf16_adamw.json": (16, 4, 2),
    "zero1_sgd_onecycle.json": (96, 12, 4),
    "hf_zero1_auto.json": (48, 8, 3),
    "hf_zero2_auto.json": (48, 8, 3),
    "hf_zero3_auto.json": (48, 8, 3),
    "zero3_offload_nvme.json": (64, 8, 4),
}

# What the Hugging Face Trainer would fill (per_device_train_batch_size=8,
# gradient_accumulation_steps=3, 2 ranks, bf16, hidden size 64, 1000 steps with 10% warm-up).
HF_FILLS = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 3,
    "train_batch_size": 48,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 3e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.01,
    "scheduler.params.warmup_min_lr": 0,
    "scheduler.params.warmup_max_lr": 3e-5,
    "scheduler.params.warmup_num_steps": 100,
    "scheduler.params.total_num_steps": 1000,
    "fp16.enabled": False,
    "bf16.enabled": True,
    "zero_optimization.reduce_bucket_size": 64 * 64,
    "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
    "zero_optimization.stage3_param_persistence_threshold": 10 * 64,
}


@pytest.fixture
def ds_log(caplog):
    """Captures the 'deepspeed_cpp' logger, which does not propagate to the root logger."""
    from deepspeed_cpp.runtime.config.deepspeed_config import forget_warnings

    forget_warnings()  # warnings are once per key and process; each test counts its own
    logger = logging.getLogger("deepspeed_cpp")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="deepspeed_cpp")
    yield caplog
    logger.removeHandler(caplog.handler)


def _warnings_about(caplog, key: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and f"'{key}'" in r.getMessage()
    ]


def _error(config, world_size=None) -> str:
    with pytest.raises(DeepSpeedConfigError) as caught:
        parsed = DeepSpeedConfig.parse(config)
        if world_size is not None:
            parsed.finalize(world_size)
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


def _with_batch(**sections):
    return {"train_batch_size": 8, **sections}


# --- the shipped configs ----------------------------------------------------------------------


def test_every_shipped_config_has_an_expected_outcome():
    assert {p.name for p in CONFIGS.glob("*.json")} == set(FINALIZED_AT_2_RANKS)


@pytest.mark.parametrize("name", sorted(FINALIZED_AT_2_RANKS))
def test_shipped_config_loads_and_finalises_as_expected(name):
    path = CONFIGS / name
    config = DeepSpeedConfig.parse(path)
    assert config.raw == json.loads(path.read_text())
    config.fill_auto(HF_FILLS)
    assert config.auto_paths == ()
    expected = FINALIZED_AT_2_RANKS[name]
    if isinstance(expected, str):
        with pytest.raises(DeepSpeedConfigError, match=expected.replace(".", r"\.")):
            config.finalize(2)
        return
    final = config.finalize(2)
    got = (
        final.train_batch_size,
        final.train_micro_batch_size_per_gpu,
        final.gradient_accumulation_steps,
    )
    assert got == expected
    assert final.world_size == 2 and final.is_finalized and not config.is_finalized


def test_cifar10_tutorial_config_values_and_its_warnings_once_each(ds_log):
    config = DeepSpeedConfig.load(str(CONFIGS / "cifar10_tutorial.json"), world_size=4)
    assert (config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) == (4, 1)
    assert config.optimizer.type == "adam"
    assert config.optimizer.params["betas"] == (0.8, 0.999)
    assert config.optimizer.params["adam_w_mode"] is True  # DeepSpeed's default for "Adam"
    assert config.scheduler.type == "WarmupLR"
    assert config.scheduler.params["warmup_num_steps"] == 1000
    assert config.fp16.enabled and config.fp16.initial_scale_power == 15
    assert config.fp16.loss_scale_window == 500 and config.fp16.dynamic_loss_scale
    assert config.gradient_clipping == 1.0 and config.steps_per_print == 2000
    assert config.wall_clock_breakdown is False
    assert config.zero_optimization.stage == 0
    assert config.zero_optimization.reduce_bucket_size == 50_000_000
    assert config.zero_optimization.overlap_comm is True
    for key in (
        "prescale_gradients",
        "fp16.fp16_master_weights_and_grads",
        "zero_optimization.allgather_partitions",
        "zero_optimization.cpu_offload",
    ):
        assert len(_warnings_about(ds_log, key)) == 1, key


def test_zero3_config_keeps_every_stage3_and_offload_value():
    config = DeepSpeedConfig.parse(CONFIGS / "zero3_offload_nvme.json")
    zero = config.zero_optimization
    assert zero.stage == 3
    assert zero.prefetch_bucket_size == 50_000_000
    assert zero.param_persistence_threshold == 100_000
    assert zero.max_live_parameters == zero.max_reuse_distance == 1_000_000_000
    assert zero.gather_16bit_weights_on_model_save is True
    assert zero.offload_param.device == "nvme" and zero.offload_param.nvme_path == "/local_nvme"
    assert zero.offload_param.buffer_size == 100_000_000
    assert zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.pin_memory
    aio = config.aio  # a typed section now (it was ignored before NVMe offload)
    assert (aio.block_size, aio.queue_depth, aio.thread_count, aio.intra_op_parallelism) == (
        1048576, 8, 1, 1)  # fmt: skip
    assert (aio.single_submit, aio.overlap_events, aio.use_gds) == (False, True, False)
    final = DeepSpeedConfig.load(CONFIGS / "zero3_offload_nvme.json", world_size=8)
    assert final.zero_optimization.offload_param.device == "nvme"


# --- batch sizes: DeepSpeed's rule --------------------------------------------------------------


def _expected_batch(given: set, train: int, micro: int, accumulation: int, world: int):
    """DeepSpeed's derivation, written out case by case."""
    if {"train", "micro"} <= given or {"train", "acc"} <= given or {"micro", "acc"} <= given:
        return train, micro, accumulation
    if given == {"train"}:
        return train, train // world, 1
    if given == {"micro"}:
        return micro * world, micro, 1
    return None  # neither train_batch_size nor the micro batch: an error


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(
    "given",
    [set(c) for n in range(4) for c in itertools.combinations(("train", "micro", "acc"), n)],
)
def test_derived_batch_sizes_for_every_combination_of_given_keys(given, world):
    micro, accumulation = (int(v) for v in torch.randint(1, 10, (2,)))
    train = micro * accumulation * world
    names = {
        "train": ("train_batch_size", train),
        "micro": ("train_micro_batch_size_per_gpu", micro),
        "acc": ("gradient_accumulation_steps", accumulation),
    }
    config = dict(names[key] for key in given)
    expected = _expected_batch(given, train, micro, accumulation, world)
    if expected is None:
        message = _error(config, world_size=world)
        assert "train_batch_size and train_micro_batch_size_per_gpu are both missing" in message
        return
    final = DeepSpeedConfig.load(config, world_size=world)
    got = (
        final.train_batch_size,
        final.train_micro_batch_size_per_gpu,
        final.gradient_accumulation_steps,
    )
    assert got == expected
    assert got[0] == got[1] * got[2] * world


def test_contradicting_batch_numbers_name_all_three_and_the_world_size():
    config = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 3,
    }
    message = _error(config, world_size=2)
    for part in (
        "train_batch_size (32)",
        "train_micro_batch_size_per_gpu (4)",
        "gradient_accumulation_steps (3)",
        "world_size (2)",
        "= 24",
    ):
        assert part in message


@pytest.mark.parametrize(
    "config, world, expected",
    [
        ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, "multiple of 8"),
        ({"train_batch_size": 30, "gradient_accumulation_steps": 4}, 1, "multiple of 4"),
        ({"train_batch_size": 16}, 3, "multiple of 3"),
        ({"train_batch_size": 2, "train_micro_batch_size_per_gpu": 4}, 1, "multiple of 4"),
    ],
)
def test_non_divisible_derived_batch_numbers_are_errors(config, world, expected):
    message = _error(config, world_size=world)
    assert f"train_batch_size = {config['train_batch_size']} is not divisible" in message
    assert expected in message


def test_finalize_derives_again_for_each_world_size():
    parsed = DeepSpeedConfig.parse({"train_batch_size": 12})
    assert parsed.finalize(2).train_micro_batch_size_per_gpu == 6
    assert parsed.finalize(3).train_micro_batch_size_per_gpu == 4
    assert parsed.finalize(3).finalize(1).train_micro_batch_size_per_gpu == 12
    assert parsed.train_micro_batch_size_per_gpu is None


@pytest.mark.parametrize("world", [0, -1, 1.0, True, "2"])
def test_bad_world_size(world):
    message = _error({"train_batch_size": 4}, world_size=world)
    assert f"world_size = {world!r}: expected a positive integer" in message


# --- "auto" and the Hugging Face path ---------------------------------------------------------


def test_unresolved_auto_names_each_key_and_who_fills_it():
    config = DeepSpeedConfig.parse(CONFIGS / "hf_zero1_auto.json")
    assert set(config.auto_paths) == {
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "gradient_clipping",
        "fp16.enabled",
        "bf16.enabled",
    }
    with pytest.raises(DeepSpeedConfigError) as caught:
        config.finalize(2)
    message = str(caught.value)
    for path in config.auto_paths:
        assert f"'{path}'" in message
    assert "Hugging Face Trainer integration (TrainingArguments(deepspeed=...))" in message
    assert "fill_auto" in message


def test_auto_in_a_key_the_hf_integration_never_fills_says_so():
    config = DeepSpeedConfig.parse(_with_batch(zero_optimization={"stage": "auto"}))
    message = _error(config.raw, world_size=1)
    assert "does not fill 'zero_optimization.stage'" in message


def test_fill_auto_fills_only_auto_values_and_warns_no_more(ds_log):
    config = DeepSpeedConfig.parse(CONFIGS / "hf_zero2_auto.json")
    auto_before = set(config.auto_paths)
    assert len(_warnings_about(ds_log, "zero_optimization.allgather_partitions")) == 1
    filled = config.fill_auto({**HF_FILLS, "steps_per_print": 7, "not.a.key": 1})
    assert set(filled) == auto_before  # steps_per_print is not "auto"; not.a.key is absent
    assert len(_warnings_about(ds_log, "zero_optimization.allgather_partitions")) == 1
    assert config.steps_per_print == 2000
    assert config.optimizer.params["lr"] == 3e-5
    assert config.optimizer.params["betas"] == (0.9, 0.999)
    assert config.bf16.enabled is True and config.fp16.enabled is False
    assert config.raw["optimizer"]["params"]["lr"] == 3e-5
    assert config.scheduler.params["warmup_num_steps"] == 100


def test_fill_auto_with_a_bad_value_changes_nothing():
    config = DeepSpeedConfig.parse(CONFIGS / "hf_zero2_auto.json")
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer\.params\.lr = -1"):
        config.fill_auto({"optimizer.params.lr": -1})
    assert config.optimizer.params["lr"] == "auto"
    assert "optimizer.params.lr" in config.auto_paths


def test_auto_values_are_kept_as_auto_until_filled():
    config = DeepSpeedConfig.parse(CONFIGS / "hf_zero3_auto.json")
    assert config.train_batch_size == "auto"
    assert config.zero_optimization.prefetch_bucket_size == "auto"
    assert config.scheduler.params["total_num_steps"] == "auto"


# --- warnings: once each ------------------------------------------------------------------------


def test_deprecated_and_harmless_keys_warn_exactly_once_through_load_and_finalize(ds_log):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "bfloat16": {"enabled": True},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "fused_mode": True},
        "zero_optimization": {
            "stage": 2,
            "cpu_offload": False,
            "allgather_partitions": True,
            "elastic_checkpoint": False,
            "stage3_gather_fp16_weights_on_model_save": True,
        },
        "tensorboard": {"enabled": True, "output_path": "runs"},
    }
    final = DeepSpeedConfig.load(config, world_size=2).finalize(2).finalize(1)
    assert final.bf16.enabled is True
    assert final.zero_optimization.gather_16bit_weights_on_model_save is True
    assert final.zero_optimization.offload_optimizer is None
    for key in (
        "prescale_gradients",
        "gradient_predivide_factor",
        "bfloat16",
        "fp16.fp16_master_weights_and_grads",
        "fp16.fused_mode",
        "zero_optimization.cpu_offload",
        "zero_optimization.allgather_partitions",
        "zero_optimization.elastic_checkpoint",
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    ):
        assert len(_warnings_about(ds_log, key)) == 1, key
    # tensorboard is honoured now (issue 30): no warning, a typed section.
    assert not _warnings_about(ds_log, "tensorboard")
    assert final.tensorboard.enabled is True and final.tensorboard.output_path == "runs"
    assert len(ds_log.records) == 9


def test_deprecated_spelling_given_with_its_current_key_is_an_error():
    message = _error(_with_batch(bf16={"enabled": True}, bfloat16={"enabled": True}))
    assert "both 'bfloat16' and 'bf16' are given" in message
    message = _error(
        _with_batch(
            zero_optimization={
                "stage3_gather_fp16_weights_on_model_save": True,
                "stage3_gather_16bit_weights_on_model_save": False,
            }
        )
    )
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in message


def test_legacy_boolean_zero_optimization_means_stage_1(ds_log):
    config = DeepSpeedConfig.load(
        {"train_batch_size": 4, "zero_optimization": True, "allgather_size": 1e6}
    )
    assert config.zero_optimization.stage == 1
    assert config.zero_optimization.allgather_bucket_size == 1_000_000
    assert len(_warnings_about(ds_log, "zero_optimization")) == 1


def test_cpu_offload_true_becomes_offload_optimizer_and_finalizes():
    config = DeepSpeedConfig.parse(_with_batch(zero_optimization={"stage": 2, "cpu_offload": True}))
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.finalize(1).zero_optimization.offload_optimizer.device == "cpu"


@pytest.mark.parametrize(
    "offload, extra, expected",
    [
        # unset: wherever the engine can (clipping off: its default, 1.0, excludes it)
        ({"device": "nvme", "nvme_path": "/x"}, {"gradient_clipping": 0}, None),
        ({"device": "nvme", "nvme_path": "/x"}, {}, False),
        ({"device": "nvme", "nvme_path": "/x"}, {"gradient_clipping": 1.0}, False),
        ({"device": "nvme", "nvme_path": "/x"}, {"fp16": {"enabled": True}}, False),
        ({"device": "nvme", "nvme_path": "/x", "ratio": 0.5}, {}, False),
        ({"device": "cpu"}, {}, False),
        ({"device": "cpu", "step_during_backward": True}, {"gradient_clipping": 0}, True),
        ({"device": "nvme", "nvme_path": "/x", "step_during_backward": False}, {}, False),
    ],
)
def test_step_during_backward_defaults_to_on_for_nvme_where_nothing_excludes_it(
    offload, extra, expected
):
    config = DeepSpeedConfig.load(
        _with_batch(zero_optimization={"stage": 2, "offload_optimizer": offload}, **extra)
    )
    assert config.step_during_backward_setting() is expected


def test_step_during_backward_true_names_the_default_clipping_it_conflicts_with():
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "step_during_backward": True}}
    with pytest.raises(DeepSpeedConfigError) as error:
        DeepSpeedConfig.load(_with_batch(zero_optimization=zero))
    assert "gradient_clipping = 1.0, the default (clipping needs the global" in str(error.value)
    assert "gradient_clipping = 0 turns it off" in str(error.value)


def test_adamw_ignores_adam_w_mode_false_with_a_warning(ds_log):
    config = DeepSpeedConfig.parse(
        _with_batch(optimizer={"type": "adamw", "params": {"adam_w_mode": False}})
    )
    assert config.optimizer.type == "adamw"
    assert config.optimizer.params["adam_w_mode"] is True
    assert len(_warnings_about(ds_log, "optimizer.params.adam_w_mode")) == 1


# --- unknown keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"train_batch_sise": 8},
            "unknown key 'train_batch_sise' (value 8): did you mean 'train_batch_size'?",
        ),
        (
            _with_batch(zero_optimization={"stag": 2}),
            "unknown key 'zero_optimization.stag' (value 2): did you mean "
            "'zero_optimization.stage'?",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"weight_dacay": 0.1}}),
            "unknown key 'optimizer.params.weight_dacay' (value 0.1): did you mean "
            "'optimizer.params.weight_decay'?",
        ),
        (
            _with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_steps": 10}}),
            "unknown key 'scheduler.params.warmup_steps' (value 10): did you mean "
            "'scheduler.params.warmup_num_steps'?",
        ),
        (
            _with_batch(tensorboard={"enable": True}),
            "unknown key 'tensorboard.enable' (value true): did you mean 'tensorboard.enabled'?",
        ),
        (
            _with_batch(checkpoint={"tag_validaton": "Warn"}),
            "unknown key 'checkpoint.tag_validaton' (value \"Warn\"): did you mean "
            "'checkpoint.tag_validation'?",
        ),
        (
            _with_batch(zero_optimization={"offload_optimizer": {"devise": "cpu"}}),
            "did you mean 'zero_optimization.offload_optimizer.device'?",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "gradient_clipping": 1.0}),
            "unknown key 'optimizer.gradient_clipping' (value 1.0): 'gradient_clipping' "
            "belongs at the top level",
        ),
        (
            _with_batch(load_universal=True),
            "unknown key 'load_universal' (value true): 'load_universal' belongs in 'checkpoint'",
        ),
        (
            _with_batch(fp16={"enabled": True, "Loss_Scale": 0}),
            "did you mean 'fp16.loss_scale'?",
        ),
    ],
)
def test_unknown_key_is_named_with_the_nearest_valid_key(config, expected):
    assert expected in _error(config)


def test_every_problem_is_reported_at_once():
    message = _error(
        {
            "train_batch_size": 0,
            "zero_optimization": {"stag": 2},
            "optimizer": {"type": "Adam", "params": {"lr": -1.0}, "gradient_clipping": 1.0},
            "prescale_gradients": True,
        }
    )
    assert "4 problems" not in message and "5 problems" in message
    for part in (
        "train_batch_size = 0",
        "'zero_optimization.stag'",
        "optimizer.params.lr = -1.0",
        "'optimizer.gradient_clipping'",
        "prescale_gradients = true",
    ):
        assert part in message


def test_keys_from_deepspeeds_documentation_are_never_unknown():
    # Written from https://www.deepspeed.ai/docs/config-json/, each at a value that asks for
    # DeepSpeed's default behaviour.
    config = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10,
        "dump_state": False,
        "wall_clock_breakdown": False,
        "memory_breakdown": False,
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "communication_data_type": None,
        "sparse_gradients": False,
        "disable_allgather": False,
        "zero_allow_untested_optimizer": False,
        "zero_force_ds_cpu_optimizer": True,
        "gradient_clipping": 0.0,
        "dataloader_drop_last": False,
        "fp16": {
            "enabled": False,
            "auto_cast": False,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "consecutive_hysteresis": False,
            "min_loss_scale": 1,
            "fp16_master_weights_and_grads": False,
        },
        "bf16": {"enabled": False, "immediate_grad_update": False},
        "amp": {"enabled": False, "opt_level": "O1"},
        "zero_optimization": {
            "stage": 0,
            "allgather_partitions": True,
            "allgather_bucket_size": 5e8,
            "overlap_comm": False,
            "reduce_scatter": True,
            "reduce_bucket_size": 5e8,
            "contiguous_gradients": True,
            "load_from_fp32_weights": True,
            "round_robin_gradients": False,
            "elastic_checkpoint": False,
            "ignore_unused_parameters": True,
            "legacy_stage1": False,
            "sub_group_size": 1e9,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": False,
            "stage3_module_granularity_threshold": 0,
            "zero_hpz_partition_size": 1,
            "zero_quantized_weights": False,
            "zero_quantized_gradients": False,
            "mics_shard_size": -1,
            "mics_hierarchical_params_gather": False,
            "log_trace_cache_warnings": False,
        },
        "aio": {
            "block_size": 1048576,
            "queue_depth": 8,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": False,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
            "synchronize_checkpoint_boundary": False,
            "profile": False,
        },
        "flops_profiler": {
            "enabled": False,
            "profile_step": 1,
            "module_depth": -1,
            "top_modules": 1,
            "detailed": True,
            "output_file": None,
        },
        "autotuning": {"enabled": False, "results_dir": "autotuning_results", "fast": True},
        "elasticity": {"enabled": False, "max_train_batch_size": 2000},
        "tensorboard": {"enabled": False, "output_path": None, "job_name": "DeepSpeedJobName"},
        "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
        "csv_monitor": {"enabled": False, "output_path": None, "job_name": "DeepSpeedJobName"},
        "comet": {"enabled": False, "project": None, "samples_log_interval": 100},
        "comms_logger": {"enabled": False, "verbose": False, "prof_all": True, "debug": False},
        "checkpoint": {
            "tag_validation": "Warn",
            "load_universal": False,
            "use_node_local_storage": False,
            "parallel_write": {"pipeline_stage": False},
        },
        "data_types": {"grad_accum_dtype": None},
        "data_efficiency": {"enabled": False, "seed": 1234},
        "curriculum_learning": {"enabled": False},
        "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
        "sparse_attention": {"mode": "fixed", "block": 16},
        "pipeline": {"stages": "auto", "partition": "best"},
        "torch_autocast": {"enabled": False},
        "tensor_parallel": {"autotp_size": 0},
        "hybrid_engine": {"enabled": False},
    }
    final = DeepSpeedConfig.load(config)  # pipeline.stages "auto" is DeepSpeed's own value
    assert final.train_micro_batch_size_per_gpu == 8
    assert final.raw == config


# --- not supported yet -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (_with_batch(prescale_gradients=True), "prescale_gradients = true: not supported yet"),
        (
            _with_batch(gradient_predivide_factor=8),
            "gradient_predivide_factor = 8: not supported yet",
        ),
        (_with_batch(amp={"enabled": True}), 'amp = {"enabled": true}: not supported yet'),
        (
            _with_batch(communication_data_type="fp16"),
            'communication_data_type = "fp16": not supported yet',
        ),
        (
            _with_batch(checkpoint={"load_universal": True}),
            "checkpoint.load_universal = true: not supported yet",
        ),
        (
            _with_batch(zero_optimization={"zero_quantized_weights": True}),
            "zero_optimization.zero_quantized_weights = true: not supported yet",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"amsgrad": True}}),
            "optimizer.params.amsgrad = true: not supported yet",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}),
            "optimizer.params.max_grad_norm = 1.0: not supported yet",
        ),
        (
            _with_batch(elasticity={"enabled": True, "max_train_batch_size": 64}),
            "elasticity = ",
        ),
        (
            _with_batch(
                compression_training={"sparse_pruning": {"shared_parameters": {"enabled": True}}}
            ),
            "compression_training = ",
        ),
        (
            _with_batch(optimizer={"type": "Lamb"}),
            "DeepSpeed's Lamb optimizer is not supported yet",
        ),
        (
            _with_batch(optimizer={"type": "OneBitAdam"}),
            "OneBitAdam optimizer is not supported yet",
        ),
        (_with_batch(optimizer={"type": "adagrad"}), "Adagrad optimizer is not supported yet"),
        (_with_batch(optimizer={"type": "Lamb"}), "Lamb optimizer is not supported yet"),
        (_with_batch(optimizer={"type": "RMSprop"}), "torch.optim.RMSprop from the config is not"),
        (
            _with_batch(scheduler={"type": "CosineAnnealingLR"}),
            "torch.optim.lr_scheduler.CosineAnnealingLR from the config is not supported yet",
        ),
    ],
)
def test_deepspeed_features_not_built_yet_are_refused_by_name(config, expected):
    message = _error(config)
    assert expected in message
    assert "not supported yet" in message


@pytest.mark.parametrize(
    "zero, expected",
    [
        (
            {"stage": 2, "offload_optimizer": {"device": "cpu", "super_offload": True}},
            "zero_optimization.offload_optimizer.super_offload = true: DeepSpeed's SuperOffload",
        ),
    ],
)
def test_offload_parses_but_is_refused_at_finalize(zero, expected):
    config = DeepSpeedConfig.parse(_with_batch(zero_optimization=zero))
    assert config.zero_optimization.stage == zero["stage"]
    assert expected in _error(config.raw, world_size=1)


def test_stage3_is_accepted():
    config = DeepSpeedConfig.load(_with_batch(zero_optimization={"stage": 3}), world_size=1)
    assert config.zero_optimization.stage == 3


def test_flops_profiler_profile_step_0_is_accepted():
    """DeepSpeed profiles the first step with profile_step 0 (its default 1 only skips warm-up)."""
    config = DeepSpeedConfig.load(_with_batch(flops_profiler={"profile_step": 0}), world_size=1)
    assert config.flops_profiler.profile_step == 0


def test_offload_device_none_is_accepted():
    config = DeepSpeedConfig.load(
        _with_batch(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}})
    )
    assert config.zero_optimization.offload_devices() == {}


# --- types and ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            _with_batch(zero_optimization={"stage": 4}),
            "zero_optimization.stage = 4: expected an integer in [0, 3]",
        ),
        (
            _with_batch(zero_optimization={"stage": "2"}),
            'zero_optimization.stage = "2": expected an integer',
        ),
        (
            _with_batch(zero_optimization={"stage": True}),
            "zero_optimization.stage = true: expected an integer",
        ),
        (
            _with_batch(zero_optimization={"reduce_bucket_size": 2.5}),
            "zero_optimization.reduce_bucket_size = 2.5: expected an integer >= 1",
        ),
        (
            _with_batch(zero_optimization={"reduce_bucket_size": 0}),
            "zero_optimization.reduce_bucket_size = 0: expected an integer >= 1",
        ),
        (
            _with_batch(zero_optimization={"overlap_comm": 1}),
            "zero_optimization.overlap_comm = 1: expected true or false",
        ),
        (
            _with_batch(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
            'zero_optimization.offload_optimizer.device = "gpu": '
            "expected one of 'none', 'cpu', 'nvme'",
        ),
        (
            _with_batch(zero_optimization={"offload_param": {"device": "nvme"}}),
            'device "nvme" needs "nvme_path"',
        ),
        (
            _with_batch(zero_optimization={"offload_optimizer": {"ratio": 1.5}}),
            "zero_optimization.offload_optimizer.ratio = 1.5: expected a number",
        ),
        (_with_batch(zero_optimization=[2]), "zero_optimization = [2]: expected a JSON object"),
        (_with_batch(fp16={"enabled": "true"}), 'fp16.enabled = "true": expected true or false'),
        (_with_batch(fp16={"loss_scale": -1}), "fp16.loss_scale = -1: expected a number >= 0.0"),
        (_with_batch(fp16={"hysteresis": 0}), "fp16.hysteresis = 0: expected an integer >= 1"),
        (
            _with_batch(fp16={"initial_scale_power": 200}),
            "fp16.initial_scale_power = 200: expected an integer in [0, 127]",
        ),
        (_with_batch(gradient_clipping=-1.0), "gradient_clipping = -1.0: expected a number >= 0.0"),
        (
            _with_batch(gradient_clipping=float("nan")),
            "gradient_clipping = NaN: expected a number >= 0.0",
        ),
        (_with_batch(steps_per_print=0), "steps_per_print = 0: expected an integer >= 1"),
        (
            _with_batch(flops_profiler={"profile_step": -1}),
            "flops_profiler.profile_step = -1: expected an integer >= 0",
        ),
        ({"train_batch_size": -4}, "train_batch_size = -4: expected an integer >= 1, or null"),
        (_with_batch(optimizer={"params": {"lr": 1.0}}), "optimizer.type is required"),
        (
            _with_batch(optimizer={"type": 3}),
            "optimizer.type = 3: expected the optimizer's name as a string",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"lr": -1}}),
            "optimizer.params.lr = -1: expected a number >= 0.0",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"betas": [0.9]}}),
            "optimizer.params.betas = [0.9]: expected a list of two numbers, each in [0, 1)",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"betas": [0.9, 1.0]}}),
            "optimizer.params.betas = [0.9, 1.0]: expected a list of two numbers",
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": {"eps": "1e-8"}}),
            'optimizer.params.eps = "1e-8": expected a number >= 0.0',
        ),
        (
            _with_batch(optimizer={"type": "Adam", "params": [0.1]}),
            "optimizer.params = [0.1]: expected a JSON object",
        ),
        (
            _with_batch(optimizer={"type": "SGD", "params": {"nesterov": True}}),
            "nesterov: true needs momentum > 0 and dampening = 0",
        ),
        (
            _with_batch(optimizer={"type": "Adamw2"}),
            "unknown optimizer type; did you mean 'AdamW'?",
        ),
        (
            _with_batch(scheduler={"type": "warmuplr"}),
            "did you mean 'WarmupLR' (names are case-sensitive)?",
        ),
        (
            _with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
            "scheduler.params.warmup_type = \"cosine\": expected one of 'log', 'linear'",
        ),
        (
            _with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}}),
            "scheduler.params.warmup_num_steps = 0: expected an integer >= 1",
        ),
        (
            _with_batch(scheduler={"type": "WarmupDecayLR", "params": {}}),
            "scheduler.params.total_num_steps is required by WarmupDecayLR",
        ),
        (
            _with_batch(
                scheduler={
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 10, "warmup_num_steps": 20},
                }
            ),
            "total_num_steps (10) must be >= warmup_num_steps (20)",
        ),
        (
            _with_batch(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}),
            "scheduler.params.cycle_max_lr is required by OneCycle",
        ),
        (
            _with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": []}}),
            "scheduler.params.warmup_max_lr = []: expected a number >= 0.0 or a non-empty list",
        ),
        (
            _with_batch(fp16={"enabled": True}, bf16={"enabled": True}),
            "fp16.enabled = true and bf16.enabled = true: expected at most one of them",
        ),
        (_with_batch(tensorboard=True), "tensorboard = true: expected a JSON object"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_was_expected(config, expected):
    assert expected in _error(config)


def test_integral_floats_are_integers():
    config = DeepSpeedConfig.load(
        {
            "train_batch_size": 8.0,
            "zero_optimization": {"reduce_bucket_size": 5e8, "stage3_max_live_parameters": 3e9},
        }
    )
    assert config.train_batch_size == 8 and type(config.train_batch_size) is int
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert type(config.zero_optimization.reduce_bucket_size) is int
    assert config.zero_optimization.max_live_parameters == 3_000_000_000


# --- optimizer and scheduler params -----------------------------------------------------------


def _torch_defaults(optimizer_class) -> dict:
    return {
        name: p.default
        for name, p in inspect.signature(optimizer_class.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("spelling", ["Adam", "adam", "ADAM"])
def test_adam_params_get_torch_adams_defaults_and_adam_w_mode(spelling):
    config = DeepSpeedConfig.parse(_with_batch(optimizer={"type": spelling}))
    params = config.optimizer.params
    reference = _torch_defaults(torch.optim.Adam)
    assert config.optimizer.type == "adam"
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert params[name] == pytest.approx(reference[name]), name
    assert params["adam_w_mode"] is True  # DeepSpeed's "Adam" decays weights decoupled
    assert params["bias_correction"] is True and params["torch_adam"] is False
    classic = DeepSpeedConfig.parse(
        _with_batch(optimizer={"type": spelling, "params": {"adam_w_mode": False}})
    )
    assert classic.optimizer.params["adam_w_mode"] is False


def test_sgd_params_build_torchs_sgd():
    lr, momentum = (float(v) for v in torch.rand(2) * 0.5 + 0.01)
    config = DeepSpeedConfig.parse(
        _with_batch(optimizer={"type": "sgd", "params": {"lr": lr, "momentum": momentum}})
    )
    assert config.optimizer.type == "sgd"
    reference = _torch_defaults(torch.optim.SGD)
    for name in ("dampening", "weight_decay", "nesterov"):
        assert config.optimizer.params[name] == reference[name], name
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], **config.optimizer.params)
    assert optimizer.param_groups[0]["lr"] == lr
    assert optimizer.param_groups[0]["momentum"] == momentum


@pytest.mark.parametrize(
    "name, params",
    [
        ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 7}),
        ("WarmupDecayLR", {"total_num_steps": 50, "warmup_num_steps": 5}),
        ("WarmupCosineLR", {"total_num_steps": 50, "warmup_num_steps": 5, "warmup_min_ratio": 0.1}),
        ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 9}),
        ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 3}),
    ],
)
def test_scheduler_params_get_defaults_and_build_the_schedule(name, params):
    config = DeepSpeedConfig.parse(_with_batch(scheduler={"type": name, "params": params}))
    assert config.scheduler.type == name
    for key, value in params.items():
        assert config.scheduler.params[key] == value
    assert config.scheduler.params["last_batch_iteration"] == -1
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.01, momentum=0.9)
    schedule = build_lr_scheduler(config.scheduler.type, config.scheduler.params, optimizer)
    for _ in range(5):
        schedule.step()
    assert all(group["lr"] >= 0 for group in optimizer.param_groups)


def test_scheduler_defaults_are_deepspeeds():
    warmup = DeepSpeedConfig.parse(_with_batch(scheduler={"type": "WarmupLR"})).scheduler
    assert warmup.params == {
        "last_batch_iteration": -1,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,  # the optimizer's lr
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    }
    decay = DeepSpeedConfig.parse(
        _with_batch(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}})
    ).scheduler
    assert decay.params["warmup_max_lr"] == 0.001
    cosine = DeepSpeedConfig.parse(
        _with_batch(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}})
    ).scheduler
    assert cosine.params["cos_min_ratio"] == 0.0001 and cosine.params["warmup_min_ratio"] == 0.0


# --- where the config comes from -----------------------------------------------------------------


def test_args_deepspeed_config_path_and_dict_beside_none(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    from_args = DeepSpeedConfig.load(args=argparse.Namespace(deepspeed_config=str(path)))
    assert from_args.train_batch_size == 3 and from_args.source == str(path)
    beside = DeepSpeedConfig.load(
        config={"train_batch_size": 6}, args=argparse.Namespace(deepspeed_config=None), world_size=3
    )
    assert beside.train_micro_batch_size_per_gpu == 2
    assert DeepSpeedConfig.load(config=path).train_batch_size == 3


def test_config_given_twice_or_not_at_all():
    with pytest.raises(DeepSpeedConfigError, match="the config is given twice"):
        DeepSpeedConfig.load(
            config={"train_batch_size": 2}, args=argparse.Namespace(deepspeed_config="x.json")
        )
    with pytest.raises(DeepSpeedConfigError, match="no config given"):
        DeepSpeedConfig.load(args=argparse.Namespace(deepspeed_config=None))


def test_deprecated_deepscale_config_argument(tmp_path, ds_log):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2}))
    config = DeepSpeedConfig.load(args=argparse.Namespace(deepscale_config=str(path)))
    assert config.train_batch_size == 2
    assert any("deepscale_config is deprecated" in r.getMessage() for r in ds_log.records)


def test_base64_config_as_deepspeeds_launcher_passes_it():
    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 4}).encode()).decode()
    assert DeepSpeedConfig.load(encoded, world_size=2).train_micro_batch_size_per_gpu == 2


def test_comments_and_trailing_commas_are_accepted_with_a_warning(tmp_path, ds_log):
    path = tmp_path / "commented.json"
    path.write_text(
        '{\n  // batch\n  "train_batch_size": 4, # per step\n'
        '  "fp16": {"enabled": false, /* off */},\n}\n'
    )
    config = DeepSpeedConfig.load(path)
    assert config.train_batch_size == 4 and config.fp16.enabled is False
    assert any("comments or trailing commas" in r.getMessage() for r in ds_log.records)


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"train_batch_size": 4, "train_batch_size": 8}', "duplicate keys ['train_batch_size']"),
        ('{"train_batch_size": 4,\n "fp16": {"enabled": tru}}', "not valid JSON"),
        ("[1, 2]", "the top level is list: expected a JSON object"),
    ],
)
def test_bad_files(tmp_path, text, expected):
    path = tmp_path / "bad.json"
    path.write_text(text)
    message = _error(path)
    assert expected in message and str(path) in message


def test_missing_file_and_bad_config_type():
    assert "no such file" in _error("/nonexistent/ds_config.json")
    assert "expected the path of a JSON file, a dict" in _error(42)


def test_raw_is_a_private_copy_of_what_was_given():
    given = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    config = DeepSpeedConfig.parse(given)
    given["optimizer"]["params"]["lr"] = 0.5
    assert config.raw["optimizer"]["params"]["lr"] == 0.1
    config.raw["optimizer"]["params"]["lr"] = 0.7
    assert config.raw["optimizer"]["params"]["lr"] == 0.1
    assert config.optimizer.params["lr"] == 0.1
    assert config.finalize(2).raw == config.raw


def test_offload_optimizer_tuning_keys_without_effect_warn_once_each(ds_log):
    part = {"device": "cpu", "fast_init": True, "convert_grad_on_cpu": False,
            "cpuadam_cores_perc": 0.5}  # fmt: skip
    DeepSpeedConfig.load(_with_batch(zero_optimization={"stage": 2, "offload_optimizer": part}))
    said = [
        r.getMessage() for r in ds_log.records if "has no effect in deepspeed_cpp" in r.getMessage()
    ]
    assert len(said) == 3
    for key in ("fast_init = true", "convert_grad_on_cpu = false", "cpuadam_cores_perc = 0.5"):
        assert sum(key in message for message in said) == 1, key


def test_offload_param_needs_offload_optimizer_and_max_in_cpu_warns(ds_log):
    param = {"device": "nvme", "nvme_path": "/nvme", "max_in_cpu": 10}
    adam = {"type": "AdamW", "params": {"lr": 1e-3}}
    message = _error(
        _with_batch(zero_optimization={"stage": 3, "offload_param": param}, optimizer=adam)
    )
    assert (
        'zero_optimization.offload_param.device = "nvme" needs offload_optimizer.device "cpu" '
        'or "nvme" too in deepspeed_cpp when there is an optimizer' in message
    )
    # Without an optimizer (ZeRO Inference, the guide's t0.py) nothing is stepped: accepted.
    DeepSpeedConfig.load(_with_batch(zero_optimization={"stage": 3, "offload_param": param}))
    zero = {"stage": 3, "offload_param": param, "offload_optimizer": {"device": "cpu"}}
    DeepSpeedConfig.load(_with_batch(zero_optimization=zero))
    said = [
        r.getMessage() for r in ds_log.records if "max_in_cpu = 10 has no effect" in r.getMessage()
    ]
    assert len(said) == 1


@pytest.mark.parametrize("rank", ["0", "1"])
def test_the_guides_templates_warn_on_rank_0_only(ds_log, monkeypatch, rank):
    """Every rank reads the same config (initialize() refuses ranks whose configs differ), so a
    warning about it is said by rank 0 alone: the guide's ZeRO-2 template used to draw its two
    ignored-key warnings once on every rank. A key each rank may set for its own machine
    (cpuadam_cores_perc) keeps its warning on every rank, with the rank's number."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "the rank is the launcher's RANK before a group exists"
    monkeypatch.setenv("RANK", rank)
    template = json.loads((Path(__file__).parent / "configs" / "hf_zero2_auto.json").read_text())
    DeepSpeedConfig.parse(template)
    ignored = _warnings_about(ds_log, "zero_optimization.allgather_partitions")
    assert len(ignored) == (1 if rank == "0" else 0)
    offload = {"device": "cpu", "fast_init": True, "cpuadam_cores_perc": 0.5}
    DeepSpeedConfig.load(_with_batch(zero_optimization={"stage": 2, "offload_optimizer": offload}))
    messages = [r.getMessage() for r in ds_log.records]
    assert sum("fast_init = true" in m for m in messages) == (1 if rank == "0" else 0)
    local = [m for m in messages if "cpuadam_cores_perc = 0.5" in m]
    assert local == [m for m in local if m.startswith("rank 1: ") or rank == "0"]
    assert len(local) == 1


def test_pipeline_section_is_typed(ds_log):
    """The keys DeepSpeed's PipelineEngine reads: typed ("auto" stages is DeepSpeed's own value,
    not a placeholder), checked by name, and each one's use said (runtime/pipe/engine.py reads
    them; tests/test_pipe.py checks stages and activation_checkpoint_interval in a pipeline)."""
    config = DeepSpeedConfig.load(_with_batch(pipeline={"stages": "auto", "use_reentrant": False}))
    assert config.pipeline.stages == "auto" and config.pipeline.activation_checkpoint_interval == 0
    assert config.auto_paths == ()
    assert DeepSpeedConfig.load(_with_batch(pipeline={"stages": 4})).pipeline.stages == 4
    assert not _warnings_about(ds_log, "pipeline.use_reentrant")
    DeepSpeedConfig.load(_with_batch(pipeline={"use_reentrant": True, "seed_layers": True}))
    assert "non-reentrant" in _warnings_about(ds_log, "pipeline.use_reentrant")[0]
    assert "PipelineModule(seed_layers" in _warnings_about(ds_log, "pipeline.seed_layers")[0]
    for section, expected in [
        ({"stages": 0}, "pipeline.stages = 0: expected an integer >= 1"),
        ({"activation_checkpoint_interval": -1}, "expected an integer >= 0"),
        ({"pipe_partitioned": "yes"}, "pipeline.pipe_partitioned"),
        ({"micro_batches": 4}, "unknown key 'pipeline.micro_batches'"),
    ]:
        with pytest.raises(DeepSpeedConfigError, match=expected.replace("(", r"\(")):
            DeepSpeedConfig.load(_with_batch(pipeline=section))


def test_fp16_loss_scale_reads_a_numeric_string_as_deepspeed_does():
    """DeepSpeed reads ``fp16.loss_scale`` with ``float(value)``: "3" is 3.0; what is not a finite
    number >= 0 is still refused, by name."""
    from deepspeed_cpp.runtime.precision_config import DeepSpeedFP16Config

    scale = random.choice([1, 3, 128, 0.5])
    config = DeepSpeedConfig.load(_with_batch(fp16={"enabled": True, "loss_scale": str(scale)}))
    assert config.fp16.loss_scale == float(scale) and not config.fp16.dynamic_loss_scale
    assert DeepSpeedFP16Config(loss_scale="0").dynamic_loss_scale
    for bad in ("inf", "nan", "-1", "three", True, []):
        with pytest.raises(DeepSpeedConfigError, match=r"fp16\.loss_scale = .*expected a number"):
            DeepSpeedConfig.load(_with_batch(fp16={"enabled": True, "loss_scale": bad}))
