"""Configs the schema refuses: unknown keys (named with the nearest valid one), DeepSpeed features
not built yet, and values of the wrong type or range, each error naming the key, the value and
what was expected."""

import random

import pytest
from config_helpers import config_error, warnings_about, with_batch

from deepspeed_cpp.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

# --- unknown keys -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            {"train_batch_sise": 8},
            "unknown key 'train_batch_sise' (value 8): did you mean 'train_batch_size'?",
        ),
        (
            with_batch(zero_optimization={"stag": 2}),
            "unknown key 'zero_optimization.stag' (value 2): did you mean "
            "'zero_optimization.stage'?",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"weight_dacay": 0.1}}),
            "unknown key 'optimizer.params.weight_dacay' (value 0.1): did you mean "
            "'optimizer.params.weight_decay'?",
        ),
        (
            with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_steps": 10}}),
            "unknown key 'scheduler.params.warmup_steps' (value 10): did you mean "
            "'scheduler.params.warmup_num_steps'?",
        ),
        (
            with_batch(tensorboard={"enable": True}),
            "unknown key 'tensorboard.enable' (value true): did you mean 'tensorboard.enabled'?",
        ),
        (
            with_batch(checkpoint={"tag_validaton": "Warn"}),
            "unknown key 'checkpoint.tag_validaton' (value \"Warn\"): did you mean "
            "'checkpoint.tag_validation'?",
        ),
        (
            with_batch(zero_optimization={"offload_optimizer": {"devise": "cpu"}}),
            "did you mean 'zero_optimization.offload_optimizer.device'?",
        ),
        (
            with_batch(optimizer={"type": "Adam", "gradient_clipping": 1.0}),
            "unknown key 'optimizer.gradient_clipping' (value 1.0): 'gradient_clipping' "
            "belongs at the top level",
        ),
        (
            with_batch(load_universal=True),
            "unknown key 'load_universal' (value true): 'load_universal' belongs in 'checkpoint'",
        ),
        (
            with_batch(fp16={"enabled": True, "Loss_Scale": 0}),
            "did you mean 'fp16.loss_scale'?",
        ),
        (  # both names of one setting (DeepSpeed's alias): not "unknown", not "did you mean"
            with_batch(
                zero_optimization={
                    "stage": 3,
                    "gather_16bit_weights_on_model_save": True,
                    "stage3_gather_16bit_weights_on_model_save": True,
                }
            ),
            "gather_16bit_weights_on_model_save' (value true) is given twice: this setting is "
            "also set under its other name (DeepSpeed's alias) in the same section",
        ),  # fmt: skip
    ],
)
def test_unknown_key_is_named_with_the_nearest_valid_key(config, expected):
    assert expected in config_error(config)


def test_every_problem_is_reported_at_once():
    message = config_error(
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
        (with_batch(prescale_gradients=True), "prescale_gradients = true: not supported yet"),
        (
            with_batch(gradient_predivide_factor=8),
            "gradient_predivide_factor = 8: not supported yet",
        ),
        (with_batch(amp={"enabled": True}), 'amp = {"enabled": true}: not supported yet'),
        (
            with_batch(communication_data_type="fp16"),
            'communication_data_type = "fp16": not supported yet',
        ),
        (
            with_batch(checkpoint={"load_universal": True}),
            "checkpoint.load_universal = true: not supported yet",
        ),
        (
            with_batch(zero_optimization={"zero_quantized_weights": True}),
            "zero_optimization.zero_quantized_weights = true: not supported yet",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"amsgrad": True}}),
            "optimizer.params.amsgrad = true: not supported yet",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"max_grad_norm": 1.0}}),
            "optimizer.params.max_grad_norm = 1.0: not supported yet",
        ),
        (
            with_batch(elasticity={"enabled": True, "max_train_batch_size": 64}),
            "elasticity = ",
        ),
        (
            with_batch(
                compression_training={"sparse_pruning": {"shared_parameters": {"enabled": True}}}
            ),
            "compression_training = ",
        ),
        (
            with_batch(optimizer={"type": "Lamb"}),
            "DeepSpeed's Lamb optimizer is not supported yet",
        ),
        (
            with_batch(optimizer={"type": "OneBitAdam"}),
            "OneBitAdam optimizer is not supported yet",
        ),
        (with_batch(optimizer={"type": "adagrad"}), "Adagrad optimizer is not supported yet"),
        (with_batch(optimizer={"type": "Lamb"}), "Lamb optimizer is not supported yet"),
        (with_batch(optimizer={"type": "RMSprop"}), "torch.optim.RMSprop from the config is not"),
        (
            with_batch(scheduler={"type": "CosineAnnealingLR"}),
            "torch.optim.lr_scheduler.CosineAnnealingLR from the config is not supported yet",
        ),
    ],
)
def test_deepspeed_features_not_built_yet_are_refused_by_name(config, expected):
    message = config_error(config)
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
    config = DeepSpeedConfig.parse(with_batch(zero_optimization=zero))
    assert config.zero_optimization.stage == zero["stage"]
    assert expected in config_error(config.raw, world_size=1)


def test_stage3_is_accepted():
    config = DeepSpeedConfig.load(with_batch(zero_optimization={"stage": 3}), world_size=1)
    assert config.zero_optimization.stage == 3


def test_flops_profiler_profile_step_0_is_accepted():
    """DeepSpeed profiles the first step with profile_step 0 (its default 1 only skips warm-up)."""
    config = DeepSpeedConfig.load(with_batch(flops_profiler={"profile_step": 0}), world_size=1)
    assert config.flops_profiler.profile_step == 0


def test_offload_device_none_is_accepted():
    config = DeepSpeedConfig.load(
        with_batch(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}})
    )
    assert config.zero_optimization.offload_devices() == {}


# --- types and ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, expected",
    [
        (
            with_batch(zero_optimization={"stage": 4}),
            "zero_optimization.stage = 4: expected an integer in [0, 3]",
        ),
        (
            with_batch(zero_optimization={"stage": "2"}),
            'zero_optimization.stage = "2": expected an integer',
        ),
        (
            with_batch(zero_optimization={"stage": True}),
            "zero_optimization.stage = true: expected an integer",
        ),
        (
            with_batch(zero_optimization={"reduce_bucket_size": 2.5}),
            "zero_optimization.reduce_bucket_size = 2.5: expected an integer >= 1",
        ),
        (
            with_batch(zero_optimization={"reduce_bucket_size": 0}),
            "zero_optimization.reduce_bucket_size = 0: expected an integer >= 1",
        ),
        (
            with_batch(zero_optimization={"overlap_comm": 1}),
            "zero_optimization.overlap_comm = 1: expected true or false",
        ),
        (
            with_batch(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
            'zero_optimization.offload_optimizer.device = "gpu": '
            "expected one of 'none', 'cpu', 'nvme'",
        ),
        (
            with_batch(zero_optimization={"offload_param": {"device": "nvme"}}),
            'device "nvme" needs "nvme_path"',
        ),
        (
            with_batch(zero_optimization={"offload_optimizer": {"ratio": 1.5}}),
            "zero_optimization.offload_optimizer.ratio = 1.5: expected a number",
        ),
        (with_batch(zero_optimization=[2]), "zero_optimization = [2]: expected a JSON object"),
        (with_batch(fp16={"enabled": "true"}), 'fp16.enabled = "true": expected true or false'),
        (with_batch(fp16={"loss_scale": -1}), "fp16.loss_scale = -1: expected a number >= 0.0"),
        (with_batch(fp16={"hysteresis": 0}), "fp16.hysteresis = 0: expected an integer >= 1"),
        (
            with_batch(fp16={"initial_scale_power": 200}),
            "fp16.initial_scale_power = 200: expected an integer in [0, 127]",
        ),
        (with_batch(gradient_clipping=-1.0), "gradient_clipping = -1.0: expected a number >= 0.0"),
        (
            with_batch(gradient_clipping=float("nan")),
            "gradient_clipping = NaN: expected a number >= 0.0",
        ),
        (with_batch(steps_per_print=0), "steps_per_print = 0: expected an integer >= 1"),
        (
            with_batch(flops_profiler={"profile_step": -1}),
            "flops_profiler.profile_step = -1: expected an integer >= 0",
        ),
        ({"train_batch_size": -4}, "train_batch_size = -4: expected an integer >= 1, or null"),
        (with_batch(optimizer={"params": {"lr": 1.0}}), "optimizer.type is required"),
        (
            with_batch(optimizer={"type": 3}),
            "optimizer.type = 3: expected the optimizer's name as a string",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"lr": -1}}),
            "optimizer.params.lr = -1: expected a number >= 0.0",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"betas": [0.9]}}),
            "optimizer.params.betas = [0.9]: expected a list of two numbers, each in [0, 1)",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"betas": [0.9, 1.0]}}),
            "optimizer.params.betas = [0.9, 1.0]: expected a list of two numbers",
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": {"eps": "1e-8"}}),
            'optimizer.params.eps = "1e-8": expected a number >= 0.0',
        ),
        (
            with_batch(optimizer={"type": "Adam", "params": [0.1]}),
            "optimizer.params = [0.1]: expected a JSON object",
        ),
        (
            with_batch(optimizer={"type": "SGD", "params": {"nesterov": True}}),
            "nesterov: true needs momentum > 0 and dampening = 0",
        ),
        (
            with_batch(optimizer={"type": "Adamw2"}),
            "unknown optimizer type; did you mean 'AdamW'?",
        ),
        (
            with_batch(scheduler={"type": "warmuplr"}),
            "did you mean 'WarmupLR' (names are case-sensitive)?",
        ),
        (
            with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
            "scheduler.params.warmup_type = \"cosine\": expected one of 'log', 'linear'",
        ),
        (
            with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}}),
            "scheduler.params.warmup_num_steps = 0: expected an integer >= 1",
        ),
        (
            with_batch(scheduler={"type": "WarmupDecayLR", "params": {}}),
            "scheduler.params.total_num_steps is required by WarmupDecayLR",
        ),
        (
            with_batch(
                scheduler={
                    "type": "WarmupCosineLR",
                    "params": {"total_num_steps": 10, "warmup_num_steps": 20},
                }
            ),
            "total_num_steps (10) must be >= warmup_num_steps (20)",
        ),
        (
            with_batch(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}),
            "scheduler.params.cycle_max_lr is required by OneCycle",
        ),
        (
            with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": []}}),
            "scheduler.params.warmup_max_lr = []: expected a number >= 0.0 or a non-empty list",
        ),
        (
            with_batch(fp16={"enabled": True}, bf16={"enabled": True}),
            "fp16.enabled = true and bf16.enabled = true: expected at most one of them",
        ),
        (with_batch(tensorboard=True), "tensorboard = true: expected a JSON object"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_was_expected(config, expected):
    assert expected in config_error(config)


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


def test_pipeline_section_is_typed(ds_log):
    """The keys DeepSpeed's PipelineEngine reads: typed ("auto" stages is DeepSpeed's own value,
    not a placeholder), checked by name, and each one's use said (runtime/pipe/engine.py reads
    them; tests/test_pipe.py checks stages and activation_checkpoint_interval in a pipeline)."""
    config = DeepSpeedConfig.load(with_batch(pipeline={"stages": "auto", "use_reentrant": False}))
    assert config.pipeline.stages == "auto" and config.pipeline.activation_checkpoint_interval == 0
    assert config.auto_paths == ()
    assert DeepSpeedConfig.load(with_batch(pipeline={"stages": 4})).pipeline.stages == 4
    assert not warnings_about(ds_log, "pipeline.use_reentrant")
    DeepSpeedConfig.load(with_batch(pipeline={"use_reentrant": True, "seed_layers": True}))
    assert "non-reentrant" in warnings_about(ds_log, "pipeline.use_reentrant")[0]
    assert "PipelineModule(seed_layers" in warnings_about(ds_log, "pipeline.seed_layers")[0]
    for section, expected in [
        ({"stages": 0}, "pipeline.stages = 0: expected an integer >= 1"),
        ({"activation_checkpoint_interval": -1}, "expected an integer >= 0"),
        ({"pipe_partitioned": "yes"}, "pipeline.pipe_partitioned"),
        ({"micro_batches": 4}, "unknown key 'pipeline.micro_batches'"),
    ]:
        with pytest.raises(DeepSpeedConfigError, match=expected.replace("(", r"\(")):
            DeepSpeedConfig.load(with_batch(pipeline=section))


def test_fp16_loss_scale_reads_a_numeric_string_as_deepspeed_does():
    """DeepSpeed reads ``fp16.loss_scale`` with ``float(value)``: "3" is 3.0; what is not a finite
    number >= 0 is still refused, by name."""
    from deepspeed_cpp.runtime.precision_config import DeepSpeedFP16Config

    scale = random.choice([1, 3, 128, 0.5])
    config = DeepSpeedConfig.load(with_batch(fp16={"enabled": True, "loss_scale": str(scale)}))
    assert config.fp16.loss_scale == float(scale) and not config.fp16.dynamic_loss_scale
    assert DeepSpeedFP16Config(loss_scale="0").dynamic_loss_scale
    for bad in ("inf", "nan", "-1", "three", True, []):
        with pytest.raises(DeepSpeedConfigError, match=r"fp16\.loss_scale = .*expected a number"):
            DeepSpeedConfig.load(with_batch(fp16={"enabled": True, "loss_scale": bad}))
