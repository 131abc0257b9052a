"""One rank of tests/test_init_distributed_forms.py: initialises the default group through
``deepspeed_cpp.init_distributed`` in each requested argument form, all-reduces its rank, and
destroys the group through ``deepspeed_cpp.comm.destroy_process_group`` before the next form."""

from __future__ import annotations

import os
import traceback


def run_forms(rank: int, world_size: int, forms: list[dict], results) -> None:
    import torch

    import deepspeed_cpp
    import deepspeed_cpp.comm as ds_comm

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    outcome = []
    try:
        for form in forms:
            environment = {k: v.format(rank=rank) for k, v in form.get("environment", {}).items()}
            os.environ.update(environment)
            kwargs = {k: (v.format(rank=rank) if isinstance(v, str) else v)
                      for k, v in form["kwargs"].items()}  # fmt: skip
            if kwargs.pop("pass_rank", False):
                kwargs.update(rank=rank, world_size=world_size)
            deepspeed_cpp.init_distributed("gloo", verbose=False, **kwargs)
            value = torch.tensor([float(rank + 1)])
            ds_comm.all_reduce(value)
            outcome.append((ds_comm.get_rank(), ds_comm.get_world_size(), value.item()))
            ds_comm.destroy_process_group()
            assert not ds_comm.is_initialized()
            for key in environment:
                os.environ.pop(key, None)
        results.put((rank, True, outcome))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((rank, False, traceback.format_exc()))
