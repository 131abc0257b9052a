"""``deepspeed.checkpointing`` (DeepSpeed's ``deepspeed.runtime.activation_checkpointing
.checkpointing``): activation checkpointing whose recomputation reproduces dropout exactly, with
DeepSpeed's options for where the saved inputs are kept.

``checkpoint(function, *args)`` runs ``function`` without keeping its intermediate activations
and recomputes them in the backward. The recomputation is ``torch.utils.checkpoint``'s
non-reentrant one (gradients reach the parameters even when no input requires grad; works with
ZeRO-3's parameter hooks); on top of it this module restores the model-parallel RNG tracker's
states (``rng_tracker.py``) to those of the forward, so a dropout forked into the tracker draws
the same mask again, and keeps the saved inputs as configured (``saved_inputs.py``).

The configuration lives in module attributes under DeepSpeed's names (``PARTITION_ACTIVATIONS``,
``CPU_CHECKPOINT``, ``CONTIGUOUS_CHECKPOINTING``, ``num_layers``, ``SYNCHRONIZE``,
``PROFILE_TIME``, ``mpu``, ``deepspeed_checkpointing_enabled``): DeepSpeed's scripts and tests
read and set them directly, so every call reads them afresh.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ...accelerator import get_accelerator
from ...utils.logging import logger
from .rng_tracker import (
    MODEL_PARALLEL_RNG_TRACKER_NAME,
    CudaRNGStatesTracker,
    RNGStateError,
    get_cuda_rng_tracker,
    reseed_model_parallel,
    seed_model_parallel,
)
from .saved_inputs import ContiguousBuffers, SavedInputHooks, SavedInputStats

__all__ = [
    "MODEL_PARALLEL_RNG_TRACKER_NAME",
    "ActivationCheckpointingConfigError",
    "CudaRNGStatesTracker",
    "RNGStateError",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "saved_input_stats",
    "set_num_layers",
]

# --- configuration, under DeepSpeed's names -----------------------------------------------------
deepspeed_checkpointing_enabled = False
mpu = None
mp_rank, mp_size, mp_group = 0, 1, None
num_layers = None
PARTITION_ACTIVATIONS = False
CONTIGUOUS_CHECKPOINTING = False
CPU_CHECKPOINT = False
SYNCHRONIZE = False
PROFILE_TIME = False

# Who configured the module: "configure" (the script; initialize() then leaves it alone) or
# "initialize" (the config's activation_checkpointing section); None before either.
_configured_by = None
_buffers: ContiguousBuffers | None = None
_stats = SavedInputStats()


class ActivationCheckpointingConfigError(ValueError, AssertionError):
    """An activation-checkpointing setting is invalid. Also an AssertionError, the type DeepSpeed
    raises for the same mistakes (scripts and tests catch that)."""


_CONFIGURE_FLAGS = {
    "partition_activations": "PARTITION_ACTIVATIONS",
    "contiguous_checkpointing": "CONTIGUOUS_CHECKPOINTING",
    "checkpoint_in_cpu": "CPU_CHECKPOINT",
    "synchronize": "SYNCHRONIZE",
    "profile": "PROFILE_TIME",
}


def configure(
    mpu_,
    deepspeed_config=None,
    partition_activations=None,
    contiguous_checkpointing=None,
    num_checkpoints=None,
    checkpoint_in_cpu=None,
    synchronize=None,
    profile=None,
) -> None:
    """Configures checkpointing as DeepSpeed's ``configure`` does: every setting back to its
    default, then the ``activation_checkpointing`` section of ``deepspeed_config`` (a path, dict or
    ``DeepSpeedConfig``), then each argument that is not None. ``mpu_`` (an object with
    ``get_{tensor_,}model_parallel_{rank,world_size,group}``) gives the group that
    ``partition_activations`` splits saved inputs across; None keeps the one configured before."""
    settings = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    for name, value in settings.items():
        if value is not None and not isinstance(value, bool):
            raise ActivationCheckpointingConfigError(
                f"deepspeed.checkpointing.configure({name}={value!r}): expected True, False or None"
            )
    valid_count = isinstance(num_checkpoints, int) and not isinstance(num_checkpoints, bool)
    if num_checkpoints is not None and not (valid_count and num_checkpoints >= 1):
        raise ActivationCheckpointingConfigError(
            f"deepspeed.checkpointing.configure(num_checkpoints={num_checkpoints!r}): expected a "
            "positive int (the number of layers checkpointed per forward) or None"
        )
    section = None
    if deepspeed_config is not None:
        from ..config import DeepSpeedConfig

        section = DeepSpeedConfig.parse(deepspeed_config).activation_checkpointing
    _apply(mpu_, section, settings, num_checkpoints, by="configure")


def configure_from_config(section, mpu_=None) -> None:
    """``initialize()``'s part: apply the config's ``activation_checkpointing`` section, unless
    the script configured the module itself with ``configure`` (its explicit choices win, as under
    DeepSpeed, whose engine never reads the section)."""
    if _configured_by == "configure":
        logger.info(
            "activation_checkpointing: the config's section is not applied; "
            "deepspeed.checkpointing.configure() was called and its settings are kept"
        )
        return
    _apply(mpu_, section, {}, None, by="initialize")


def _apply(mpu_, section, settings: dict, num_checkpoints, by: str) -> None:
    global mpu, mp_rank, mp_size, mp_group, num_layers, deepspeed_checkpointing_enabled
    global PARTITION_ACTIVATIONS, CONTIGUOUS_CHECKPOINTING, CPU_CHECKPOINT, SYNCHRONIZE
    global PROFILE_TIME, _configured_by, _buffers
    values = {
        "PARTITION_ACTIVATIONS": False,
        "CONTIGUOUS_CHECKPOINTING": False,
        "CPU_CHECKPOINT": False,
        "SYNCHRONIZE": False,
        "PROFILE_TIME": False,
    }
    layers = None
    if section is not None:
        values["PARTITION_ACTIVATIONS"] = section.partition_activations
        values["CONTIGUOUS_CHECKPOINTING"] = section.contiguous_memory_optimization
        values["CPU_CHECKPOINT"] = section.cpu_checkpointing
        values["SYNCHRONIZE"] = section.synchronize_checkpoint_boundary
        values["PROFILE_TIME"] = section.profile
        layers = section.number_checkpoints
    for name, value in settings.items():
        if value is not None:
            values[_CONFIGURE_FLAGS[name]] = value
    if num_checkpoints is not None:
        layers = num_checkpoints
    if values["CONTIGUOUS_CHECKPOINTING"] and not values["PARTITION_ACTIVATIONS"]:
        raise ActivationCheckpointingConfigError(
            "contiguous checkpointing (contiguous_memory_optimization) is only available with "
            "partitioned activations: set partition_activations too"
        )
    if values["CONTIGUOUS_CHECKPOINTING"] and layers is None:
        raise ActivationCheckpointingConfigError(
            "contiguous checkpointing needs the number of layers checkpointed per forward: "
            "num_checkpoints= (config: number_checkpoints)"
        )
    new_mpu = mpu_ if mpu_ is not None else mpu
    group_rank, group_size, group = _model_parallel_group(new_mpu)
    # Checked, then committed: a refused configuration leaves the previous one in place.
    mpu, mp_rank, mp_size, mp_group = new_mpu, group_rank, group_size, group
    PARTITION_ACTIVATIONS = values["PARTITION_ACTIVATIONS"]
    CONTIGUOUS_CHECKPOINTING = values["CONTIGUOUS_CHECKPOINTING"]
    CPU_CHECKPOINT = values["CPU_CHECKPOINT"]
    SYNCHRONIZE = values["SYNCHRONIZE"]
    PROFILE_TIME = values["PROFILE_TIME"]
    num_layers = layers
    deepspeed_checkpointing_enabled = True
    _configured_by = by
    _buffers = None
    _log_configuration(by)


def _model_parallel_group(mpu_):
    """(rank, size, group) of the tensor-model-parallel group, DeepSpeed's conventions first."""
    if mpu_ is None:
        return 0, 1, None
    if hasattr(mpu_, "get_tensor_model_parallel_rank"):
        prefix = "get_tensor_model_parallel_"
    else:
        prefix = "get_model_parallel_"
    try:
        return (
            getattr(mpu_, prefix + "rank")(),
            getattr(mpu_, prefix + "world_size")(),
            getattr(mpu_, prefix + "group")(),
        )
    except AttributeError as error:
        raise ActivationCheckpointingConfigError(
            f"deepspeed.checkpointing.configure(mpu_={type(mpu_).__name__} object): expected "
            f"{prefix}rank/world_size/group methods ({error})"
        ) from None


def _log_configuration(by: str) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    source = "deepspeed.checkpointing.configure()" if by == "configure" else "the config"
    logger.info(
        "activation checkpointing (from %s): partition_activations=%s, cpu_checkpointing=%s, "
        "contiguous_memory_optimization=%s with number_checkpoints=%s, synchronize=%s, "
        "profile=%s",
        source,
        PARTITION_ACTIVATIONS,
        CPU_CHECKPOINT,
        CONTIGUOUS_CHECKPOINTING,
        num_layers,
        SYNCHRONIZE,
        PROFILE_TIME,
    )
    if PARTITION_ACTIVATIONS and mp_size == 1:
        logger.info(
            "activation checkpointing: partition_activations has no effect here: %s, so saved "
            "inputs are kept whole",
            "no mpu was given (no model-parallel group)"
            if mpu is None
            else "the model-parallel group has one rank",
        )
    if CPU_CHECKPOINT and get_accelerator().device_name() == "cpu":
        logger.info(
            "activation checkpointing: cpu_checkpointing keeps saved inputs in host memory, where "
            "they already are on the CPU accelerator"
        )


def is_configured() -> bool:
    """True once ``configure`` (or ``initialize`` with an ``activation_checkpointing`` section)
    has configured the module."""
    return deepspeed_checkpointing_enabled


def reset() -> None:
    """Drops the contiguous buffers (call it between forwards that have no backward, e.g. in
    evaluation, where no backward would release them) and zeroes ``saved_input_stats``."""
    global _buffers, _stats
    _buffers = None
    _stats = SavedInputStats()


def saved_input_stats() -> SavedInputStats:
    """A copy of the counts of saved inputs packed, partitioned, sent to the host and rebuilt
    since the last ``reset()``."""
    return SavedInputStats(**vars(_stats))


def set_num_layers(nlayers) -> None:
    """DeepSpeed's setter of ``num_layers`` (the contiguous buffers' slot count)."""
    global num_layers
    num_layers = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter of ``PARTITION_ACTIVATIONS`` alone."""
    global PARTITION_ACTIVATIONS
    PARTITION_ACTIVATIONS = bool(partition_activation)


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seeds the default generator with ``seed`` and the tracker's model-parallel state with
    ``seed + 2718 + tensor-parallel rank`` of the configured mpu (``rng_tracker.py``)."""
    seed_model_parallel(seed, mpu)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seeds only the tracker's model-parallel state, as ``model_parallel_cuda_manual_seed``
    would have seeded it."""
    reseed_model_parallel(seed, mpu)


# --- the checkpoint ---------------------------------------------------------------------------


def checkpoint(function, *args, **kwargs):
    """Runs ``function(*args, **kwargs)`` keeping only its inputs; recomputes it in the backward
    with the CPU, device and tracker RNG states of this forward. Tensors passed by keyword are
    saved like positional ones. Returns what DeepSpeed's does: a tensor as is, a list or tuple of
    outputs as a tuple (a single element unwrapped), anything else as is."""
    if not callable(function):
        raise TypeError(
            f"deepspeed.checkpointing.checkpoint(function={function!r}, ...): expected a callable "
            f"(a module or function) as the first argument, got {type(function).__name__}"
        )
    if kwargs:
        function, args = _keywords_as_positionals(function, args, kwargs)
    if SYNCHRONIZE:
        get_accelerator().synchronize()
    started = time.perf_counter() if PROFILE_TIME else 0.0
    with _saved_input_hooks():
        outputs = torch.utils.checkpoint.checkpoint(
            function,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=_tracker_contexts,
        )
    if SYNCHRONIZE:
        get_accelerator().synchronize()
    if PROFILE_TIME:
        _log_time("forward", started)
    return _as_deepspeed_returns(outputs)


# DeepSpeed's PipelineEngine tells the two apart; here both are the non-reentrant checkpoint.
non_reentrant_checkpoint = checkpoint


def _keywords_as_positionals(function, args: tuple, kwargs: dict):
    """Keyword arguments appended to the positionals, so that their tensors are saved (and kept
    as configured) like the others; the wrapper hands them back by name."""
    names = tuple(kwargs)
    positional_count = len(args)

    def call_with_keywords(*all_args):
        keywords = dict(zip(names, all_args[positional_count:]))
        return function(*all_args[:positional_count], **keywords)

    return call_with_keywords, args + tuple(kwargs.values())


def _saved_input_hooks():
    global _buffers
    partition = PARTITION_ACTIVATIONS and mp_size > 1
    if not (partition or CPU_CHECKPOINT) or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    if partition and CONTIGUOUS_CHECKPOINTING and _buffers is None:
        _buffers = ContiguousBuffers(slots=num_layers)
    hooks = SavedInputHooks(
        group=mp_group,
        group_rank=mp_rank,
        group_size=mp_size if partition else 1,
        to_host=CPU_CHECKPOINT,
        buffers=_buffers if CONTIGUOUS_CHECKPOINTING else None,
        stats=_stats,
    )
    return hooks.installed()


def _tracker_contexts():
    """``torch.utils.checkpoint``'s ``context_fn``, called as the forward starts: nothing extra
    for the forward; for the recomputation, the tracker's states of this moment (and the
    synchronization and timing asked for)."""
    at_forward = get_cuda_rng_tracker().get_states()
    return contextlib.nullcontext(), _recomputation(at_forward)


@contextlib.contextmanager
def _recomputation(at_forward: dict):
    tracker = get_cuda_rng_tracker()
    current = tracker.get_states()
    # A copy: forks inside the recomputation advance it, and a second backward through the same
    # graph (retain_graph) must start from the forward's states again.
    tracker.set_states(dict(at_forward))
    if SYNCHRONIZE:
        get_accelerator().synchronize()
    started = time.perf_counter() if PROFILE_TIME else 0.0
    try:
        yield
    finally:
        tracker.set_states(current)
        if SYNCHRONIZE:
            get_accelerator().synchronize()
        if PROFILE_TIME:
            _log_time("recomputation", started)


def _log_time(what: str, started: float) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    logger.info(
        "activation checkpoint %s: %.3f ms (saved inputs so far: %s)",
        what,
        (time.perf_counter() - started) * 1e3,
        saved_input_stats(),
    )


def _as_deepspeed_returns(outputs):
    if isinstance(outputs, (tuple, list)):
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return outputs
