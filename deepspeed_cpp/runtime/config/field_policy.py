"""What deepspeed_cpp does with every field of the typed schema: no key is accepted and ignored.

``key_policy.py`` decides the DeepSpeed keys the schema does not model; this table decides the
schema's own fields (dotted attribute paths of the leaves: a section stands for its fields;
``optimizer.params.*`` by name). Each field is exactly one of:

* ``READ``: the engine reads it; ``where`` names the modules (under ``deepspeed_cpp/``) that do,
  and ``tests/test_config_fields.py`` checks that they still do (``.name`` appears there; for
  optimizer params the quoted key, for scheduler params the schedule's constructor argument);
* ``FIXED``: deepspeed_cpp always behaves as ``value`` asks. That value is what the engine does,
  so it is accepted silently; any other given value is accepted with one warning saying it has
  no effect here (the results are DeepSpeed's either way; only speed or memory would differ);
* ``NO_EFFECT``: no value changes anything here: given at all, it is accepted with one warning;
* ``REFUSED_UNLESS``: ``value`` is what the engine does; any other is refused as "not
  supported yet" (ignoring it would change the results);
* ``JUDGED_IN``: a check of its own, in ``where``, warns about or refuses it (the same test
  checks that the module names it).

The test walks the pydantic models and fails on a field that is in none of these, so a new field
needs a decision here before it can be merged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .errors import show
from .values import is_auto


class Use(enum.Enum):
    READ = "read"
    FIXED = "fixed"
    NO_EFFECT = "no_effect"
    REFUSED_UNLESS = "refused_unless"
    JUDGED_IN = "judged_in"


@dataclass(frozen=True)
class FieldUse:
    use: Use
    where: tuple[str, ...] = ()
    value: Any = None
    reason: str = ""


def _read(*where: str) -> FieldUse:
    return FieldUse(Use.READ, where)


def _judged(*where: str) -> FieldUse:
    return FieldUse(Use.JUDGED_IN, where)


_ENGINE = "runtime/engine.py"
_ENGINE_READERS = "runtime/engine_config_readers.py"
_OFFLOAD = "runtime/zero/offload/optimizer_offload.py"
_STAGE3 = "runtime/zero/build.py"  # _build_stage3 hands them to the partitioner and coordinator
_AIO = "runtime/zero/offload/swap_transfers.py"
_PIPE = "runtime/pipe/engine.py"
_CONFIG = "runtime/config/deepspeed_config.py"
_OPTIMIZER = "runtime/config_optimizer.py"
_REPORT = "runtime/training_report.py"
_MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")

FIELDS: dict[str, FieldUse] = {
    "train_batch_size": _read(_ENGINE),
    "train_micro_batch_size_per_gpu": _read(_ENGINE),
    "gradient_accumulation_steps": _read(_ENGINE),
    "steps_per_print": _read(_REPORT),
    "wall_clock_breakdown": _read(_REPORT),
    "memory_breakdown": _read(_REPORT),
    **{f"{section}.enabled": _read("monitor/monitor.py") for section in _MONITORS},
    **{
        f"{section}.{name}": _read(f"monitor/{module}.py")
        for section, module, names in (
            ("tensorboard", "tensorboard", "output_path job_name"),
            ("csv_monitor", "csv_monitor", "output_path job_name"),
            ("wandb", "wandb", "group team project"),
            (
                "comet",
                "comet",
                "samples_log_interval project workspace api_key experiment_name "
                "experiment_key online mode",
            ),
        )
        for name in names.split()
    },
    **{
        f"comms_logger.{name}": _read("comm/comms_logger.py")
        for name in "enabled verbose prof_all prof_ops debug".split()
    },
    **{
        f"flops_profiler.{name}": _read(_REPORT)
        for name in "enabled recompute_fwd_factor profile_step module_depth top_modules "
        "detailed output_file".split()
    },
    "gradient_clipping": _read(_ENGINE_READERS),
    "tensor_parallel.autotp_size": _read("runtime/initialize.py", _ENGINE),
    "tensor_parallel.partition_config": _read("runtime/tensor_parallel/setup.py"),
    "tensor_parallel.preset_model": _read("runtime/tensor_parallel/setup.py"),
    "dataloader_drop_last": _read(_ENGINE),
    "nonfinite_gradients": _read(_ENGINE),
    "gradient_allreduce_op": FieldUse(
        Use.FIXED,
        value="mean",
        reason="gradients are averaged over the data-parallel ranks (gradient_allreduce_op.py)",
    ),
    "zero_force_ds_cpu_optimizer": _read("runtime/zero/build.py"),
    "zero_allow_untested_optimizer": FieldUse(
        Use.FIXED, value=True, reason="ZeRO runs any optimizer passed to initialize()"
    ),
    "optimizer.type": _read(_ENGINE),
    "optimizer.params": _read(_ENGINE),
    "scheduler.type": _read(_ENGINE),
    "scheduler.params": _read(_ENGINE),
    "fp16.enabled": _read(_ENGINE_READERS),
    "fp16.auto_cast": _read(_ENGINE),
    **{
        f"fp16.{name}": _read("runtime/loss_scaler.py")
        for name in "loss_scale initial_scale_power loss_scale_window hysteresis "
        "consecutive_hysteresis min_loss_scale".split()
    },
    "bf16.enabled": _read(_ENGINE_READERS),
    "bf16.check_grad_overflow": FieldUse(
        Use.FIXED,
        value=True,
        reason="a step whose gradients hold NaN or inf is always skipped (nonfinite_gradients.py)",
    ),
    "zero_optimization.stage": _read(_ENGINE_READERS),
    "zero_optimization.reduce_scatter": _read("runtime/zero/build.py"),
    "zero_optimization.reduce_bucket_size": _read("runtime/zero/build.py"),
    "zero_optimization.contiguous_gradients": FieldUse(
        Use.FIXED,
        value=True,
        reason="gradients are always copied into their contiguous bucket as they are produced",
    ),
    "zero_optimization.overlap_comm": FieldUse(
        Use.FIXED,
        value=True,
        reason="gradient reductions always run asynchronously, overlapping the backward pass",
    ),
    "zero_optimization.allgather_bucket_size": FieldUse(
        Use.NO_EFFECT,
        reason="updated parameters are all-gathered bucket by bucket, in the buckets of "
        "reduce_bucket_size",
    ),
    "zero_optimization.ignore_unused_parameters": _read("runtime/zero/build.py"),
    "zero_optimization.sub_group_size": _read(_OFFLOAD),
    **{
        f"zero_optimization.offload_optimizer.{name}": _read(_OFFLOAD)
        for name in "device nvme_path pin_memory buffer_count pipeline_read pipeline_write ratio "
        "delayed_param_update delayed_param_update_warmup_steps".split()
    },
    # Resolved with the rest of the config (unset: on for NVMe where nothing excludes it).
    "zero_optimization.offload_optimizer.step_during_backward": _read(_CONFIG),
    "zero_optimization.offload_optimizer.fast_init": _judged(_CONFIG),
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": _judged(_CONFIG),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": _judged(_CONFIG),
    "zero_optimization.offload_optimizer.super_offload": _judged("runtime/config/not_built_yet.py"),
    **{
        f"zero_optimization.offload_param.{name}": _read(_OFFLOAD)
        for name in "device nvme_path pin_memory buffer_count buffer_size".split()
    },
    "zero_optimization.offload_param.max_in_cpu": _judged(_CONFIG),
    **{
        f"zero_optimization.{name}": _read(_STAGE3)
        for name in "prefetch_bucket_size param_persistence_threshold "
        "model_persistence_threshold max_live_parameters max_reuse_distance unit_min_numel".split()
    },
    "zero_optimization.gather_16bit_weights_on_model_save": _read("runtime/engine_checkpoints.py"),
    # Marked as the engine is built (the engine calls it at every stage, as DeepSpeed's does).
    **{
        f"zero_optimization.leaf_module.{name}": _read("utils/z3_leaf_modules.py")
        for name in ("classes", "names", "name_suffixes")
    },
    **{
        f"aio.{name}": _read(_AIO)
        for name in "block_size queue_depth intra_op_parallelism single_submit "
        "overlap_events".split()
    },
    "aio.thread_count": _judged("runtime/config/sections.py"),  # one setting with the above
    "aio.use_gds": _judged("runtime/config/sections.py"),  # refused when true
    # Applied by initialize() to deepspeed.checkpointing (or read by its configure()).
    **{
        f"activation_checkpointing.{name}": _read(
            "runtime/activation_checkpointing/checkpointing.py"
        )
        for name in "partition_activations contiguous_memory_optimization cpu_checkpointing "
        "number_checkpoints synchronize_checkpoint_boundary profile".split()
    },
    # pipeline: read by the PipelineEngine (DeepSpeed's engine reads the same keys).
    "checkpoint.tag_validation": _read("runtime/engine_checkpoints.py"),
    "pipeline.stages": _judged(_PIPE),  # must equal the PipelineModule's num_stages
    "pipeline.activation_checkpoint_interval": _read(_PIPE),
    "pipeline.pipe_partitioned": _judged(_PIPE),  # noted when tensor parallelism would use it
    "pipeline.grad_partitioned": _judged(_PIPE),
    "pipeline.use_reentrant": FieldUse(
        Use.FIXED,
        value=False,
        reason="pipeline activation checkpointing always recomputes with the non-reentrant "
        "checkpoint, which computes the same gradients",
    ),
    "pipeline.partition": FieldUse(
        Use.NO_EFFECT,
        reason="PipelineModule(partition_method=...) partitions the layers (DeepSpeed's engine "
        "does not read this key either)",
    ),
    "pipeline.seed_layers": FieldUse(
        Use.NO_EFFECT,
        reason="PipelineModule(seed_layers=...) decides (DeepSpeed's engine does not read this "
        "key either)",
    ),
    # optimizer.params.<name>: read by the optimizer factory, by name.
    **{
        f"optimizer.params.{name}": _read(_OPTIMIZER)
        for name in "lr betas eps weight_decay bias_correction adam_w_mode torch_adam momentum "
        "dampening nesterov".split()
    },
}
"""Dotted attribute path -> what the engine does with it (``scheduler.params.*`` are the
schedules' constructor arguments, checked as such by the test, not listed)."""


def _walk(section, path: str):
    node = section
    for part in path.split(".")[:-1]:
        node = getattr(node, part, None)
        if node is None:
            return None, None
    return node, path.rsplit(".", 1)[-1]


def judge_fields(config) -> tuple[list[str], list[str]]:
    """(problems, warnings) for the FIXED, NO_EFFECT and REFUSED_UNLESS fields that ``config``
    sets explicitly; "auto" values are judged once filled in."""
    problems, warnings = [], []
    for path, field in FIELDS.items():
        if field.use not in (Use.FIXED, Use.NO_EFFECT, Use.REFUSED_UNLESS):
            continue
        section, name = _walk(config, path)
        if section is None or name not in section.model_fields_set:
            continue
        value = getattr(section, name)
        if is_auto(value):
            continue
        if field.use is Use.NO_EFFECT:
            warnings.append(
                f"'{path}': {show(value)} has no effect in deepspeed_cpp ({field.reason})"
            )
        elif value != field.value or type(value) is not type(field.value):
            if field.use is Use.FIXED:
                warnings.append(
                    f"'{path}': {show(value)} has no effect in deepspeed_cpp ({field.reason}; "
                    f"it behaves as {show(field.value)})"
                )
            else:
                problems.append(
                    f"{path} = {show(value)}: not supported yet by deepspeed_cpp "
                    f"({field.reason}); expected {show(field.value)}, or remove the key"
                )
    zero = config.zero_optimization
    offloaded = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    if "sub_group_size" in zero.model_fields_set and not offloaded and not is_auto(zero.stage):
        warnings.append(
            f"'zero_optimization.sub_group_size': {show(zero.sub_group_size)} has no effect "
            f"without offload_optimizer (it sizes the groups the offloaded optimizer steps)"
        )
    return problems, warnings
