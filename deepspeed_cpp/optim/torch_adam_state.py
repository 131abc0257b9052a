"""Loading state dicts of torch.optim.Adam / AdamW into our Adam-family optimizers."""

from __future__ import annotations


def refuse_unsupported_adam_flags(state_dict: dict, optimizer_name: str) -> None:
    """Raises ValueError if a param group asks for amsgrad or maximize, which we do not do."""
    for index, group in enumerate(state_dict["param_groups"]):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(
                    f"cannot load a state dict whose param group {index} has {flag}=True: "
                    f"{optimizer_name} does not implement it"
                )


def complete_adam_group(group: dict, mode_key: str, default_mode: bool) -> None:
    """Fills what a torch Adam/AdamW param group lacks: our decoupled-decay flag (torch records
    decoupled_weight_decay=False for Adam, True for AdamW) and bias_correction."""
    if mode_key not in group:
        group[mode_key] = bool(group.get("decoupled_weight_decay", default_mode))
    group.setdefault("bias_correction", True)
    group["betas"] = tuple(group["betas"])
