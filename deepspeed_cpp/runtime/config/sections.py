"""The typed sections of the config: fp16, bf16, zero_optimization (with its offload parts), aio,
activation_checkpointing, checkpoint, pipeline.

Field names, defaults and meanings are DeepSpeed's. Keys of these sections that deepspeed_cpp
does not model are in ``key_policy.py``. (No ``from __future__ import annotations`` here: the
field types are built by calls such as ``integer(1)``, which pydantic must see evaluated.)
"""

import sys
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ...utils.logging import logger
from ..zero.leaf_module_config import (
    DEFAULT_LEAF_MODULE_CLASSES,
    DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
    DEFAULT_LEAF_MODULE_NAMES,
)
from .key_policy import apply_key_policies, policies_under
from .values import (
    AUTO,
    ConfigSection,
    boolean,
    choice,
    integer,
    is_auto,
    number,
    string_list,
    text,
)


def _number_from_text(value: Any) -> Any:
    """A string holding a number ("3", "1e3") as that number: DeepSpeed reads ``fp16.loss_scale``
    with ``float(value)``. Other strings stay strings, for the number check to refuse."""
    if isinstance(value, str) and not is_auto(value):
        try:
            return float(value)
        except ValueError:
            return value
    return value


class FP16Config(ConfigSection):
    """``fp16``: mixed precision with fp16 compute and fp32 master weights, with loss scaling."""

    enabled: boolean() = False
    auto_cast: boolean() = False
    """Cast floating-point inputs (nested in tuples, lists, dicts too) to fp16 in forward."""
    loss_scale: Annotated[number(minimum=0.0), BeforeValidator(_number_from_text)] = 0.0
    """A fixed loss scale; 0 means dynamic loss scaling (the fields below). A numeric string
    ("3") is read as its number, as DeepSpeed does."""
    initial_scale_power: integer(0, 127) = 16
    """The dynamic scale starts at ``2 ** initial_scale_power``."""
    loss_scale_window: integer(1) = 1000
    """Steps without overflow before the dynamic scale is raised."""
    hysteresis: integer(1) = 2
    """Overflows tolerated before the dynamic scale is lowered (DeepSpeed's "delayed shift")."""
    consecutive_hysteresis: boolean() = False
    """Refill the hysteresis after every step that does not overflow."""
    min_loss_scale: number(minimum=0.0) = 1.0
    """The dynamic scale never drops below this."""

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0.0


class BF16Config(ConfigSection):
    """``bf16`` (older spelling ``bfloat16``): bf16 compute, fp32 master weights, no scaling."""

    enabled: boolean() = False
    check_grad_overflow: boolean() = True
    """DeepSpeed 0.19.8's default, true: a step whose gradients are not finite is skipped. That
    is what deepspeed_cpp always does; false (DeepSpeed then applies the step) only warns."""


_OFFLOAD_DEVICES = ("none", "cpu", "nvme")


class _OffloadConfig(ConfigSection):
    device: choice(_OFFLOAD_DEVICES) = "none"
    """Where the state lives: "none" (on the training device), "cpu" or "nvme"."""
    nvme_path: text(optional=True) = None
    """Folder on the NVMe device, required with ``device: nvme``."""
    pin_memory: boolean() = False
    """Page-locked host buffers (faster device transfers, counted against ``ulimit -l``)."""

    @model_validator(mode="after")
    def _nvme_needs_a_path(self):
        if self.device == "nvme" and self.nvme_path is None:
            raise ValueError('device "nvme" needs "nvme_path", the folder to offload to')
        return self


class OffloadOptimizerConfig(_OffloadConfig):
    """``zero_optimization.offload_optimizer``: optimizer state and step on CPU (or NVMe)."""

    buffer_count: integer(0) = 4
    fast_init: boolean() = False
    ratio: number(0.0, 1.0) = 1.0
    """Share of the optimizer state offloaded (ZeRO-Offload++): the first buckets holding that
    share of the elements; the rest stays on the device (any stage from 1; DeepSpeed: 3 only)."""
    pipeline_read: boolean() = False
    pipeline_write: boolean() = False
    delayed_param_update: boolean() = False
    """deepspeed_cpp extension: the ZeRO-Offload paper's delayed parameter update (device cpu):
    after the warm-up steps, step t's CPU optimizer step runs while step t+1's forward and
    backward run on parameters one step stale."""
    delayed_param_update_warmup_steps: integer(0) = 10
    """Ordinary steps taken before the delayed parameter update starts."""
    step_during_backward: boolean(optional=True) = None
    """deepspeed_cpp extension: at the accumulation boundary, step each optimizer sub-group
    during backward as soon as all its gradient buckets are reduced (so its NVMe reads and
    writes overlap the rest of backward); the updated parameters are still all-gathered in
    ``engine.step()``. Not with gradient clipping, fp16 loss scaling, the delayed parameter
    update, ``ratio`` < 1 or expert-parallel MoE: those need every gradient (or the whole
    step) before any update (clipping is on unless ``gradient_clipping`` is 0: its default
    is 1.0). Unset: on for ``device: "nvme"`` wherever none of those is in use (the
    swap I/O is what there is to hide; on a host with the "device" on its own cores a CPU
    step would only compete with backward), off otherwise; ``true`` refuses the combinations
    by name, ``false`` turns it off."""
    super_offload: boolean() = False
    convert_grad_on_cpu: boolean() = True
    cpuadam_cores_perc: number(0.0, 1.0) = 0.8

    @property
    def pipeline(self) -> bool:
        """DeepSpeed's derived flag: NVMe reads or writes overlap the step."""
        return self.pipeline_read or self.pipeline_write


class OffloadParamConfig(_OffloadConfig):
    """``zero_optimization.offload_param``: parameters on CPU (or NVMe); ZeRO stage 3 only."""

    buffer_count: integer(0) = 5
    buffer_size: integer(0) = 100_000_000
    max_in_cpu: integer(0) = 1_000_000_000


class LeafModuleConfig(ConfigSection):
    """``zero_optimization.leaf_module``: modules the engine marks as ZeRO-3 leaves when it is
    built, as ``deepspeed.utils.set_z3_leaf_modules`` would (``utils/z3_leaf_modules.py``):
    by class (bare or module-qualified name), by ``named_modules()`` name, by name suffix.
    A leaf is gathered whole with its subtree. Names that match nothing are warned about."""

    classes: string_list() = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """DeepSpeed's default: transformers' sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE)."""
    names: string_list() = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    name_suffixes: string_list() = Field(
        default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES)
    )


class ZeroConfig(ConfigSection):
    """``zero_optimization``: how optimizer state, gradients and parameters are partitioned."""

    stage: integer(0, 3) = 0
    """0: plain data parallelism; 1: optimizer state; 2: + gradients; 3: + parameters."""
    contiguous_gradients: boolean() = True
    """Always true here (gradients go straight into their bucket); false warns, no effect."""
    reduce_scatter: boolean() = True
    reduce_bucket_size: integer(1) = 500_000_000
    """Elements per gradient-reduction bucket."""
    allgather_bucket_size: integer(1) = 500_000_000
    """DeepSpeed's all-gather size; no effect here (updated parameters are all-gathered in the
    buckets of ``reduce_bucket_size``), so giving it warns."""
    overlap_comm: boolean(optional=True) = None
    """DeepSpeed: overlap gradient reduction with backward (unset: true for stage 3 only).
    Reductions always overlap here; false warns that it has no effect."""
    ignore_unused_parameters: boolean() = True
    """True (DeepSpeed's default and the only behaviour here): a parameter that gets no
    gradient in a step is reduced as a zero gradient; false is refused, not supported yet."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    offload_param: OffloadParamConfig | None = None
    sub_group_size: integer(1) = 1_000_000_000
    """Elements per group the offloaded optimizer steps at once (with ``offload_optimizer``;
    without it, giving it warns that it has no effect)."""

    # ZeRO stage 3 (named as DeepSpeed's attributes; the JSON keys carry the stage3_ prefix).
    prefetch_bucket_size: integer(0) = Field(50_000_000, alias="stage3_prefetch_bucket_size")
    param_persistence_threshold: integer(0) = Field(
        100_000, alias="stage3_param_persistence_threshold"
    )
    model_persistence_threshold: integer(0) = Field(
        sys.maxsize, alias="stage3_model_persistence_threshold"
    )
    max_live_parameters: integer(0) = Field(1_000_000_000, alias="stage3_max_live_parameters")
    max_reuse_distance: integer(0) = Field(1_000_000_000, alias="stage3_max_reuse_distance")
    unit_min_numel: integer(0) = Field(16_384, alias="stage3_unit_min_numel")
    """A deepspeed_cpp extension: a module whose partitioned parameters (with its small
    children's) number fewer elements joins its parent's fetch unit, gathered and reduced with
    it (norms, bias-only modules: a collective that small costs its launch, not its bytes), and
    the repeated blocks of a ``ModuleList``/``Sequential`` (transformer layers) with at least
    this many elements (and at most ``stage3_max_live_parameters`` and
    ``stage3_prefetch_bucket_size``) are one unit each; 0 gives
    every module with parameters a unit of its own, as DeepSpeed does."""
    gather_16bit_weights_on_model_save: boolean() = Field(
        False, alias="stage3_gather_16bit_weights_on_model_save"
    )
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)

    @model_validator(mode="before")
    @classmethod
    def _keys_the_config_translates(cls, data):
        """``DeepSpeedZeroConfig(**section)`` built directly takes the section's deprecated and
        ignored keys as the whole config does (``cpu_offload`` becomes ``offload_optimizer``,
        with the same warnings and refusals); inside a full config they are already gone."""
        if not isinstance(data, dict) or not set(data) & policies_under("zero_optimization"):
            return data
        work = {"zero_optimization": dict(data)}
        outcome = apply_key_policies(work)
        if outcome.problems:
            raise ValueError("; ".join(outcome.problems))
        for warning in outcome.warnings:
            logger.warning(warning)
        return work["zero_optimization"]

    @property
    def pipeline_loading_checkpoint(self) -> bool:
        """DeepSpeed's flag for its pipeline engine loading a ZeRO checkpoint into modules; the
        pipeline engine here loads through the ordinary checkpoint path, so never set."""
        return False

    @model_validator(mode="after")
    def _default_overlap_comm(self):
        if self.overlap_comm is None and isinstance(self.stage, int):
            self.overlap_comm = self.stage == 3  # DeepSpeed's default
            # Still a default, not a value given: field_policy warns only about given ones.
            self.model_fields_set.discard("overlap_comm")
        return self

    def offload_devices(self) -> dict[str, Any]:
        """The configured offload device of each part that is offloaded at all."""
        devices = {}
        for name in ("offload_optimizer", "offload_param"):
            part = getattr(self, name)
            if part is not None and part.device != "none":
                devices[name] = part.device
        return devices


def _block_size():
    """A positive multiple of 4096 (O_DIRECT's alignment), as the aio handle needs."""

    def check(value):
        if not is_auto(value) and value % 4096:
            raise PydanticCustomError(
                "ds_config_value", "expected a positive multiple of 4096 (O_DIRECT's alignment)"
            )
        return value

    return Annotated[integer(1), AfterValidator(check)]


class AioConfig(ConfigSection):
    """``aio``: the asynchronous I/O of NVMe offload (swap files), DeepSpeed's keys."""

    block_size: _block_size() = 1_048_576
    """Bytes per I/O request piece."""
    queue_depth: integer(1, 4096) = 8
    """Pieces kept in flight per worker thread."""
    thread_count: integer(1, 256) = 1
    """DeepSpeed's older name of ``intra_op_parallelism``."""
    intra_op_parallelism: integer(1, 256) = 1
    """Worker threads that split one request."""
    single_submit: boolean() = False
    """Hand each piece to the kernel on its own instead of in batches."""
    overlap_events: boolean() = True
    """Refill the queue on every completion instead of per batch."""
    use_gds: boolean() = False
    """GPUDirect Storage: not supported, must be false."""

    @field_validator("use_gds", mode="after")
    @classmethod
    def _no_gds(cls, value):
        if value is True:
            raise ValueError(
                "GPUDirect Storage (GDS) is not supported by deepspeed_cpp: NVMe offload moves "
                "data through host memory; expected false, or remove the key"
            )
        return value

    @model_validator(mode="after")
    def _one_thread_count(self):
        given = self.model_fields_set
        old, new = self.thread_count, self.intra_op_parallelism
        if is_auto(old) or is_auto(new):
            return self
        if {"thread_count", "intra_op_parallelism"} <= given and old != new:
            raise ValueError(
                f"aio.thread_count = {old} and aio.intra_op_parallelism = {new} differ: they are "
                "two names of one setting (DeepSpeed's older and newer); give one of them"
            )
        if "thread_count" in given and "intra_op_parallelism" not in given:
            self.intra_op_parallelism = old
        else:
            self.thread_count = new
        return self


class ActivationCheckpointingConfig(ConfigSection):
    """``activation_checkpointing``: how ``deepspeed.checkpointing.checkpoint`` keeps the inputs
    it saves for recomputation (DeepSpeed's keys; ``initialize`` configures the module with them
    unless the script called ``deepspeed.checkpointing.configure`` itself)."""

    partition_activations: boolean() = False
    """Keep 1/N of each saved input on each of the N ranks of the model-parallel group and
    all-gather it for the recomputation (no effect without a model-parallel group)."""
    contiguous_memory_optimization: boolean() = False
    """Copy the kept partitions into preallocated buffers of ``number_checkpoints`` slots
    (less fragmentation); needs ``partition_activations`` and ``number_checkpoints``."""
    cpu_checkpointing: boolean() = False
    """Keep the saved inputs in host memory until the recomputation (a no-op on the CPU)."""
    number_checkpoints: integer(1, optional=True) = None
    """Checkpointed calls per forward: the slot count of the contiguous buffers."""
    synchronize_checkpoint_boundary: boolean() = False
    """Synchronize the device before and after each checkpointed forward and recomputation."""
    profile: boolean() = False
    """Log the time of each checkpointed forward and recomputation."""

    @model_validator(mode="after")
    def _contiguous_needs_partitions_and_count(self):
        if self.contiguous_memory_optimization is True:
            if self.partition_activations is not True:
                raise ValueError(
                    "contiguous_memory_optimization needs partition_activations: true (the "
                    "buffers hold the partitions)"
                )
            if self.number_checkpoints is None:
                raise ValueError(
                    "contiguous_memory_optimization needs number_checkpoints (the number of "
                    "layers checkpointed per forward, which sizes the buffers)"
                )
        return self


class TensorParallelConfig(ConfigSection):
    """``tensor_parallel``: AutoTP training (DeepSpeed's keys). Models are split by the policy
    of their architecture (``deepspeed_cpp/module_inject/tp_policies.py``)."""

    autotp_size: integer(0) = 0
    """Ranks a model's layers are split across; 0 or 1: no tensor parallelism. The
    data-parallel size is then the world size divided by this."""
    partition_config: dict | None = None
    """User layer specs: ``{"use_default_specs": bool, "layer_specs": [{"patterns": [regular
    expressions of parameter names], "partition_type": "column" | "row"}]}``."""
    preset_model: text(optional=True) = None
    """The policy of this architecture (a ``config.model_type`` such as "llama", "qwen2")
    instead of the model's own."""


class CheckpointConfig(ConfigSection):
    """``checkpoint``: what ``save_checkpoint`` reads (its other DeepSpeed keys are in
    ``key_policy.py``)."""

    tag_validation: choice(("IGNORE", "WARN", "FAIL"), case_sensitive=False) = "WARN"
    """When the ranks pass different tags to ``save_checkpoint``: "FAIL" raises (an
    ``AssertionError``, as DeepSpeed's), "WARN" (DeepSpeed's default) warns and saves, "IGNORE"
    saves without a warning (``runtime/checkpoint/tag_agreement.py``)."""


class PipelineConfig(ConfigSection):
    """``pipeline``: what DeepSpeed's ``PipelineEngine`` reads of the config (the pipeline
    itself is built by ``PipelineModule``'s arguments, here as in DeepSpeed)."""

    stages: Annotated[int | str, integer(1).__metadata__[0]] = AUTO  # "auto" kept as given
    """The number of stages; "auto" (DeepSpeed's default) takes the PipelineModule's. A number
    must equal it (checked by the pipeline engine)."""
    partition: text() = "best"
    """Not read by DeepSpeed's engine either: ``PipelineModule(partition_method=...)`` decides."""
    seed_layers: boolean() = False
    """Not read by DeepSpeed's engine either: ``PipelineModule(seed_layers=...)`` decides."""
    activation_checkpoint_interval: integer(0) = 0
    """Above 0: overrides the PipelineModule's ``activation_checkpoint_interval``."""
    pipe_partitioned: boolean() = True
    """DeepSpeed splits the activations sent between stages over the tensor-parallel group
    (a transfer optimization only; no effect without tensor parallelism)."""
    grad_partitioned: boolean() = True
    """As ``pipe_partitioned``, for the activation gradients sent back."""
    use_reentrant: boolean(optional=True) = None
    """DeepSpeed's choice of checkpoint function for ``activation_checkpoint_interval``; here
    the checkpoint is always the non-reentrant one, which computes the same gradients."""
