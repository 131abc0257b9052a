"""A tensor-parallel policy found from the module graph, for architectures outside the table.

The rule (DeepSpeed's AutoTP parses the module tree too, from registration order and a list of
known names; this one reads the shapes instead of names):

1. The transformer blocks are the elements of the model's ``nn.ModuleList``s (one class per
   list; lists of modules without linear layers are skipped).
2. Inside a block, linear layers (``nn.Linear``, transformers' ``Conv1D``) are grouped by the
   module that holds them directly: an attention module (q, k, v, out), an MLP module (up,
   gate, down), or the block itself (OPT's ``fc1``, ``fc2``).
3. In a group of two or more, the layer registered last is the output projection and is split
   by row; the others are split by column. The group is split only if its shapes say so: every
   column layer reads the block's hidden width (the row layer's output width) and the row
   layer reads what they produce (its input width is the width of one of them, or a multiple
   of it for a fused q/k/v). A group whose shapes do not fit is left whole on every rank.
4. A group's holder that counts attention heads (``num_heads``, ``num_attention_heads``, ...)
   has those counts and the widths derived from them divided by the TP size, for its own
   reshapes (attributes that are absent are skipped).

A fused q/k/v layer (one column layer producing a multiple of what the row layer reads) is
split into contiguous slices, which gives each rank whole heads only when its features are laid
out head by head. Shapes cannot tell that layout from three blocks [q | k | v] (GPT-2's
``c_attn``) or others (CodeGen's), so such a group is split only for the model types known to
lay out head by head (``HEAD_BY_HEAD_FUSED``: GPT-NeoX, Bloom, Falcon) and left whole otherwise
(a wrong split would train silently wrong); a policy with ``fused_blocks`` covers the others.
Embeddings stay replicated; an untied ``lm_head`` is split as with any policy (``output_head.py``).
"""

from __future__ import annotations

import re

import torch

from ..utils.logging import logger
from .tp_policies import TensorParallelPolicy

# Attributes of an attention module that count its heads or give the width of all its heads.
HEAD_ATTRIBUTES = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_kv_heads",
    "n_head",
    "n_heads",
    "embed_dim",
    "all_head_size",
    "inner_dim",
)
_HEAD_COUNTS = HEAD_ATTRIBUTES[:6]

# Model types whose fused q/k/v features are laid out head by head (contiguous slices of the
# output give each rank whole heads' queries, keys and values).
HEAD_BY_HEAD_FUSED = ("gpt_neox", "bloom", "falcon")


def _widths(module) -> tuple[int, int] | None:
    """(in, out) features of a linear layer, None for other modules."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _blocks(model: torch.nn.Module):
    """(name, block) of every element of the model's ModuleLists of one class with linears."""
    for list_name, module_list in model.named_modules():
        if not isinstance(module_list, torch.nn.ModuleList) or len(module_list) == 0:
            continue
        if len({type(m) for m in module_list}) != 1:
            continue
        if not any(_widths(m) for m in module_list[0].modules()):
            continue
        for index, block in enumerate(module_list):
            yield f"{list_name}.{index}" if list_name else str(index), block


def _groups(block_name: str, block: torch.nn.Module):
    """(holder name, holder, [(name, widths)] of its direct linear children in order)."""
    for holder_name, holder in block.named_modules():
        if isinstance(holder, torch.nn.ModuleList):
            continue  # nested blocks are found as blocks of their own
        linears = []
        for child_name, child in holder.named_children():
            widths = _widths(child)
            if widths is not None:
                full = ".".join(p for p in (block_name, holder_name, child_name) if p)
                linears.append((full, widths))
        yield ".".join(p for p in (block_name, holder_name) if p), holder, linears


def _column_row_split(linears, fused_allowed: bool) -> tuple[list[str], str] | None:
    """(column names, row name) of a group whose shapes fit rule 3, else None; a group with a
    fused column layer only when ``fused_allowed``."""
    if len(linears) < 2:
        return None
    *columns, (row, (row_in, hidden)) = linears
    if any(col_in != hidden for _, (col_in, _) in columns):
        return None
    if not any(out % row_in == 0 for _, (_, out) in columns):
        return None
    fused = [name for name, (_, out) in columns if out > row_in and out % row_in == 0]
    if fused and not fused_allowed:
        logger.info(
            "deepspeed_cpp: %s looks like fused q/k/v of an unknown layout: its group is kept "
            "whole on every rank (give a policy with fused_blocks to split it)",
            fused[0],
        )
        return None
    return [name for name, _ in columns], row


def discover_policy(model: torch.nn.Module) -> TensorParallelPolicy | None:
    """The policy the module graph gives (see the module docstring); None when it finds no
    block to split."""
    columns, rows = [], []
    head_attributes: dict[str, tuple[str, ...]] = {}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    fused_allowed = model_type in HEAD_BY_HEAD_FUSED
    for block_name, block in _blocks(model):
        for _, holder, linears in _groups(block_name, block):
            split = _column_row_split(linears, fused_allowed)
            if split is None:
                continue
            columns.extend(split[0])
            rows.append(split[1])
            present = tuple(a for a in HEAD_ATTRIBUTES if isinstance(getattr(holder, a, None), int))
            if any(a in _HEAD_COUNTS for a in present):
                head_attributes[re.escape(type(holder).__name__)] = present
    if not rows:
        return None
    return TensorParallelPolicy(
        column=tuple(re.escape(name) for name in columns),
        row=tuple(re.escape(name) for name in rows),
        head_attributes=head_attributes,
    )
