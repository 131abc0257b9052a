"""The ds_config schema: DeepSpeed's configs load and finalise, the batch-size rule matches
DeepSpeed's, "auto" values wait for the Hugging Face fills, and warnings come once each.

Refused configs: test_config_refusals.py; where a config comes from: test_config_sources.py."""

import inspect
import itertools
import json
from pathlib import Path

import pytest
import torch
from config_helpers import config_error, warnings_about, with_batch

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
        assert len(warnings_about(ds_log, key)) == 1, key


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
        message = config_error(config, world_size=world)
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
    message = config_error(config, world_size=2)
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
    message = config_error(config, world_size=world)
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
    message = config_error({"train_batch_size": 4}, world_size=world)
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
    config = DeepSpeedConfig.parse(with_batch(zero_optimization={"stage": "auto"}))
    message = config_error(config.raw, world_size=1)
    assert "does not fill 'zero_optimization.stage'" in message


def test_fill_auto_fills_only_auto_values_and_warns_no_more(ds_log):
    config = DeepSpeedConfig.parse(CONFIGS / "hf_zero2_auto.json")
    auto_before = set(config.auto_paths)
    assert len(warnings_about(ds_log, "zero_optimization.allgather_partitions")) == 1
    filled = config.fill_auto({**HF_FILLS, "steps_per_print": 7, "not.a.key": 1})
    assert set(filled) == auto_before  # steps_per_print is not "auto"; not.a.key is absent
    assert len(warnings_about(ds_log, "zero_optimization.allgather_partitions")) == 1
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
        assert len(warnings_about(ds_log, key)) == 1, key
    # tensorboard is honoured now (issue 30): no warning, a typed section.
    assert not warnings_about(ds_log, "tensorboard")
    assert final.tensorboard.enabled is True and final.tensorboard.output_path == "runs"
    assert len(ds_log.records) == 9


def test_deprecated_spelling_given_with_its_current_key_is_an_error():
    message = config_error(with_batch(bf16={"enabled": True}, bfloat16={"enabled": True}))
    assert "both 'bfloat16' and 'bf16' are given" in message
    message = config_error(
        with_batch(
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
    assert len(warnings_about(ds_log, "zero_optimization")) == 1


def test_cpu_offload_true_becomes_offload_optimizer_and_finalizes():
    config = DeepSpeedConfig.parse(with_batch(zero_optimization={"stage": 2, "cpu_offload": True}))
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
        with_batch(zero_optimization={"stage": 2, "offload_optimizer": offload}, **extra)
    )
    assert config.step_during_backward_setting() is expected


def test_step_during_backward_true_names_the_default_clipping_it_conflicts_with():
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "step_during_backward": True}}
    with pytest.raises(DeepSpeedConfigError) as error:
        DeepSpeedConfig.load(with_batch(zero_optimization=zero))
    assert "gradient_clipping = 1.0, the default (clipping needs the global" in str(error.value)
    assert "gradient_clipping = 0 turns it off" in str(error.value)


def test_adamw_ignores_adam_w_mode_false_with_a_warning(ds_log):
    config = DeepSpeedConfig.parse(
        with_batch(optimizer={"type": "adamw", "params": {"adam_w_mode": False}})
    )
    assert config.optimizer.type == "adamw"
    assert config.optimizer.params["adam_w_mode"] is True
    assert len(warnings_about(ds_log, "optimizer.params.adam_w_mode")) == 1


# --- optimizer and scheduler params -----------------------------------------------------------


def _torch_defaults(optimizer_class) -> dict:
    return {
        name: p.default
        for name, p in inspect.signature(optimizer_class.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("spelling", ["Adam", "adam", "ADAM"])
def test_adam_params_get_torch_adams_defaults_and_adam_w_mode(spelling):
    config = DeepSpeedConfig.parse(with_batch(optimizer={"type": spelling}))
    params = config.optimizer.params
    reference = _torch_defaults(torch.optim.Adam)
    assert config.optimizer.type == "adam"
    for name in ("lr", "betas", "eps", "weight_decay"):
        assert params[name] == pytest.approx(reference[name]), name
    assert params["adam_w_mode"] is True  # DeepSpeed's "Adam" decays weights decoupled
    assert params["bias_correction"] is True and params["torch_adam"] is False
    classic = DeepSpeedConfig.parse(
        with_batch(optimizer={"type": spelling, "params": {"adam_w_mode": False}})
    )
    assert classic.optimizer.params["adam_w_mode"] is False


def test_sgd_params_build_torchs_sgd():
    lr, momentum = (float(v) for v in torch.rand(2) * 0.5 + 0.01)
    config = DeepSpeedConfig.parse(
        with_batch(optimizer={"type": "sgd", "params": {"lr": lr, "momentum": momentum}})
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
    config = DeepSpeedConfig.parse(with_batch(scheduler={"type": name, "params": params}))
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
    warmup = DeepSpeedConfig.parse(with_batch(scheduler={"type": "WarmupLR"})).scheduler
    assert warmup.params == {
        "last_batch_iteration": -1,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,  # the optimizer's lr
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    }
    decay = DeepSpeedConfig.parse(
        with_batch(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 2000}})
    ).scheduler
    assert decay.params["warmup_max_lr"] == 0.001
    cosine = DeepSpeedConfig.parse(
        with_batch(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}})
    ).scheduler
    assert cosine.params["cos_min_ratio"] == 0.0001 and cosine.params["warmup_min_ratio"] == 0.0


def test_offload_optimizer_tuning_keys_without_effect_warn_once_each(ds_log):
    part = {"device": "cpu", "fast_init": True, "convert_grad_on_cpu": False,
            "cpuadam_cores_perc": 0.5}  # fmt: skip
    DeepSpeedConfig.load(with_batch(zero_optimization={"stage": 2, "offload_optimizer": part}))
    said = [
        r.getMessage() for r in ds_log.records if "has no effect in deepspeed_cpp" in r.getMessage()
    ]
    assert len(said) == 3
    for key in ("fast_init = true", "convert_grad_on_cpu = false", "cpuadam_cores_perc = 0.5"):
        assert sum(key in message for message in said) == 1, key


def test_offload_param_needs_offload_optimizer_and_max_in_cpu_warns(ds_log):
    param = {"device": "nvme", "nvme_path": "/nvme", "max_in_cpu": 10}
    adam = {"type": "AdamW", "params": {"lr": 1e-3}}
    message = config_error(
        with_batch(zero_optimization={"stage": 3, "offload_param": param}, optimizer=adam)
    )
    assert (
        'zero_optimization.offload_param.device = "nvme" needs offload_optimizer.device "cpu" '
        'or "nvme" too in deepspeed_cpp when there is an optimizer' in message
    )
    # Without an optimizer (ZeRO Inference, the guide's t0.py) nothing is stepped: accepted.
    DeepSpeedConfig.load(with_batch(zero_optimization={"stage": 3, "offload_param": param}))
    zero = {"stage": 3, "offload_param": param, "offload_optimizer": {"device": "cpu"}}
    DeepSpeedConfig.load(with_batch(zero_optimization=zero))
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
    ignored = warnings_about(ds_log, "zero_optimization.allgather_partitions")
    assert len(ignored) == (1 if rank == "0" else 0)
    offload = {"device": "cpu", "fast_init": True, "cpuadam_cores_perc": 0.5}
    DeepSpeedConfig.load(with_batch(zero_optimization={"stage": 2, "offload_optimizer": offload}))
    messages = [r.getMessage() for r in ds_log.records]
    assert sum("fast_init = true" in m for m in messages) == (1 if rank == "0" else 0)
    local = [m for m in messages if "cpuadam_cores_perc = 0.5" in m]
    assert local == [m for m in local if m.startswith("rank 1: ") or rank == "0"]
    assert len(local) == 1
