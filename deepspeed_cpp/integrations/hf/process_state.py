"""accelerate's process state on machines without a GPU.

accelerate 1.15's ``PartialState`` chooses a process-group backend only for accelerators or when
``cpu=True``; launched by torchrun on a machine without a GPU and ``use_cpu`` left False, it
picks none, so every rank believes it is alone (world size 1) and the batch-size identity
(``train_batch_size = micro x accumulation x world``) breaks. ``use_cpu=True`` is no way out for
users of real DeepSpeed (it turns DeepSpeed off), and we do not want to change a user's argument,
so the state is rebuilt here: gloo, and the world size torchrun announced.
"""

from __future__ import annotations

import os

import torch


def launched_without_gpu() -> bool:
    """True when a launcher started several processes and there is no GPU to run them on."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


def ensure_cpu_process_state() -> None:
    """Makes accelerate's shared ``PartialState`` a gloo group of ``WORLD_SIZE`` CPU ranks when
    launched without a GPU; otherwise leaves it alone. Idempotent."""
    if not launched_without_gpu():
        return
    from accelerate.state import AcceleratorState, DistributedType, PartialState

    expected = int(os.environ["WORLD_SIZE"])
    if PartialState._shared_state:
        state = PartialState()
        if state.num_processes == expected and state.distributed_type == DistributedType.MULTI_CPU:
            return
        # A state built with no backend (world of one) is shared by every later Accelerator:
        # drop it so the next one is built right.
        AcceleratorState._reset_state(reset_partial_state=True)
    # With cpu=True accelerate takes its MULTI_CPU path: gloo, rank and world size from the
    # launcher's environment, and an existing process group (ours, torchrun's) is reused.
    state = PartialState(cpu=True, backend="gloo")
    if state.num_processes != expected:
        raise RuntimeError(
            f"accelerate's process state has {state.num_processes} process(es) but WORLD_SIZE = "
            f"{expected}: expected the launcher's world size; is torch.distributed initialized "
            "with a different group?"
        )
