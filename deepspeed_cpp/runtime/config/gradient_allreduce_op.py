"""``gradient_allreduce_op``: how data-parallel gradients are combined, DeepSpeed's key.

DeepSpeed 0.19.8 reads ``"mean"`` (the default) or ``"sum"``, in any case, and refuses "sum" with
ZeRO stage 3, ZenFlow or DeepCompile by name. deepspeed_cpp averages gradients over ranks at
every stage; "sum" is refused here too, naming the conflict DeepSpeed would name where there is
one, so that a config is told the same thing under either library wherever they agree.
"""

from __future__ import annotations

from .errors import show

KEY = "gradient_allreduce_op"
SUPPORTED = ("mean", "sum")


def read_gradient_allreduce_op(config: dict) -> list[str]:
    """Checks ``config[KEY]`` and writes back its canonical lower-case spelling ("mean" stays for
    the schema's field); returns the problems found (a "sum", an unknown operation)."""
    if KEY not in config:
        return []
    value = config[KEY]
    if not isinstance(value, str) or value.lower() not in SUPPORTED:
        config.pop(KEY)
        return [
            f"Invalid {KEY} = {show(value)}: expected one of {list(SUPPORTED)} (any case); "
            f'the default is "mean"'
        ]
    config[KEY] = value.lower()
    if config[KEY] == "mean":
        return []
    config.pop(KEY)
    zero = config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    compile_section = config.get("compile")
    conflicts = []
    if zero.get("stage") == 3:
        conflicts.append("ZeRO stage 3")
    if zero.get("zenflow") is not None:
        conflicts.append("ZenFlow")
    if isinstance(compile_section, dict) and compile_section.get("deepcompile"):
        conflicts.append("DeepCompile")
    problems = [
        f"{KEY}='sum' is not supported with {what} (nor by DeepSpeed)" for what in conflicts
    ]
    problems.append(
        f"{KEY} = {show(value)}: not supported yet by deepspeed_cpp (gradients are averaged "
        f'over the data-parallel ranks at every stage); expected "mean", or remove the key'
    )
    return problems
