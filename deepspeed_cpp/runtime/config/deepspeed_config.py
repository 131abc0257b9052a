"""DeepSpeedConfig: the ds_config JSON, validated and typed, as the engine reads it.

Two steps, as the Hugging Face integration needs them:

* ``parse`` validates a config that may still hold ``"auto"`` values;
* ``finalize(world_size)`` resolves the batch sizes and refuses what is left unresolved or not
  built yet. ``load`` does both.

Every problem found is reported at once in one DeepSpeedConfigError (a ValueError) naming the
key path, the value and what was expected. Accepted-but-ignored and deprecated keys are logged
once per key and process on the ``deepspeed_cpp`` logger, by rank 0 only where the ranks would
all say the same (``_may_differ_between_ranks``); see ``key_policy.py`` for the decisions on
keys the schema does not model, ``field_policy.py`` for the schema's own fields.
(No ``from __future__ import annotations``: field types are calls such as ``integer(1)``.)
"""

import copy
import functools
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError

from ...utils.logging import logger
from ..constants import GRADIENT_CLIPPING_DEFAULT
from .auto_values import (
    AUTO_AS_VALUE,
    fill_auto_values,
    find_auto_paths,
    unresolved_auto_problem,
)
from .batch_size import resolve_batch_sizes
from .errors import (
    BatchSizeError,
    DeepSpeedConfigError,
    GradAccumDtypeNotImplementedError,
    describe_validation_error,
    join_path,
)
from .field_policy import judge_fields
from .grad_accum_dtype import read_grad_accum_dtype
from .gradient_allreduce_op import read_gradient_allreduce_op
from .key_names import model_key_paths, model_keys, section_model_at, unknown_key_problem
from .key_policy import (
    apply_key_policies,
    ignored_key_paths,
    policies_under,
    policy_key_paths,
)
from .not_built_yet import refuse_features_not_built_yet
from .observability import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .optimizer import PARAMS_BY_TYPE as OPTIMIZER_PARAMS
from .optimizer import OptimizerConfig, validate_optimizer_params
from .scheduler import PARAMS_BY_TYPE as SCHEDULER_PARAMS
from .scheduler import SchedulerConfig, validate_scheduler_params
from .sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    FP16Config,
    PipelineConfig,
    TensorParallelConfig,
    ZeroConfig,
)
from .source import choose_config, read_config
from .values import ConfigSection, boolean, choice, integer, is_auto, number, print_interval


def _data_parallel_world_size(mpu: Any) -> int:
    import torch.distributed as dist

    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DeepSpeedConfig(ConfigSection):
    """A DeepSpeed config (``ds_config.json``), validated; attributes are its sections.

    Build one with ``DeepSpeedConfig.load(config, args, world_size)`` (finalised, what the
    engine needs) or ``DeepSpeedConfig.parse(config)`` (may still hold ``"auto"``; then
    ``fill_auto({...})`` and ``finalize(world_size)``). ``raw`` is the config as given (with
    filled ``"auto"`` values), for saving in checkpoints.
    """

    train_batch_size: integer(1, optional=True) = None
    """Samples per optimizer step over all ranks (set on every finalised config)."""
    train_micro_batch_size_per_gpu: integer(1, optional=True) = None
    """Samples per forward/backward on one rank (set on every finalised config)."""
    gradient_accumulation_steps: integer(1, optional=True) = None
    """Micro-batches per optimizer step (set on every finalised config)."""
    steps_per_print: print_interval() = 10
    """Steps between progress lines; infinity (0 once read) prints none."""
    wall_clock_breakdown: boolean() = False
    """Log the forward/backward/step times (DeepSpeed's timer names) every steps_per_print."""
    memory_breakdown: boolean() = False
    """Add host RSS and device memory to the wall_clock_breakdown lines."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    gradient_clipping: number(minimum=0.0) = GRADIENT_CLIPPING_DEFAULT
    """Clip the global gradient norm to this; 0 disables clipping. The default is DeepSpeed
    0.19.8's, 1.0: a config without the key clips, as it does under DeepSpeed."""
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    zero_allow_untested_optimizer: boolean() = False
    """DeepSpeed's permission to run ZeRO with an optimizer it did not build."""
    zero_force_ds_cpu_optimizer: boolean() = True
    """With ``offload_optimizer``, refuse an optimizer passed to ``initialize()`` that is not one
    of the CPU optimizers (DeepSpeedCPUAdam, -Adagrad, -Lion), as DeepSpeed does (a torch
    optimizer stepping the host's shards is slow); false allows it."""
    dataloader_drop_last: boolean() = False
    """Drop the last incomplete batch of the engine's data loader."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous I/O of NVMe offload (the swap files' aio handles)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP training: ``autotp_size`` ranks split each model (deepspeed_cpp.module_inject)."""
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    """``deepspeed.checkpointing``'s settings; None when the config has no such section."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """What ``save_checkpoint`` reads (``tag_validation``)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """What a ``PipelineEngine`` reads (``runtime/pipe/engine.py``); plain engines ignore it."""
    gradient_allreduce_op: choice(("mean",)) = "mean"
    """How gradients are combined over data-parallel ranks: averaged (DeepSpeed's "mean"; its
    "sum" is refused by ``gradient_allreduce_op.py``)."""
    nonfinite_gradients: choice(("skip", "raise")) = "skip"
    """deepspeed_cpp extension: a step whose global gradient holds NaN or inf is skipped on
    every rank (parameters, optimizer state and LR schedule unchanged, counted in
    ``skipped_steps``, logged), as DeepSpeed does; ``"raise"`` then also raises
    ``NonFiniteGradientError`` on every rank. fp16's loss scaler skips its overflows either way."""

    _raw: dict = PrivateAttr(default_factory=dict)
    _source: str = PrivateAttr("dict")
    _given_batch: tuple = PrivateAttr((None, None, None))
    _warned: set = PrivateAttr(default_factory=set)
    _world_size: int | None = PrivateAttr(None)

    # --- construction -------------------------------------------------------------------------
    def __init__(self, config: Any = None, /, mpu: Any = None, mesh_device: Any = None, **fields):
        """``DeepSpeedConfig(config, mpu=None)``, DeepSpeed's own construction (scripts and the
        HF integration's users call it): ``config`` a JSON file path, a dict or base64 JSON,
        finalised for the data-parallel world: ``mpu.get_data_parallel_world_size()``, else the
        process group's size, else 1, as DeepSpeed does. Without ``config`` the fields are
        pydantic's (``DeepSpeedConfig(train_batch_size=8)``), as for every section."""
        if config is None:
            if mpu is not None or mesh_device is not None:
                raise TypeError("DeepSpeedConfig(config, mpu=...): mpu given without a config")
            super().__init__(**fields)
            return
        if fields:
            raise TypeError(
                f"DeepSpeedConfig(config, ...): unexpected keyword arguments {sorted(fields)}; "
                f"expected DeepSpeedConfig(config, mpu=None) or DeepSpeedConfig(**fields)"
            )
        if mesh_device is not None:
            raise ValueError(
                "DeepSpeedConfig(config, mesh_device=...): device meshes (sequence parallelism) "
                "are not supported; pass mpu= or nothing"
            )
        loaded = type(self).load(config, world_size=_data_parallel_world_size(mpu))
        # Become the loaded model (pydantic keeps an instance's state in these four slots).
        for slot in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__"):
            object.__setattr__(self, slot, getattr(loaded, slot))
        object.__setattr__(self, "__pydantic_private__", loaded.__pydantic_private__)

    @classmethod
    def load(cls, config: Any = None, args: Any = None, world_size: int = 1) -> "DeepSpeedConfig":
        """The finalised config from ``config`` (a JSON file path, a dict, base64 JSON) or from
        ``args.deepspeed_config`` (an argparse namespace), for ``world_size`` data-parallel
        ranks. Giving both is an error; ``args.deepspeed_config`` may be None beside a dict."""
        chosen, warnings = choose_config(config, args)
        return cls._parse(chosen, warnings).finalize(world_size)

    @classmethod
    def read(cls, config: Any = None, args: Any = None) -> "DeepSpeedConfig":
        """What ``load`` reads, validated but not finalised (``initialize()`` learns the
        tensor-parallel size from it before it knows the data-parallel world size)."""
        chosen, warnings = choose_config(config, args)
        return cls._parse(chosen, warnings)

    @classmethod
    def parse(cls, config: Any) -> "DeepSpeedConfig":
        """The validated config, not finalised: ``"auto"`` values are allowed."""
        return cls._parse(config, [])

    @classmethod
    def _parse(cls, config: Any, warnings: list[str]) -> "DeepSpeedConfig":
        if isinstance(config, DeepSpeedConfig):
            config = config.raw
        data, source, source_warnings = read_config(config)
        return cls._from_dict(data, source, warnings + source_warnings, already_warned=set())

    @classmethod
    def _from_dict(
        cls, raw: dict, source: str, warnings: list[str], already_warned: set[str]
    ) -> "DeepSpeedConfig":
        work = copy.deepcopy(raw)
        allreduce_problems = read_gradient_allreduce_op(work)  # before "compile" is dropped
        accum_problems, accum_warnings, accum_not_implemented = read_grad_accum_dtype(work)
        policy = apply_key_policies(work)
        problems = allreduce_problems + accum_problems + list(policy.problems)
        warnings = warnings + accum_warnings + policy.warnings
        # The params are checked against their type even when other keys are wrong, so that
        # one run reports everything.
        known = _known_key_paths()
        optimizer_params, found, said = validate_optimizer_params(work.get("optimizer"), known)
        problems += found
        warnings += said
        scheduler_params, found = validate_scheduler_params(work.get("scheduler"), known)
        problems += found
        try:
            config = cls.model_validate(work)
        except ValidationError as error:
            problems += describe_validation_error(error, (), _unknown_key)
        else:
            if config.optimizer is not None and optimizer_params is not None:
                config.optimizer.params = optimizer_params
            if config.scheduler is not None and scheduler_params is not None:
                config.scheduler.params = scheduler_params
            found, said = config._check_across_sections()
            problems += found
            warnings += said
        if problems:
            # DeepSpeed raises NotImplementedError for a stage-0 grad_accum_dtype mix.
            error = GradAccumDtypeNotImplementedError if accum_not_implemented else None
            raise (error or DeepSpeedConfigError)(problems, source)
        config._raw = raw
        config._source = source
        config._given_batch = (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )
        config._warned = set(already_warned)
        config._warn_once(warnings)
        return config

    def _check_across_sections(self) -> tuple[list[str], list[str]]:
        """Checks that involve more than one key; returns (problems, warnings)."""
        problems, warnings = [], []
        if self.fp16.enabled is True and self.bf16.enabled is True:
            problems.append(
                "fp16.enabled = true and bf16.enabled = true: expected at most one of them, "
                "fp16 and bf16 mixed precision exclude each other"
            )
        if self.fp16.enabled is True and self.nonfinite_gradients == "raise":
            warnings.append(
                "'nonfinite_gradients': 'raise' has no effect with fp16.enabled = true: the loss "
                "scaler skips overflowing steps (and lowers a dynamic scale), by design"
            )
        zero = self.zero_optimization
        if is_auto(zero.stage):
            return problems, warnings  # judged once the stage is filled in
        found, said = judge_fields(self)
        problems += found
        warnings += said
        offload_param = zero.offload_param
        if offload_param is not None and offload_param.device != "none" and zero.stage != 3:
            warnings.append(
                f"'zero_optimization.offload_param' only applies to ZeRO stage 3; it is ignored "
                f"at stage {zero.stage}"
            )
        offload_optimizer = zero.offload_optimizer
        optimizer_offloaded = offload_optimizer is not None and offload_optimizer.device != "none"
        if offload_param is not None and offload_param.device != "none" and zero.stage == 3:
            # Without an optimizer (ZeRO Inference, the guide's t0.py) nothing is stepped; a
            # client optimizer given to initialize() is checked by the engine (same message).
            # "cpu" is judged there too: on a CPU device the parameters already live in host
            # memory, which is all DeepSpeed's offload_param alone asks for.
            if (
                not optimizer_offloaded
                and self.optimizer is not None
                and offload_param.device != "cpu"
            ):
                problems.append(offload_param_needs_offload_optimizer(offload_param.device))
            if offload_param.max_in_cpu != 1_000_000_000:
                warnings.append(
                    f"zero_optimization.offload_param.max_in_cpu = {offload_param.max_in_cpu} "
                    f"has no effect in deepspeed_cpp: with device nvme every shard lives in its "
                    f"swap file and host memory is bounded by buffer_count x buffer_size"
                )
        if optimizer_offloaded:
            warnings += _offload_keys_without_effect(offload_optimizer)
            ratio = offload_optimizer.ratio
            if zero.stage == 0 and not is_auto(ratio) and ratio != 0.0:
                # Found by a config fuzzer: it used to surface as a ValueError from the engine.
                problems.append(
                    f"zero_optimization.offload_optimizer.device = {offload_optimizer.device!r} "
                    f"needs ZeRO stage 1, 2 or 3 (it offloads the partitioned optimizer state); "
                    f"got stage 0"
                )
            if offload_optimizer.delayed_param_update and offload_optimizer.device != "cpu":
                problems.append(
                    f"zero_optimization.offload_optimizer.delayed_param_update = true needs "
                    f'offload_optimizer.device "cpu" (the step runs on the host beside the next '
                    f'forward); got device "{offload_optimizer.device}"'
                )
            if offload_optimizer.step_during_backward:
                problems += _step_during_backward_problems(self)
        return problems, warnings

    def _warn_once(self, warnings: list[str]) -> None:
        rank = _this_rank()
        for message in warnings:
            key = _warning_key(message)
            if key not in self._warned and key not in _WARNED_KEYS:
                self._warned.add(key)
                _WARNED_KEYS.add(key)
                if rank == 0:
                    logger.warning(message)
                elif _may_differ_between_ranks(key):
                    logger.warning(f"rank {rank}: {message}")

    # --- the Hugging Face path: "auto" values, then finalisation --------------------------------
    def fill_auto(self, values: Mapping[str, Any]) -> list[str]:
        """Replaces ``"auto"`` at the given dotted key paths (``"optimizer.params.lr"``) with the
        given values, in place, and validates again. Keys that are not ``"auto"`` are left as
        they are. Returns the paths filled; on an invalid value nothing changes."""
        raw = copy.deepcopy(self._raw)
        filled = fill_auto_values(raw, values)
        if filled:
            refreshed = type(self)._from_dict(raw, self._source, [], self._warned)
            for name in type(self).model_fields:
                setattr(self, name, getattr(refreshed, name))
            for name in ("_raw", "_given_batch", "_warned"):
                setattr(self, name, getattr(refreshed, name))
        return filled

    def finalize(self, world_size: int = 1) -> "DeepSpeedConfig":
        """A copy ready for the engine: no ``"auto"`` left, the three batch numbers resolved
        for ``world_size`` data-parallel ranks, and nothing asked for that is not built yet."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise DeepSpeedConfigError(
                [
                    f"world_size = {world_size!r}: expected a positive integer, the number of "
                    "data-parallel ranks"
                ],
                self._source,
            )
        auto = self.auto_paths
        if auto:
            raise DeepSpeedConfigError([unresolved_auto_problem(list(auto))], self._source)
        problems = []
        try:
            sizes = resolve_batch_sizes(*self._given_batch, world_size)
        except ValueError as error:
            problems.append(str(error))
        problems += refuse_features_not_built_yet(self.zero_optimization)
        if problems:
            raise DeepSpeedConfigError(problems, self._source)
        final = self.model_copy(deep=True)
        final.train_batch_size = sizes.train_batch_size
        final.train_micro_batch_size_per_gpu = sizes.train_micro_batch_size_per_gpu
        final.gradient_accumulation_steps = sizes.gradient_accumulation_steps
        final._world_size = world_size
        return final

    def _configure_train_batch_size(self) -> None:
        """DeepSpeed's (its tests and scripts that edit a built config call it): the three
        batch fields resolved again, in place, from those set (None: derived), for the world
        size the config was finalised for. Values that contradict each other or leave one
        underivable raise ``BatchSizeError`` (an AssertionError, as DeepSpeed's)."""
        world_size = self._world_size or _data_parallel_world_size(None)
        given = (
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
        )
        try:
            sizes = resolve_batch_sizes(*given, world_size)
        except ValueError as error:
            raise BatchSizeError([str(error)], self._source) from None
        self.train_batch_size = sizes.train_batch_size
        self.train_micro_batch_size_per_gpu = sizes.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = sizes.gradient_accumulation_steps

    # --- read-only views -----------------------------------------------------------------------
    @property
    def raw(self) -> dict:
        """The config as given (``"auto"`` values filled by ``fill_auto``), as a fresh copy."""
        return copy.deepcopy(self._raw)

    @property
    def source(self) -> str:
        """Where the config came from: its file path, "dict" or "base64"."""
        return self._source

    @property
    def auto_paths(self) -> tuple[str, ...]:
        """Dotted key paths still holding ``"auto"`` (not counting ignored sections)."""
        return tuple(find_auto_paths(self._raw, skip=ignored_key_paths() | AUTO_AS_VALUE))

    @property
    def world_size(self) -> int | None:
        """The world size the config was finalised for (None before ``finalize``)."""
        return self._world_size

    @property
    def is_finalized(self) -> bool:
        return self._world_size is not None

    def step_during_backward_setting(self) -> bool | None:
        """``offload_optimizer.step_during_backward`` for the engine: the value set, or, unset,
        None ("wherever the engine can") for NVMe offload that nothing in the config excludes,
        False for anything else."""
        part = self.zero_optimization.offload_optimizer
        if part is None or part.step_during_backward is not None:
            return None if part is None else part.step_during_backward
        if part.device != "nvme" or _step_during_backward_problems(self):
            return False
        return None

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level section or value of the config as given (a copy), dict-style.

        DeepSpeed's ``engine.config`` is the config dict itself, and code written for it reads
        it that way (transformers' ``Trainer.save_model`` asks
        ``engine.config.get("zero_optimization", {}).get("stage")``)."""
        if key not in self._raw:
            return default
        return copy.deepcopy(self._raw[key])


_WARNED_KEYS: set[str] = set()
"""Keys warned about in this process: a script that builds several engines (or a config that
is finalised again) is told about each key once."""
_QUOTED_KEY = re.compile(r"^'([A-Za-z0-9_.]+)'")
_DOTTED_KEY = re.compile(r"^([a-z0-9_]+(?:\.[a-z0-9_]+)+)\b")


def offload_param_needs_offload_optimizer(device: str) -> str:
    """Why ``offload_param`` alone is refused when there is an optimizer to step."""
    return (
        f'zero_optimization.offload_param.device = "{device}" needs offload_optimizer.device '
        f'"cpu" or "nvme" too in deepspeed_cpp when there is an optimizer (the fp32 masters of '
        f"offloaded parameters are stepped on the host); add offload_optimizer, or leave the "
        f"optimizer out for inference"
    )


def _warning_key(message: str) -> str:
    """The key a warning is about (its leading 'key' or dotted.key), else the message."""
    match = _QUOTED_KEY.match(message) or _DOTTED_KEY.match(message)
    return match.group(1) if match else message


def _this_rank() -> int:
    """The global rank: the process group's, or before it exists the launcher's RANK."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _may_differ_between_ranks(key: str) -> bool:
    """Whether a warning about ``key`` may say something else on another rank.

    Every rank of a job reads the same config, and initialize() refuses ranks whose configs
    differ (rank_consistency.py), so a warning about the config says the same thing on every
    rank and rank 0 says it for all: the guide's templates drew each warning once per rank.
    The exception is the keys each rank may set for its own machine (PER_RANK_CONFIG_KEYS:
    cpuadam_cores_perc, nvme_path, ...): a warning about one of them is said on every rank that
    has it, with the rank's number."""
    from ..rank_consistency import PER_RANK_CONFIG_KEYS

    return any(key == path or key.startswith(path + ".") for path in PER_RANK_CONFIG_KEYS)


def forget_warnings() -> None:
    """Lets every key be warned about again (for tests that count the warnings)."""
    _WARNED_KEYS.clear()


@functools.cache
def _known_key_paths() -> frozenset[str]:
    """Every key path the schema knows, to say where a misplaced key belongs."""
    paths = model_key_paths(DeepSpeedConfig) | policy_key_paths()
    for section, by_type in (("optimizer", OPTIMIZER_PARAMS), ("scheduler", SCHEDULER_PARAMS)):
        for model in by_type.values():
            paths |= {f"{section}.params.{key}" for key in model_keys(model)}
    return frozenset(paths)


def _unknown_key(loc: tuple[str, ...], value: Any) -> str:
    parent = loc[:-1]
    section = section_model_at(DeepSpeedConfig, parent)
    candidates = (model_keys(section) if section is not None else set()) | policies_under(
        join_path(parent)
    )
    return unknown_key_problem(loc, value, candidates, _known_key_paths())


def _step_during_backward_problems(config) -> list[str]:
    """What excludes stepping sub-groups during backward: anything that needs every gradient
    of the step (or the whole step on the host) before the first sub-group may be stepped."""
    zero = config.zero_optimization
    part = zero.offload_optimizer
    key = "zero_optimization.offload_optimizer.step_during_backward = true"
    conflicts = []
    if not is_auto(config.gradient_clipping) and config.gradient_clipping > 0:
        default = "" if "gradient_clipping" in config.model_fields_set else ", the default"
        conflicts.append(
            f"gradient_clipping = {config.gradient_clipping}{default} (clipping needs the global "
            f"norm of every gradient first; gradient_clipping = 0 turns it off)"
        )
    if config.fp16.enabled is True:
        conflicts.append("fp16.enabled = true (the overflow check needs every gradient first)")
    if part.delayed_param_update:
        conflicts.append(
            "zero_optimization.offload_optimizer.delayed_param_update = true (the step already "
            "runs beside the next forward)"
        )
    if not is_auto(part.ratio) and part.ratio < 1.0:
        conflicts.append(
            f"zero_optimization.offload_optimizer.ratio = {part.ratio} (the part left on the "
            f"device is stepped at once)"
        )
    return [f"{key} cannot be combined with {what}; turn one of them off" for what in conflicts]


def _offload_keys_without_effect(part) -> list[str]:
    """DeepSpeed's offload_optimizer tuning keys that change nothing in deepspeed_cpp."""
    where = "zero_optimization.offload_optimizer"
    said = []
    if part.fast_init:
        said.append(
            f"{where}.fast_init = true has no effect in deepspeed_cpp: the NVMe state files are "
            f"always written one sub-group at a time from the fp32 masters"
        )
    if not part.convert_grad_on_cpu:
        said.append(
            f"{where}.convert_grad_on_cpu = false has no effect in deepspeed_cpp: gradients are "
            f"reduced in fp32 on the device and copied to the host as they are"
        )
    if part.cpuadam_cores_perc != 0.8:
        said.append(
            f"{where}.cpuadam_cores_perc = {part.cpuadam_cores_perc} has no effect in "
            f"deepspeed_cpp: the CPU optimizer uses torch's intra-op threads "
            f"(torch.set_num_threads / OMP_NUM_THREADS)"
        )
    return said
