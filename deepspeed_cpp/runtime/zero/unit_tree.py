"""ZeRO-3 fetch units from the module tree: which modules' partitioned parameters are gathered
(and reduced) together.

A model's repeated blocks (the children of an ``nn.ModuleList`` or ``nn.Sequential``
that repeat one class: transformer layers) are one unit each, with all their parameters, as
FSDP's transformer auto-wrap makes them, unless a block holds more than
``stage3_max_live_parameters`` elements (a unit is gathered whole; a block above
``stage3_prefetch_bucket_size`` is still one unit, prefetched alone) or fewer than
``stage3_unit_min_numel`` (0: no blocks, DeepSpeed's unit per module); consecutive blocks of one
class share one unit while together under 16x that minimum (``_GROUPED_PER_MIN_NUMEL``: 48 blocks
of 66K elements make 12 units of four), the first block's forward gathering it and the last one's
releasing it (``coordinator.py``). Elsewhere, every module
with partitioned parameters of its own (or registered with
``register_external_parameter``) is one unit, except small ones (norms, bias-only modules: fewer
than ``stage3_unit_min_numel`` elements), whose parameters join their parent's unit: gathered
and reduced with it, because below ~64 KiB a collective costs its launch latency, not its bytes,
on every backend; and a module whose whole subtree holds at most 4x that many elements is one
unit with all its children (a small transformer layer: one unit, as FSDP2 wraps it, not its
attention and the rest as two). A parameter shared by two modules (tied weights) belongs to
both, and is held whole while either holds it. A module marked as a leaf
(``deepspeed_cpp.utils.set_z3_leaf_modules``, read at construction) is one unit with its whole
subtree: its descendants get no unit and no hooks, so a Mixture-of-Experts block whose experts
run in a data-dependent order (or not at all) is gathered whole, the same way on every rank.
"""

from __future__ import annotations

import torch

from ...utils.z3_leaf_modules import z3_leaf_module
from . import partition_parameters as pp
from .external_parameters import registered_external_parameters

# Containers whose forward never runs (their children are called by the module above them): their
# own parameters join the module above, whose hooks do run; their small children stay units.
_NO_FORWARD = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList)

# A module takes in small children only up to this many times ``stage3_unit_min_numel`` elements:
# a Sequential of a thousand small layers must not become one unit held whole for the whole pass.
_MERGED_PER_MIN_NUMEL = 4

# Consecutive repeated blocks are grouped into one unit up to this many times
# ``stage3_unit_min_numel`` elements (16 x 16,384: 1 MiB of fp32), a block never split. A unit
# costs its hooks and the schedule's bookkeeping every pass, ~0.25 ms of one core per step on
# this project's 2-core CPUs, a sixth of what a 256-wide block's forward and backward take on a
# small batch: ``benchmarks/zero3_step_profile.py --model deep`` (48 such blocks), alternated
# with the tree before, put its ZeRO-3 step at 1.34-1.36x our ZeRO-2's with four blocks per unit
# (and fewer Python steps per parameter) against 1.39-1.44x with a unit per block
# (``benchmarks/results/zero3_step_s12.txt``).
_GROUPED_PER_MIN_NUMEL = 16


def units_from_module_tree(
    module: torch.nn.Module,
    inside_leaf: set[int],
    min_numel: int,
    block_cap: int,
    whole_units: set[int],
):
    """The fetch units of ``module``'s tree, in pre-order: (name, module, parameters, is_leaf,
    members). ``members`` is ``[module]``, or for a group of repeated blocks every block of it in
    order (``module`` the first; the parameters all of theirs).

    Taken whole (their whole subtree, never merged upward; ``whole_units`` receives their ids,
    ``inside_leaf`` the ids of the modules inside them: no unit, no hooks): every leaf module
    (``set_z3_leaf_modules``) and, with ``min_numel`` > 0, every repeated block
    (``repeated_blocks``: a transformer's layers, one unit each, as FSDP's transformer
    auto-wrap makes them). The rest, bottom-up: each module collects its own partitioned
    parameters (and the external ones registered on it) plus those of its children too small to
    be units (fewer than ``min_numel`` elements: ``stage3_unit_min_numel``), up to
    ``_MERGED_PER_MIN_NUMEL`` times ``min_numel`` in all; a module whose whole subtree is within
    that cap takes in all its children, whatever their size. A module whose collection is large
    enough is a unit, and so are the root and a small module that found no room above it."""
    order: list[tuple[str, torch.nn.Module, bool]] = []
    parent: dict[int, torch.nn.Module] = {}
    blocks: set[int] = set()  # repeated blocks taken whole (``repeated_blocks``)
    group_of: dict[int, list[int]] = {}  # id(block) -> ids of its group's blocks, in order
    names: dict[int, str] = {}
    for name, submodule in module.named_modules():
        if id(submodule) in inside_leaf:
            continue
        names[id(submodule)] = name
        leaf = z3_leaf_module(submodule)
        if leaf or id(submodule) in blocks:
            inside_leaf.update(id(m) for m in list(submodule.modules())[1:])
            whole_units.add(id(submodule))
        elif min_numel > 0:
            for group in repeated_blocks(submodule, min_numel, block_cap):
                blocks.update(group)
                for block in group:
                    group_of[block] = group
        order.append((name, submodule, leaf))
        for child in submodule.children():
            parent.setdefault(id(child), submodule)
    collected: dict[int, dict[int, torch.nn.Parameter]] = {}
    numel: dict[int, int] = {}
    cap = _MERGED_PER_MIN_NUMEL * min_numel
    whole = _subtree_numels(order)
    units: dict[int, bool] = {}  # id(module) -> whether it is a leaf
    for _name, submodule, leaf in reversed(order):
        params = collected.setdefault(id(submodule), {})
        whole_unit = id(submodule) in whole_units
        for member in submodule.modules() if whole_unit else [submodule]:
            for param in member.parameters(recurse=False):
                if pp.is_partitioned(param):
                    params.setdefault(id(param), param)
            for param in registered_external_parameters(member):
                if pp.is_partitioned(param):
                    params.setdefault(id(param), param)
        if not params:
            continue
        size = sum(p.ds_numel for p in params.values())
        above = parent.get(id(submodule))
        if above is not None and not whole_unit and isinstance(submodule, _NO_FORWARD):
            merge = True
        else:
            # Small modules join the module above while it has room; a module whose whole
            # subtree fits in the cap takes in every child (an encoder layer is one unit, as
            # FSDP2 wraps it, not its attention and the rest as two).
            merge = (
                above is not None
                and not whole_unit
                and not isinstance(above, _NO_FORWARD)
                and (
                    (size < min_numel and numel.get(id(above), 0) + size <= cap)
                    or (cap > 0 and whole[id(above)] <= cap)
                )
            )
        if not merge:
            units[id(submodule)] = leaf
            continue
        merged = collected.setdefault(id(above), {})
        for key, param in params.items():
            merged.setdefault(key, param)
        numel[id(above)] = numel.get(id(above), 0) + size
    modules = {id(submodule): submodule for _name, submodule, _leaf in order}
    for name, submodule, leaf in order:
        if id(submodule) not in units:
            continue
        group = group_of.get(id(submodule), [id(submodule)])
        if group[0] != id(submodule):
            continue  # taken with the group's first block
        members = [modules[key] for key in group]
        params: dict[int, torch.nn.Parameter] = {}
        for key in group:
            for param_id, param in collected[key].items():
                params.setdefault(param_id, param)
        if len(group) > 1:
            name = f"{name}..{names[group[-1]]}"
        yield name, submodule, list(params.values()), leaf, members


def repeated_blocks(container: torch.nn.Module, min_numel: int, block_cap: int) -> list[list[int]]:
    """The children of an ``nn.ModuleList`` / ``nn.Sequential`` that are blocks of a repeated
    class (at least two children of that class with partitioned parameters: transformer layers),
    each holding at least ``min_numel`` partitioned elements (smaller ones follow the merge
    rules) and at most ``block_cap`` (``stage3_max_live_parameters``: a unit is gathered whole,
    so a larger block is split by the per-module rules instead), as groups of ids: consecutive
    blocks of one class together while the group holds fewer than ``_GROUPED_PER_MIN_NUMEL``
    times ``min_numel`` elements and stays within ``block_cap`` (one unit each group; a leaf
    module, ``set_z3_leaf_modules``, alone)."""
    if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
        return []
    sizes = {id(child): _partitioned_numel(child) for child in container.children()}
    classes: dict[type, int] = {}
    for child in container.children():
        if sizes[id(child)] > 0:
            classes[type(child)] = classes.get(type(child), 0) + 1
    group_numel = _GROUPED_PER_MIN_NUMEL * min_numel
    groups: list[list[int]] = []
    open_group: tuple[type, int] | None = None  # (class, elements) of the last group, if open
    for child in container.children():
        size = sizes[id(child)]
        if not (classes.get(type(child), 0) >= 2 and min_numel <= size <= block_cap):
            open_group = None  # a child between blocks ends a group
            continue
        if z3_leaf_module(child):  # a leaf is one unit with its subtree, never grouped
            groups.append([id(child)])
            open_group = None
            continue
        if (
            open_group is not None
            and open_group[0] is type(child)
            and open_group[1] < group_numel
            and open_group[1] + size <= block_cap
        ):
            groups[-1].append(id(child))
            open_group = (type(child), open_group[1] + size)
        else:
            groups.append([id(child)])
            open_group = (type(child), size)
    return groups


def _partitioned_numel(module: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for member in module.modules():
        for param in member.parameters(recurse=False):
            if pp.is_partitioned(param):
                seen[id(param)] = param.ds_numel
        for param in registered_external_parameters(member):
            if pp.is_partitioned(param):
                seen[id(param)] = param.ds_numel
    return sum(seen.values())


def _subtree_numels(order) -> dict[int, int]:
    """``id(module)`` -> the partitioned elements of its whole subtree (each parameter once)."""
    return {id(submodule): _partitioned_numel(submodule) for _name, submodule, _leaf in order}
