"""Which layers of a model tensor parallelism splits, and how: a policy per architecture.

A policy names modules by regular expressions matched (``re.fullmatch``) against their qualified
names in the model: ``column`` ones become column-parallel (``LinearLayer``), ``row`` ones
row-parallel (``LinearAllreduce``). Attention q/k/v and the MLP's up/gate projections are split
by column, the attention output and the MLP's down projection by row, so that a transformer
block exchanges activations twice forward (once per row-parallel layer) and twice backward.

Embeddings, position embeddings and norms are not split: every TP rank holds them whole
(replicated) and they get the same gradient on every rank, because the input gradient of a
column-parallel layer and the output of a row-parallel one are summed over the TP group. An
untied ``lm_head`` is split by vocabulary with its logits gathered, a tied one kept whole
(``output_head.py``, DeepSpeed's rule), unless ``output_head`` is false (a policy made only of
the config's ``layer_specs``, which name every layer to split).

Architectures outside the table and without specs: the policy is found from the module graph
(``graph_discovery.py``).

``head_split`` names tensors with one column per attention head (T5's relative position bias):
each rank keeps its heads' columns. ``head_attributes`` names the attributes of attention
modules that count heads or their total width: they are divided by the TP size, so the
module's own reshapes see this rank's heads.

Other architectures: ``register_tp_policy(model_type, policy)``, or DeepSpeed's config hook
``"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": [...],
"partition_type": "row" | "column"}]}}``, whose patterns are searched (``re.search``) in
parameter names such as ``model.layers.0.self_attn.o_proj.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..utils.logging import logger


@dataclass(frozen=True)
class TensorParallelPolicy:
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    # Column-parallel modules whose output features are several fused blocks, each split on its
    # own (q/k/v in one matrix): the number of blocks, or a function of the module giving it.
    fused_blocks: dict[str, int | Callable] = field(default_factory=dict)
    head_split: tuple[str, ...] = ()
    # Attention module class names (regular expressions) -> attributes divided by the TP size.
    head_attributes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Names matched against parameter names with re.search (the config's layer_specs).
    search_parameter_names: bool = False
    # Whether an untied lm_head / embed_out is split by vocabulary (output_head.py).
    output_head: bool = True

    def kind_of(self, module_name: str) -> str | None:
        """ "column", "row" or None for the module named ``module_name``."""
        found = [
            kind
            for kind, patterns in (("column", self.column), ("row", self.row))
            if any(self._matches(p, module_name) for p in patterns)
        ]
        if len(found) > 1:
            raise ValueError(
                f"module {module_name!r} is matched by both the column and the row patterns of "
                "the tensor-parallel policy: expected exactly one"
            )
        return found[0] if found else None

    def blocks_of(self, module_name: str, module) -> int:
        for pattern, blocks in self.fused_blocks.items():
            if re.fullmatch(pattern, module_name):
                return int(blocks(module) if callable(blocks) else blocks)
        return 1

    def _matches(self, pattern: str, module_name: str) -> bool:
        if self.search_parameter_names:
            return re.search(pattern, f"{module_name}.weight") is not None
        return re.fullmatch(pattern, module_name) is not None


def _conv1d_fused_blocks(module) -> int:
    # GPT-2's c_attn: nf = 3 * hidden (q, k, v) for self-attention, 2 * hidden (k, v) for
    # cross-attention, from nx = hidden inputs.
    return module.weight.shape[1] // module.weight.shape[0]


_GPT2 = TensorParallelPolicy(
    column=(
        r".*\.attn\.c_attn",
        r".*\.attn\.q_attn",
        r".*\.crossattention\.(c_attn|q_attn)",
        r".*\.mlp\.c_fc",
    ),  # fmt: skip
    row=(r".*\.attn\.c_proj", r".*\.crossattention\.c_proj", r".*\.mlp\.c_proj"),
    fused_blocks={r".*\.(attn|crossattention)\.c_attn": _conv1d_fused_blocks},
    head_attributes={r"GPT2Attention": ("num_heads", "split_size", "embed_dim")},
)

_LLAMA_LIKE = TensorParallelPolicy(
    column=(r".*\.self_attn\.(q_proj|k_proj|v_proj)", r".*\.mlp\.(gate_proj|up_proj)"),
    row=(r".*\.self_attn\.o_proj", r".*\.mlp\.down_proj"),
    # transformers 5 reshapes with -1 heads; older releases read these attributes.
    head_attributes={r".*Attention": ("num_heads", "num_key_value_heads", "hidden_size")},
)

_T5 = TensorParallelPolicy(
    column=(
        r".*\.(SelfAttention|EncDecAttention)\.(q|k|v)",
        r".*\.DenseReluDense\.(wi|wi_0|wi_1)",
    ),  # fmt: skip
    row=(r".*\.(SelfAttention|EncDecAttention)\.o", r".*\.DenseReluDense\.wo"),
    head_split=(r".*\.relative_attention_bias",),
    head_attributes={r"T5Attention": ("n_heads", "inner_dim")},
)

_POLICIES: dict[str, TensorParallelPolicy] = {
    "gpt2": _GPT2,
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "t5": _T5,
}


def register_tp_policy(model_type: str, policy: TensorParallelPolicy) -> None:
    """Makes ``policy`` the one used for models whose ``config.model_type`` is ``model_type``."""
    if not isinstance(policy, TensorParallelPolicy):
        raise TypeError(f"policy must be a TensorParallelPolicy, got {type(policy).__name__}")
    _POLICIES[model_type] = policy


def _policy_from_layer_specs(partition_config: dict) -> TensorParallelPolicy:
    columns, rows = [], []
    for index, spec in enumerate(partition_config.get("layer_specs") or []):
        kind = spec.get("partition_type")
        patterns = spec.get("patterns")
        if kind not in ("column", "row") or not isinstance(patterns, list) or not patterns:
            raise ValueError(
                f"tensor_parallel.partition_config.layer_specs[{index}] = {spec!r}: expected "
                '{"patterns": [regular expressions], "partition_type": "column" or "row"}'
            )
        unsupported = sorted(set(spec) - {"patterns", "partition_type"})
        if unsupported:
            raise ValueError(
                f"tensor_parallel.partition_config.layer_specs[{index}] has {unsupported}: not "
                "supported yet (only patterns and partition_type are)"
            )
        (columns if kind == "column" else rows).extend(patterns)
    return TensorParallelPolicy(
        tuple(columns), tuple(rows), search_parameter_names=True, output_head=False
    )


def policy_for_model_type(model_type: str) -> TensorParallelPolicy:
    """The table's policy for ``model_type`` (the config's ``tensor_parallel.preset_model``)."""
    if model_type not in _POLICIES:
        raise ValueError(
            f"tensor_parallel.preset_model = {model_type!r}: no such policy; known: "
            f"{', '.join(sorted(_POLICIES))}"
        )
    return _POLICIES[model_type]


def policy_for(model, partition_config: dict | None = None) -> TensorParallelPolicy:
    """The policy for ``model``: the config's layer specs if given (with DeepSpeed's default
    for the architecture added unless ``use_default_specs`` is false), else the table's."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    default = _POLICIES.get(model_type)
    if partition_config:
        custom = _policy_from_layer_specs(partition_config)
        if default is None or not partition_config.get("use_default_specs", True):
            return custom
        return _merge(default, custom)
    if default is None:
        from .graph_discovery import discover_policy

        discovered = discover_policy(model)
        if discovered is not None:
            logger.info(
                "deepspeed_cpp: no tensor-parallel policy for model type %r: split found from "
                "the module graph, column %s, row %s",
                model_type,
                list(discovered.column[:4]),
                list(discovered.row[:2]),
            )
            return discovered
        raise ValueError(
            f"no tensor-parallel policy for model type {model_type!r} "
            f"({type(model).__name__}), and its module graph has no block of linear layers "
            f"to split (column then row); known: {', '.join(sorted(_POLICIES))}. Give one with "
            "deepspeed_cpp.module_inject.register_tp_policy or the config's "
            "tensor_parallel.partition_config.layer_specs"
        )
    return default


def _merge(default: TensorParallelPolicy, custom: TensorParallelPolicy) -> TensorParallelPolicy:
    """Custom specs first: a module both match is split the custom way."""

    class _Merged(TensorParallelPolicy):
        def kind_of(self, module_name: str) -> str | None:
            return custom.kind_of(module_name) or default.kind_of(module_name)

    return _Merged(
        column=default.column + custom.column,
        row=default.row + custom.row,
        fused_blocks=default.fused_blocks,
        head_split=default.head_split,
        head_attributes=default.head_attributes,
    )
