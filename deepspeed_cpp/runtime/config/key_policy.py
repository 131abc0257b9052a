"""The decision table: what deepspeed_cpp does with each DeepSpeed key it does not model.

A config that DeepSpeed accepts must never fail here with "unknown key". Every DeepSpeed key is
therefore either

* **honoured**: a field of the typed schema (``deepspeed_config.py``, ``sections.py``,
  ``optimizer.py``, ``scheduler.py``); those keys are not listed here;
* **ignored** (``_ignored``): accepted with one warning, because it only changes logging, or
  configures a DeepSpeed API that scripts call themselves and that deepspeed_cpp does not
  provide (its use would fail at that call, not silently);
* **deprecated** (``_deprecated``): an old spelling, accepted with one warning and moved to its
  current key where it has one;
* **harmless only at some values** (``_harmless_at``): accepted with one warning while its value
  asks for DeepSpeed's default behaviour, which is ours; any other value is refused as "not
  supported yet" rather than silently ignored;
* **refused** (``_refused``): "not supported yet" whatever the value.

``_section`` marks an object whose children are listed below it: after they are handled, any
other key left inside it is unknown. The keys were taken from DeepSpeed's configuration
documentation (https://www.deepspeed.ai/docs/config-json/) and its config classes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import show
from .key_names import nearest_key
from .values import is_auto


class Treatment(enum.Enum):
    IGNORED = "ignored"
    DEPRECATED = "deprecated"
    HARMLESS_AT = "harmless_at"
    REFUSED = "refused"
    SECTION = "section"


@dataclass(frozen=True)
class KeyPolicy:
    """What to do with the key at ``path`` (dotted, e.g. ``zero_optimization.legacy_stage1``)."""

    path: str
    treatment: Treatment
    reason: str = ""
    # HARMLESS_AT: whether a value is harmless, and those values in words for the refusal.
    harmless: Callable[[Any], bool] | None = None
    harmless_text: str = ""
    # IGNORED objects: their known keys (None: not checked, e.g. deeply nested research configs).
    subkeys: frozenset[str] | None = None
    # DEPRECATED: where the value goes now; ``convert`` maps the old value to (path, new value),
    # or to None when the old value asks for nothing.
    move_to: str | None = None
    convert: Callable[[Any], tuple[str, Any] | None] | None = None
    is_object: bool = False

    @property
    def depth(self) -> int:
        return self.path.count(".")


def _same(value: Any, expected: Any) -> bool:
    """JSON equality that keeps booleans apart from numbers (false is not 0)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return value is expected
    return value == expected


def _ignored(path: str, reason: str, subkeys: Iterable[str] | None = None) -> KeyPolicy:
    keys = frozenset(subkeys) if subkeys is not None else None
    return KeyPolicy(path, Treatment.IGNORED, reason, subkeys=keys, is_object=keys is not None)


def _deprecated(path: str, reason: str, move_to: str | None = None, convert=None) -> KeyPolicy:
    return KeyPolicy(path, Treatment.DEPRECATED, reason, move_to=move_to, convert=convert)


def _harmless_at(path: str, harmless_values: tuple, reason: str) -> KeyPolicy:
    def harmless(value: Any) -> bool:
        return any(_same(value, allowed) for allowed in harmless_values)

    text = " or ".join(show(value) for value in harmless_values)
    return KeyPolicy(path, Treatment.HARMLESS_AT, reason, harmless, text)


def _harmless_when(path: str, harmless, harmless_text: str, reason: str) -> KeyPolicy:
    return KeyPolicy(path, Treatment.HARMLESS_AT, reason, harmless, harmless_text, is_object=True)


def _refused(path: str, reason: str) -> KeyPolicy:
    return KeyPolicy(path, Treatment.REFUSED, reason)


def _section(path: str) -> KeyPolicy:
    return KeyPolicy(path, Treatment.SECTION, is_object=True)


def _not_enabled(section: dict) -> bool:
    return section.get("enabled", False) is False


def _nothing_enabled(value: Any) -> bool:
    """No ``"enabled": true`` anywhere inside (compression_training nests them deeply)."""
    if isinstance(value, dict):
        return value.get("enabled") is not True and all(map(_nothing_enabled, value.values()))
    if isinstance(value, list):
        return all(map(_nothing_enabled, value))
    return True


def _offload_from_bool(target: str) -> Callable[[Any], tuple[str, Any] | None]:
    def convert(value: Any):
        if value is True:
            return target, {"device": "cpu"}
        if value is False:
            return None
        raise ValueError("expected true or false")

    return convert


def _stage3_only(*keys: str) -> list[KeyPolicy]:
    """ZeRO-3 tuning knobs we do not model: accepted (both spellings) and ignored."""
    policies = []
    for key in keys:
        for spelling in {key, key.removeprefix("stage3_")}:
            policies.append(_ignored(f"zero_optimization.{spelling}", "it only tunes ZeRO stage 3"))
    return policies


_NO_API = "it configures a DeepSpeed API that deepspeed_cpp does not provide yet"

POLICIES: tuple[KeyPolicy, ...] = (
    # --- logging, monitoring and profiling: no effect on training -----------------------------
    _ignored(
        "timers",
        "deepspeed_cpp's timers are set by wall_clock_breakdown; its throughput timer "
        "(engine.tput_timer) is always on",
    ),
    _ignored("dump_state", "deepspeed_cpp does not print its state after initialisation"),
    _ignored("vocabulary_size", "DeepSpeed only uses it for a tensor-core alignment warning"),
    _ignored("log_level", "deepspeed_cpp's log level is set on the 'deepspeed_cpp' logger"),
    # --- configure APIs that a script calls itself; deepspeed_cpp does not provide them yet ---
    _ignored("sparse_attention", _NO_API + " (sparse attention modules)"),
    # --- gradient communication ---------------------------------------------------------------
    _harmless_at("prescale_gradients", (False,), "gradients are averaged after the reduction"),
    _harmless_at("gradient_predivide_factor", (1.0,), "gradients are not pre-divided"),
    _harmless_at(
        "communication_data_type", (None,), "gradients are communicated in their own dtype"
    ),
    _ignored("seq_parallel_comm_data_type", "there is no sequence parallelism"),
    _ignored("seq_parallel_communication_data_type", "there is no sequence parallelism"),
    _harmless_at("sparse_gradients", (False,), "gradients are reduced as dense tensors"),
    _harmless_at("disable_allgather", (False,), "updated partitions are all-gathered"),
    _harmless_at("sequence_parallel_size", (1,), "there is no sequence parallelism"),
    _ignored("use_data_before_expert_parallelism", "there is no expert parallelism"),
    # --- engine behaviour ---------------------------------------------------------------------
    _harmless_at(
        "managed_gradient_accumulation", (True,), "the engine tracks accumulation boundaries"
    ),
    _harmless_at("graph_harvesting", (False,), "CUDA graphs are not captured"),
    _harmless_at("disable_python_gc", (False,), "Python's garbage collector is left alone"),
    _deprecated(
        "allgather_size",
        "it is only read with the boolean form of 'zero_optimization'; use "
        "zero_optimization.allgather_bucket_size",
    ),
    _section("data_types"),
    # Judged in grad_accum_dtype.py, which takes it out first (the judgement needs fp16/bf16 and
    # the ZeRO stage); listed so that a misspelling is pointed to it.
    _harmless_at("data_types.grad_accum_dtype", (None,), "gradients accumulate in fp32"),
    _harmless_at("data_types.param_dtype", (None,), "parameters keep their dtype"),
    _harmless_at("data_types.buffer_dtype", (None,), "buffers keep their dtype"),
    # checkpoint.tag_validation is a field of the schema (sections.CheckpointConfig).
    _harmless_at("checkpoint.load_universal", (False,), "checkpoints load in their own format"),
    _harmless_at("checkpoint.use_node_local_storage", (False,), "checkpoints use one folder"),
    _ignored("checkpoint.parallel_write", "it only applies to pipeline parallelism"),
    _ignored("checkpoint.serialization", "checkpoints are written with torch.save"),
    _ignored("checkpoint.writer", "checkpoints are written with torch.save"),
    # --- features refused while enabled: disabled (or absent) they change nothing -------------
    _harmless_when("amp", _not_enabled, '"enabled": false', "use fp16 or bf16 instead of Apex"),
    _harmless_when("torch_autocast", _not_enabled, '"enabled": false', "use fp16 or bf16"),
    _harmless_when("autotuning", _not_enabled, '"enabled": false', "no autotuner"),
    _harmless_when("elasticity", _not_enabled, '"enabled": false', "no elastic training"),
    _harmless_when("data_efficiency", _not_enabled, '"enabled": false', "no data efficiency"),
    _harmless_when("curriculum_learning", _not_enabled, '"enabled": false', "no curriculum"),
    _harmless_when("progressive_layer_drop", _not_enabled, '"enabled": false', "no layer dropping"),
    _harmless_when("quantize_training", _not_enabled, '"enabled": false', "no MoQ"),
    _harmless_when("hybrid_engine", _not_enabled, '"enabled": false', "no RLHF hybrid engine"),
    _harmless_when("expert_parallel", _not_enabled, '"enabled": false', "no expert parallelism"),
    _harmless_when("nebula", _not_enabled, '"enabled": false', "no Nebula checkpoint engine"),
    _harmless_when(
        "compression_training", _nothing_enabled, 'no "enabled": true', "no compression"
    ),
    _harmless_when(
        "compile", lambda c: not c.get("deepcompile"), '"deepcompile": false', "no DeepCompile"
    ),
    # tensor_parallel (TensorParallelConfig): autotp_size, partition_config, preset_model.
    _ignored("tensor_parallel.dtype", "the model trains in the dtype of the fp16/bf16 sections"),
    _harmless_at("tensor_parallel.tp_overlap_comm", (False,), "the all-reduces run in order"),
    _harmless_at(
        "tensor_parallel.vocab_parallel_lm_head", (None, False), "lm_head's logits are gathered"
    ),
    _ignored("tensor_parallel.vocab_parallel_ce_backend", "lm_head's logits are gathered"),
    _harmless_at("tensor_parallel.keep_module_on_host", (False,), "no checkpoint is loaded here"),
    _harmless_at("tensor_parallel.replace_with_kernel_inject", (False,), "no inference kernels"),
    _harmless_at("tensor_parallel.kernel_inject", (False,), "no inference kernels"),
    _refused(
        "tensor_parallel.injection_policy_tuple",
        "give the layers with tensor_parallel.partition_config.layer_specs",
    ),
    _section("tensor_parallel.tp"),
    _harmless_at("tensor_parallel.tp.tp_grain_size", (1,), "layers are split evenly"),
    _ignored("tensor_parallel.tp.tp_size", "the TP size is tensor_parallel.autotp_size"),
    _ignored("tensor_parallel.tp.mpu", "the groups are built from autotp_size"),
    _ignored("tensor_parallel.tp.tp_group", "the groups are built from autotp_size"),
    _section("tensor_parallel.tensor_parallel"),
    _harmless_at("tensor_parallel.tensor_parallel.tp_grain_size", (1,), "layers split evenly"),
    _ignored("tensor_parallel.tensor_parallel.tp_size", "the TP size is autotp_size"),
    _ignored("tensor_parallel.tensor_parallel.mpu", "the groups are built from autotp_size"),
    _ignored("tensor_parallel.tensor_parallel.tp_group", "the groups are built from autotp_size"),
    _refused("weight_quantization", "it quantizes weights for inference"),
    # --- mixed precision ----------------------------------------------------------------------
    _deprecated("bfloat16", "it is the old spelling of 'bf16'", move_to="bf16"),
    _deprecated("fp16.fused_mode", "fused or not, the fp16 step gives the same result"),
    _harmless_at("fp16.fp16_master_weights_and_grads", (False,), "master weights are kept in fp32"),
    _ignored("bf16.immediate_grad_update", "it only chooses when DeepSpeed's bf16 step runs"),
    _harmless_at("bf16.bf16_master_weights_and_grads", (False,), "master weights are in fp32"),
    _harmless_at("bf16.bf16_optimizer_states", (False,), "optimizer states are kept in fp32"),
    # --- optimizer ----------------------------------------------------------------------------
    _harmless_at("optimizer.legacy_fusion", (False,), "there is no legacy fused fp16 optimizer"),
    _harmless_at("optimizer.params.amsgrad", (False,), "Adam without the AMSGrad maximum"),
    _harmless_at("optimizer.params.maximize", (False,), "the loss is minimised"),
    _ignored("optimizer.params.set_grad_none", "gradients are always released as None"),
    _ignored("optimizer.params.foreach", "it picks torch's kernel, not the result"),
    _ignored("optimizer.params.fused", "it picks torch's kernel, not the result"),
    _ignored("optimizer.params.capturable", "it picks torch's kernel, not the result"),
    _ignored("optimizer.params.differentiable", "it picks torch's kernel, not the result"),
    _refused(
        "optimizer.params.max_grad_norm",
        "DeepSpeed refuses it too: clip with the top-level 'gradient_clipping'",
    ),
    # --- ZeRO ---------------------------------------------------------------------------------
    _deprecated(
        "zero_optimization.cpu_offload",
        "use zero_optimization.offload_optimizer",
        convert=_offload_from_bool("zero_optimization.offload_optimizer"),
    ),
    _deprecated(
        "zero_optimization.cpu_offload_param",
        "use zero_optimization.offload_param",
        convert=_offload_from_bool("zero_optimization.offload_param"),
    ),
    _deprecated(
        "zero_optimization.cpu_offload_use_pin_memory",
        "use pin_memory in offload_optimizer or offload_param",
    ),
    _deprecated(
        "zero_optimization.stage3_gather_fp16_weights_on_model_save",
        "it is the old name of stage3_gather_16bit_weights_on_model_save",
        move_to="zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    _deprecated(
        "zero_optimization.elastic_checkpoint",
        "deepspeed_cpp checkpoints load at any world size without it",
    ),
    _ignored(
        "zero_optimization.allgather_partitions",
        "updated partitions are always all-gathered; DeepSpeed's broadcast alternative gives "
        "the same parameters",
    ),
    _ignored(
        "zero_optimization.round_robin_gradients",
        "it only orders DeepSpeed's gradient copies to the host; results are the same",
    ),
    _ignored(
        "zero_optimization.use_multi_rank_bucket_allreduce", "it picks a collective, not a result"
    ),
    _ignored("zero_optimization.enable_sanity_checks", "it only adds DeepSpeed's debug checks"),
    _harmless_at(
        "zero_optimization.load_from_fp32_weights", (True,), "fp32 master weights are restored"
    ),
    _harmless_at("zero_optimization.legacy_stage1", (False,), "there is one stage 1"),
    _harmless_at("zero_optimization.zero_hpz_partition_size", (1,), "no hierarchical ZeRO++"),
    _harmless_at("zero_optimization.zero_quantized_weights", (False,), "no ZeRO++ quantisation"),
    _harmless_at(
        "zero_optimization.zero_quantized_nontrainable_weights", (False,), "no quantisation"
    ),
    _harmless_at("zero_optimization.zero_quantized_gradients", (False,), "no ZeRO++ gradients"),
    _harmless_at("zero_optimization.zeropp_loco_param", (None,), "no LoCo-ZeRO++"),
    _harmless_at("zero_optimization.mics_shard_size", (-1,), "no MiCS sharding"),
    _harmless_at("zero_optimization.mics_hierarchical_params_gather", (False,), "no MiCS"),
    _harmless_at("zero_optimization.zenflow", (None,), "no ZenFlow"),
    _harmless_at("zero_optimization.compute_grad_norm", (True,), "the norm is always computed"),
    _harmless_at("zero_optimization.parameter_alignment", (False,), "no extra padding"),
    *_stage3_only(
        "stage3_module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential",
        "stage3_partition_stream_chunk_size",
        "memory_efficient_linear",
        "override_module_apply",
        "pipeline_loading_checkpoint",
        "log_trace_cache_warnings",
        "save_muon_momentum_buffer_in_memory",
    ),
)


def policies_under(path: str) -> set[str]:
    """The keys this table knows directly inside the object at ``path`` ("" for the top)."""
    prefix = f"{path}." if path else ""
    keys = set()
    for policy in POLICIES:
        if policy.path.startswith(prefix) and "." not in policy.path[len(prefix) :]:
            keys.add(policy.path[len(prefix) :])
    return keys


def ignored_key_paths() -> frozenset[str]:
    """Keys whose value is never read (an "auto" there needs no filling)."""
    return frozenset(p.path for p in POLICIES if p.treatment is Treatment.IGNORED)


def policy_key_paths() -> set[str]:
    """Every key path the table knows, with the known keys of ignored objects."""
    paths = set()
    for policy in POLICIES:
        paths.add(policy.path)
        for key in policy.subkeys or ():
            paths.add(f"{policy.path}.{key}")
    return paths


@dataclass
class PolicyOutcome:
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _parent_of(data: dict, path: str, create: bool = False) -> dict | None:
    node = data
    for key in path.split(".")[:-1]:
        child = node.get(key)
        if child is None and create:
            child = node[key] = {}
        if not isinstance(child, dict):
            return None
        node = child
    return node


def _contains_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(map(_contains_auto, value.values()))
    if isinstance(value, list):
        return any(map(_contains_auto, value))
    return is_auto(value)


def _place(data: dict, path: str, value: Any, old_path: str, outcome: PolicyOutcome) -> None:
    """Puts a deprecated key's value at its current key, unless that key is set too."""
    parent = _parent_of(data, path, create=True)
    key = path.split(".")[-1]
    current_names = {key, key.removeprefix("stage3_")}
    if parent is None:
        return  # the parent is not an object; the schema reports that
    given = current_names & set(parent)
    if given:
        current = path.rsplit(".", 1)[0] + "." + given.pop() if "." in path else given.pop()
        outcome.problems.append(
            f"both '{old_path}' and '{current}' are given: '{old_path}' is the deprecated "
            f"spelling, keep only '{current}'"
        )
        return
    parent[key] = value


def _convert_boolean_zero(data: dict, outcome: PolicyOutcome) -> None:
    """DeepSpeed's oldest form, ``"zero_optimization": true``, meant stage 1."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, bool):
        return
    outcome.warnings.append(
        f"'zero_optimization': {show(zero)} is deprecated in DeepSpeed: write "
        f'"zero_optimization": {{"stage": {int(zero)}}}'
    )
    data["zero_optimization"] = {"stage": int(zero)}
    if zero and "allgather_size" in data:
        data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size")


def _report_unknown_children(
    path: str, value: dict, known: Iterable[str], outcome: PolicyOutcome
) -> None:
    known = sorted(known)
    for key, child in value.items():
        if key in known:
            continue
        close = nearest_key(key, known)
        hint = (
            f"did you mean '{path}.{close}'?"
            if close
            else "expected one of " + ", ".join(f"'{name}'" for name in known)
        )
        outcome.problems.append(f"unknown key '{path}.{key}' (value {show(child)}): {hint}")


def _apply(policy: KeyPolicy, value: Any, data: dict, outcome: PolicyOutcome) -> None:
    path = policy.path
    if policy.is_object and not isinstance(value, dict):
        outcome.problems.append(f"{path} = {show(value)}: expected a JSON object {{...}}")
        return
    if policy.treatment is Treatment.SECTION:
        _report_unknown_children(path, value, policies_under(path), outcome)
        return  # its known children were taken out (and judged) before it
    if policy.subkeys is not None:
        _report_unknown_children(path, value, policy.subkeys, outcome)
    if policy.treatment is Treatment.IGNORED:
        outcome.warnings.append(f"'{path}' is ignored by deepspeed_cpp: {policy.reason}")
    elif policy.treatment is Treatment.DEPRECATED:
        outcome.warnings.append(f"'{path}' is deprecated in DeepSpeed: {policy.reason}")
        if policy.move_to is not None:
            _place(data, policy.move_to, value, path, outcome)
        elif policy.convert is not None:
            try:
                moved = policy.convert(value)
            except ValueError as error:
                outcome.problems.append(f"{path} = {show(value)}: {error}")
                return
            if moved is not None:
                _place(data, moved[0], moved[1], path, outcome)
    elif _contains_auto(value):
        return  # judged once the "auto" is filled in (finalize() refuses it until then)
    elif policy.treatment is Treatment.HARMLESS_AT and policy.harmless(value):
        outcome.warnings.append(
            f"'{path}': {show(value)} has no effect in deepspeed_cpp ({policy.reason})"
        )
    else:
        expected = (
            f"expected {policy.harmless_text}, or remove the key"
            if policy.treatment is Treatment.HARMLESS_AT
            else "remove the key"
        )
        outcome.problems.append(
            f"{path} = {show(value)}: not supported yet by deepspeed_cpp ({policy.reason}); "
            f"{expected}"
        )


def apply_key_policies(data: dict) -> PolicyOutcome:
    """Takes every key of the table out of ``data`` (in place), judging each one.

    Deprecated spellings move first, so that their values are judged at their new keys; then
    the deepest keys go first, so that an object's known children are gone before what is left
    inside it is reported as unknown.
    """
    outcome = PolicyOutcome()
    _convert_boolean_zero(data, outcome)
    ordered = sorted(
        POLICIES, key=lambda p: (p.treatment is not Treatment.DEPRECATED, -p.depth, p.path)
    )
    for policy in ordered:
        parent = _parent_of(data, policy.path)
        key = policy.path.split(".")[-1]
        if parent is None or key not in parent:
            continue
        _apply(policy, parent.pop(key), data, outcome)
    return outcome
