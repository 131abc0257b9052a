"""The text of a model profile, laid out as DeepSpeed's flops profiler prints it: the summary,
the top modules per depth, and the module tree with each module's numbers."""

from __future__ import annotations

import torch

from .units import duration_to_string, flops_to_string, macs_to_string, params_to_string

_RULE = "-" * 26


def _modules_by_depth(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Module]]]:
    by_depth: dict[int, list] = {}

    def visit(module, name, depth):
        by_depth.setdefault(depth, []).append((name, module))
        for child_name, child in module.named_children():
            visit(child, child_name, depth + 1)

    visit(model, type(model).__name__, 0)
    return by_depth


def aggregated_profile_text(profiler, module_depth: int = -1, top_modules: int = 1) -> str:
    by_depth = _modules_by_depth(profiler.model)
    depths = sorted(by_depth) if module_depth < 0 else sorted(by_depth)[: module_depth + 1]
    lines = [
        f"{_RULE}--- Aggregated Profile per GPU {_RULE}---",
        f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model "
        f"depths:",
    ]
    for depth in depths:
        # Modules of one class at one depth are summed by class name, as DeepSpeed does.
        totals: dict[str, list[float]] = {}
        for _, module in by_depth[depth]:
            row = totals.setdefault(type(module).__name__, [0, 0, 0.0])
            row[0] += profiler._module_params(module)
            row[1] += profiler._module_flops(module) // 2
            row[2] += profiler._module_duration(module)

        def top(index, show, totals=totals):
            ranked = sorted(totals.items(), key=lambda item: item[1][index], reverse=True)
            return {name: show(values[index]) for name, values in ranked[:top_modules]}

        lines += [
            f"depth {depth}:",
            f"    params      - {top(0, params_to_string)}",
            f"    MACs        - {top(1, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return "\n".join(lines)


def _module_line(profiler, module, totals) -> str:
    params = profiler._module_params(module)
    flops = profiler._module_flops(module)
    duration = profiler._module_duration(module)
    total_params, total_flops, total_duration = totals

    def share(part, whole):
        return f"{100 * part / whole:.2f}%" if whole else "0.00%"

    return ", ".join(
        [
            f"{params_to_string(params)} = {share(params, total_params)} Params",
            f"{macs_to_string(flops // 2)} = {share(flops, total_flops)} MACs",
            f"{duration_to_string(duration)} = {share(duration, total_duration)} latency",
            flops_to_string(flops / duration if duration else 0.0),
        ]
    )


def detailed_profile_text(profiler, module_depth: int = -1) -> str:
    """The model's repr with each module's numbers first in its line (DeepSpeed swaps every
    module's ``extra_repr`` for the printing; so do we, and put them back)."""
    model = profiler.model
    totals = (
        profiler.get_total_params(),
        profiler.get_total_flops(),
        profiler.get_total_duration(),
    )
    depth_of = {}
    for depth, members in _modules_by_depth(model).items():
        for _, module in members:
            depth_of.setdefault(id(module), depth)
    originals = {}
    for module in model.modules():
        if id(module) in originals:
            continue
        originals[id(module)] = (module, module.extra_repr)
        if module_depth >= 0 and depth_of.get(id(module), 0) > module_depth:
            continue

        def extra_repr(module=module, original=module.extra_repr):
            own = original()
            numbers = _module_line(profiler, module, totals)
            return f"{numbers}, {own}" if own else numbers

        module.extra_repr = extra_repr
    try:
        tree = repr(model)
    finally:
        for module, original in originals.values():
            module.extra_repr = original
    return "\n".join(
        [
            f"{_RULE}---- Detailed Profile per GPU {_RULE}----",
            "Each module profile is listed after its name in the following order: ",
            "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
            "percentage of total fwd latency, fwd FLOPS",
            "",
            tree,
        ]
    )


def _engine_step_lines(profiler, flops: float, phase_seconds: dict[str, float]) -> list[str]:
    """DeepSpeed's lines for a profile the engine took: the step's backward and optimizer-step
    latencies beside the forward's, and the FLOPS and samples/second they give."""
    engine = profiler.ds_engine
    fwd, bwd, step = (phase_seconds.get(name, 0.0) for name in ("fwd", "bwd", "step"))
    bwd_factor = 2 + profiler.recompute_fwd_factor
    iteration = fwd + bwd + step
    samples = engine.train_micro_batch_size_per_gpu() * engine.world_size

    both_label = (
        f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency):"
    )

    def rate(value: float, seconds: float) -> str:
        return flops_to_string(value / seconds if seconds else 0.0)

    return [
        f"{'bwd latency:':<60}{duration_to_string(bwd)}",
        f"{f'bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency:':<60}"
        f"{rate(bwd_factor * flops, bwd)}",
        f"{both_label:<59} {rate((bwd_factor + 1) * flops, fwd + bwd)}",  # longer than 60
        f"{'step latency:':<60}{duration_to_string(step)}",
        f"{'iter latency:':<60}{duration_to_string(iteration)}",
        f"{f'FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency:':<60}"
        f"{rate((bwd_factor + 1) * flops, iteration)}",
        f"{'samples/second:':<60}{round(samples / iteration, 2) if iteration else 0.0}",
    ]


def model_profile_text(
    profiler, profile_step, module_depth, top_modules, detailed, phase_seconds=None
) -> str:
    params = profiler.get_total_params()
    flops = profiler.get_total_flops()
    macs = profiler.get_total_macs()
    duration = profiler.get_total_duration()
    engine = profiler.ds_engine
    engine_step = engine is not None and bool(phase_seconds)
    if engine_step:
        duration = phase_seconds.get("fwd", duration)  # DeepSpeed: the engine's forward timer
    world = engine.world_size if engine is not None else 1
    lines = [
        "",
        f"{_RULE} DeepSpeed Flops Profiler {_RULE}",
        f"Profile Summary at step {profile_step}:",
        "Notations:",
        "data parallel size (dp_size), model parallel size(mp_size),",
        "number of parameters (params), number of multiply-accumulate operations(MACs),",
        "number of floating-point operations (flops), floating-point operations per second "
        "(FLOPS),",
        "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
        "step (weights update latency), iter latency (sum of fwd, bwd and step latency)",
        "",
        f"{'world size:':<60}{world}",
        f"{'data parallel size:':<60}{world}",
        f"{'model parallel size:':<60}1",
    ]
    if engine is not None:
        lines.append(f"{'batch size per GPU:':<60}{engine.train_micro_batch_size_per_gpu()}")
    lines += [
        f"{'params per GPU:':<60}{params_to_string(params)}",
        f"{'params of model = params per GPU * mp_size:':<60}{params_to_string(params)}",
        f"{'fwd MACs per GPU:':<60}{macs_to_string(macs)}",
        f"{'fwd flops per GPU:':<60}{flops_to_string(flops).replace('FLOPS', '')}",
        f"{'fwd flops of model = fwd flops per GPU * mp_size:':<60}"
        f"{flops_to_string(flops).replace('FLOPS', '')}",
        f"{'fwd latency:':<60}{duration_to_string(duration)}",
        f"{'fwd FLOPS per GPU = fwd flops per GPU / fwd latency:':<60}"
        f"{flops_to_string(flops / duration if duration else 0.0)}",
    ]
    if engine_step:
        lines += _engine_step_lines(profiler, flops, phase_seconds)
    else:
        lines += [
            # DeepSpeed's estimate: backward costs twice forward, plus recomputed forwards.
            f"{'bwd flops per GPU = 2 * fwd flops per GPU:':<60}"
            f"{flops_to_string((2 + profiler.recompute_fwd_factor) * flops).replace('FLOPS', '')}",
            f"{'fwd+bwd flops per GPU:':<60}"
            f"{flops_to_string((3 + profiler.recompute_fwd_factor) * flops).replace('FLOPS', '')}",
        ]
    lines += ["", aggregated_profile_text(profiler, module_depth, top_modules)]
    if detailed:
        lines += ["", detailed_profile_text(profiler, module_depth)]
    lines.append(f"{_RULE}{'-' * 26}{_RULE}")
    return "\n".join(lines)
