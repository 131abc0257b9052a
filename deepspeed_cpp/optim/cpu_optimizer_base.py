"""What DeepSpeedCPUAdam, DeepSpeedCPUAdagrad and DeepSpeedCPULion share: parameter checks, state
creation in the right dtype, batching of a group's tensors into one native call per distinct
(step, dtypes), and DeepSpeed's ``fp16_param_groups`` low-precision copy-out."""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar

import torch

from .optimizer_base import OptimizerBase

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)


class CPUOptimizerBase(OptimizerBase):
    """Base of the CPU optimizers over the native ops. Subclasses set STATE_KEYS and implement
    ``_native_step(group, step, params, grads, states, params_lowp)``."""

    # Each tensor has its own state and step count and tensors without a gradient are skipped,
    # so stepping a subset of the tensors at a time equals one step over all (ZeRO relies on it).
    steps_tensors_independently = True

    STATE_KEYS: ClassVar[tuple[str, ...]] = ()
    # Sparse gradients (an nn.Embedding(sparse=True)) update only the rows they hold, state
    # included (``_sparse_rows_step``); each optimizer says whether DeepSpeed's does that.
    SPARSE_GRADIENTS: ClassVar[bool] = False

    def __init__(self, params, defaults: dict, fp32_optimizer_states: bool):
        super().__init__(params, defaults)
        # DeepSpeed's switch: False keeps the state in the parameters' dtype (bfloat16 here).
        self.fp32_optimizer_states = fp32_optimizer_states
        for group_index, group in enumerate(self.param_groups):
            for param_index, param in enumerate(group["params"]):
                self._check_param(param, group_index, param_index)

    # --- what subclasses provide --------------------------------------------------------------
    def _native_step(self, group, step, params, grads, states, params_lowp) -> None:
        raise NotImplementedError

    def _initial_state_value(self, group, key: str) -> float:
        return 0.0

    # --- shared -------------------------------------------------------------------------------
    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else param.dtype

    def _check_param(self, param: torch.Tensor, group_index: int, param_index: int) -> None:
        name = type(self).__name__
        where = f"param {param_index} of group {group_index}"
        if param.device.type != "cpu":
            raise ValueError(f"{name} needs CPU parameters; {where} is on {param.device}")
        if param.dtype not in _PARAM_DTYPES:
            raise TypeError(
                f"{name} needs float32, bfloat16 or float16 parameters; {where} is {param.dtype}"
            )
        if not param.is_contiguous():
            raise ValueError(
                f"{name} needs contiguous parameters; {where} has shape {tuple(param.shape)} and "
                f"strides {param.stride()}"
            )
        if param.dtype == torch.float16 and not self.fp32_optimizer_states:
            raise ValueError(
                f"{name}: fp32_optimizer_states=False would keep the state of {where} in "
                f"float16, which this optimizer does not support (float32 or bfloat16 state); "
                f"use fp32_optimizer_states=True"
            )

    def _create_state(self, group, param: torch.Tensor, state: dict) -> None:
        state["step"] = torch.tensor(0.0)
        for key in self.STATE_KEYS:
            state[key] = torch.full_like(
                param,
                self._initial_state_value(group, key),
                dtype=self._state_dtype(param),
                memory_format=torch.contiguous_format,
            )

    @torch.no_grad()
    def step(self, closure=None, fp16_param_groups=None):
        """One optimizer step over every parameter that has a gradient.

        ``fp16_param_groups`` (DeepSpeed's argument): bfloat16/float16 tensors, one list per param
        group matching its params (or one list, or one tensor, for a single group), that receive
        the updated parameters rounded to their dtype. CPU targets are written by the kernel in
        the same pass; others (a GPU copy) from a CPU buffer after the step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copy_targets = _normalise_copy_groups(fp16_param_groups, len(self.param_groups))
        self.step_groups(self.param_groups, copy_targets)
        return loss

    @torch.no_grad()
    def step_groups(self, groups: list[dict], copy_targets=None) -> None:
        """``step()`` over ``groups``: this optimizer's param groups or a snapshot of them (a
        delayed update steps with the hyper-parameters of the step that launched it while the
        LR scheduler moves the live groups on)."""
        for group_index, group in enumerate(groups):
            # One native call per distinct (step, dtypes), normally exactly one per group.
            batches: dict[tuple, tuple[list, list, list, list]] = defaultdict(
                lambda: ([], [], [[] for _ in self.STATE_KEYS], [])
            )
            copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, target)
            counted: list[dict] = []  # the states whose step counter this call advances
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                self._check_param(param, group_index, param_index)
                if param.grad.is_sparse and not self.SPARSE_GRADIENTS:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients (param "
                        f"{param_index} of group {group_index})"
                    )
                state = self.state[param]
                if not state:
                    self._create_state(group, param, state)
                # The counters advance below, all with one op (a ZeRO-3 model steps one tensor per
                # parameter: one add each was a few ms per step).
                step = int(state["step"].item()) + 1
                counted.append(state)
                lowp = None
                if copy_targets is not None:
                    lowp = self._copy_buffer(copy_targets, group_index, param_index, param)
                    if lowp is not None and lowp[1] is not None:
                        copy_back.append(lowp)
                    lowp = None if lowp is None else lowp[0]
                if param.grad.is_sparse:
                    self._sparse_rows_step(group, step, param, state, lowp)
                    continue
                key = (
                    step,
                    param.dtype,
                    state[self.STATE_KEYS[0]].dtype,
                    None if lowp is None else lowp.dtype,
                )
                params, grads, states, params_lowp = batches[key]
                params.append(param)
                grads.append(param.grad.contiguous())
                for index, state_key in enumerate(self.STATE_KEYS):
                    states[index].append(state[state_key])
                if lowp is not None:
                    params_lowp.append(lowp)
            if counted:
                # New tensors, not in place: loaded state dicts share step tensors with their
                # source.
                advanced = torch._foreach_add([state["step"] for state in counted], 1)
                for state, step in zip(counted, advanced):
                    state["step"] = step
            for (step, *_dtypes), (params, grads, states, params_lowp) in batches.items():
                self._native_step(group, step, params, grads, states, params_lowp or None)
            for buffer, target in copy_back:
                target.copy_(buffer)

    def _sparse_rows_step(self, group, step: int, param, state: dict, lowp) -> None:
        """The step for a sparse gradient: the rows it holds (of the parameter and of each state
        tensor) are gathered, stepped by the native op as dense tensors, and written back; the
        other rows and their state are left as they are, as DeepSpeed's CPU Adagrad and torch's
        Adagrad do."""
        grad = param.grad.coalesce()
        rows = tuple(grad.indices())
        if grad.values().numel():
            param_rows = param[rows].contiguous()
            state_rows = [[state[key][rows].contiguous()] for key in self.STATE_KEYS]
            values = grad.values().contiguous()
            self._native_step(group, step, [param_rows], [values], state_rows, None)
            param[rows] = param_rows
            for key, (updated,) in zip(self.STATE_KEYS, state_rows):
                state[key][rows] = updated
        if lowp is not None:
            lowp.view(-1).copy_(param.reshape(-1))

    def _copy_buffer(self, copy_targets, group_index: int, param_index: int, param):
        """(tensor the kernel writes, target to copy it to afterwards or None), or None."""
        try:
            target = copy_targets[group_index][param_index]
        except IndexError:
            raise ValueError(
                f"fp16_param_groups has no tensor for param {param_index} of group {group_index}"
            ) from None
        if target is None:
            return None
        where = f"fp16_param_groups[{group_index}][{param_index}]"
        if target.dtype not in _LOWP_DTYPES or target.numel() != param.numel():
            raise ValueError(
                f"{where} must be a bfloat16 or float16 tensor of {param.numel()} elements, got "
                f"{target.dtype} with {target.numel()}"
            )
        if param.dtype != torch.float32:
            raise ValueError(
                f"{where}: a low-precision copy needs float32 parameters; param {param_index} of "
                f"group {group_index} is {param.dtype}"
            )
        if target.device.type == "cpu" and target.is_contiguous():
            return target, None
        return torch.empty(param.shape, dtype=target.dtype), target

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            for key in self.STATE_KEYS:
                if key in state:
                    state[key] = state[key].to(self._state_dtype(param)).contiguous()
            if "step" in state and not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]))

    @staticmethod
    def _process_value_according_to_param_policy(param, value, param_id, param_groups, key=None):
        # torch casts loaded floating-point state to the parameter's dtype, which would round an
        # fp32 state of a bfloat16 parameter to bfloat16; keep it, load_state_dict sets the dtype.
        if key == "step" or not torch.is_tensor(value):
            return torch.optim.Optimizer._process_value_according_to_param_policy(
                param, value, param_id, param_groups, key
            )
        return value.to(device=param.device)


def _normalise_copy_groups(fp16_param_groups, num_groups: int):
    """DeepSpeed accepts a tensor, a list of tensors (one group) or a list of lists."""
    if fp16_param_groups is None:
        return None
    if torch.is_tensor(fp16_param_groups):
        return [[fp16_param_groups]]
    groups = list(fp16_param_groups)
    if groups and torch.is_tensor(groups[0]):
        groups = [groups]
    if len(groups) != num_groups:
        raise ValueError(
            f"fp16_param_groups has {len(groups)} groups but the optimizer has {num_groups}"
        )
    return groups
