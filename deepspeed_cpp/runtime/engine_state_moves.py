"""DeepSpeed's ``engine.offload_states()`` / ``engine.reload_states()``: move the engine's
training states (optimizer states, fp32 masters, the module's parameters and gradients) off the
accelerator between phases of a loop that needs its memory for something else (RLHF's generation
phase), and back.

What that means here: on an engine whose device is the host (every CPU engine), and for the
states ``offload_optimizer`` already keeps on the host, the states are where an offload would
put them: nothing moves, the call checks its arguments as DeepSpeed does, and training continues
exactly as without the call. Moving ZeRO's device buffers of a GPU
engine to the host is not supported yet: refused by name rather than done halfway.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable

from ..utils.logging import logger
from .zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

# States ``offload_optimizer`` keeps on the host already (DeepSpeed leaves them out the same way).
_ON_HOST_WITH_OPTIMIZER_OFFLOAD = {
    OffloadStateTypeEnum.hp_params,
    OffloadStateTypeEnum.optim_states,
}


def _states(include: Iterable | None) -> list[OffloadStateTypeEnum]:
    if include is None:
        return list(OffloadStateTypeEnum)
    if isinstance(include, (str, OffloadStateTypeEnum)):
        include = [include]
    allowed = ", ".join(s.value for s in OffloadStateTypeEnum)
    states = []
    for value in include:
        try:
            states.append(OffloadStateTypeEnum(value))
        except ValueError:
            raise ValueError(
                f"engine.offload_states(include=...): {value!r} is not a state; expected some "
                f"of {allowed}"
            ) from None
    return states


def _device(device) -> OffloadDeviceEnum:
    try:
        return OffloadDeviceEnum(getattr(device, "value", device))
    except ValueError:
        raise ValueError(
            f"engine.offload_states(device={device!r}): expected OffloadDeviceEnum.cpu "
            "(or 'none', which does nothing)"
        ) from None


class EngineStateMoves:
    """``offload_states`` / ``reload_states`` / ``empty_partition_cache`` for
    ``DeepSpeedEngine``."""

    def empty_partition_cache(self) -> None:
        """Frees the whole ZeRO-3 parameters still gathered (after an evaluation forward, say),
        as DeepSpeed's engine method does; nothing to free at the other stages."""
        release = getattr(self._zero_stage, "empty_partition_cache", None)
        if release is not None:
            release()
            gc.collect()

    def _check_states_can_move(self) -> None:
        if self.optimizer is None:
            raise RuntimeError(
                "engine.offload_states()/reload_states(): the engine has no optimizer (built "
                "without one, for inference); moving states is for a training engine"
            )
        param_offload = self.config.zero_optimization.offload_param
        if param_offload is not None and param_offload.device != OffloadDeviceEnum.none:
            raise RuntimeError(
                "engine.offload_states(): not with zero_optimization.offload_param.device = "
                f"{param_offload.device!r}: the parameters are offloaded already (as DeepSpeed, "
                "which refuses it too)"
            )

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:  # fmt: skip
        """Moves ``include`` (default: every ``OffloadStateTypeEnum``) to ``device`` (the host)
        until ``reload_states()``; see the module docstring for what moves here."""
        states = _states(include)
        target = _device(device)
        self._check_states_can_move()
        if target == OffloadDeviceEnum.none:
            logger.warning(
                "engine.offload_states(): no device given (device='none'); nothing moved"
            )
            return
        if target == OffloadDeviceEnum.nvme:
            raise ValueError(
                "engine.offload_states(device='nvme'): only the host (cpu) is supported"
            )
        optimizer_offload = self.config.zero_optimization.offload_optimizer
        on_host = set()
        if optimizer_offload is not None and optimizer_offload.device != OffloadDeviceEnum.none:
            on_host |= _ON_HOST_WITH_OPTIMIZER_OFFLOAD
        to_move = [s for s in states if s not in on_host]
        if to_move and self.device.type != "cpu":
            raise NotImplementedError(
                f"engine.offload_states(): moving {', '.join(s.value for s in to_move)} from "
                f"{self.device} to the host is not supported yet by deepspeed_cpp (ZeRO's device "
                "buffers stay where they are); on a CPU engine every state is on the host already"
            )

    def reload_states(self, non_blocking: bool = False) -> None:
        """Brings back what ``offload_states()`` moved (here: nothing had to move)."""
        self._check_states_can_move()
