"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters``: the ZeRO-3 parameter bookkeeping
(``partitioned_params.py``: shards, status, gathers, release), ``zero.Init`` (``zero_init.py``)
and ``GatheredParameters`` (here), under the one module path that stage-3 code and transformers
import them from.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from .construction_heap import note_freed
from .external_parameters import (  # noqa: F401  (DeepSpeed's module path for them)
    register_external_parameter,
    unregister_external_parameter,
)
from .gather_handles import (  # noqa: F401  (DeepSpeed's module path for them)
    MultipleAllGatherHandles,
    partitioned_param_data_shape,
)
from .partitioned_params import (  # noqa: F401  (the bookkeeping, under this path as before)
    SHARD_ALIGNMENT,
    ZeroParamStatus,
    claim,
    describe,
    device_of,
    gather_all,
    group_world,
    is_partitioned,
    is_zero_param,
    launch_gather,
    padded_numel,
    partition_parameter,
    read_shard,
    release,
    start_gather,
    store_shard,
    unpartition_parameter,
    wait_gather,
    whole_buffer,
    write_back,
    write_shard,
)

# DeepSpeed's module-level names that transformers reads (and swaps) here while it builds a model
# under a live stage-3 config; ``Init.__enter__`` looks the wrapper up in this module.
from .tensor_constructors import (  # noqa: F401  (re-exported under DeepSpeed's module path)
    ORIGINAL_CONSTRUCTORS,
    _orig_torch_arange,
    _orig_torch_empty,
    _orig_torch_eye,
    _orig_torch_full,
    _orig_torch_ones,
    _orig_torch_randn,
    _orig_torch_tensor,
    _orig_torch_zeros,
    get_accelerator,
    zero_wrapper_for_fp_tensor_constructor,
)
from .zero_init import Init  # noqa: F401  (DeepSpeed's module path for it)


class GatheredParameters:
    """Gathers ZeRO-3 parameters for the duration of a ``with`` block.

    With ``modifier_rank`` set, the values that rank holds at the end of the block are broadcast
    and written back into every rank's shard (to initialise weights, resize an embedding, load
    values); without it, changes are discarded. Parameters that are not ZeRO-3 ones are left
    alone, so the same code runs at any stage. Every rank must enter the block. After
    ``initialize`` a change is trained on in fp32 (the shards are the fp32 masters), while in
    bf16/fp16 the next step writes the unchanged masters back over it (DeepSpeed does that at
    every precision): change values before ``initialize`` to get the same result everywhere.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if is_zero_param(p)] if enabled else []
        self.modifier_rank = modifier_rank
        if enabled and modifier_rank is not None:
            world, _ = group_world(self.params[0].ds_group if self.params else None)
            if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world:
                raise ValueError(
                    f"GatheredParameters: modifier_rank={modifier_rank!r} is out of range; "
                    f"expected a rank in [0, {world}) or None"
                )
        if fwd_module is not None:
            for param in self.params:
                register_external_parameter(fwd_module, param)

    def __enter__(self):
        gather_all(self.params)
        return self.params

    def __exit__(self, *exc_info):
        if self.modifier_rank is not None and exc_info[0] is None:
            with torch.no_grad():
                for param in self.params:
                    world, _ = group_world(param.ds_group)
                    if world > 1:
                        data = param.data.contiguous()
                        with named_collective(
                            lambda param=param: (
                                f"broadcast from rank {self.modifier_rank} of "
                                f"ZeRO-3 parameter {describe(param)} leaving GatheredParameters"
                            )
                        ):
                            dist.broadcast(data, group_src=self.modifier_rank, group=param.ds_group)
                        param.data.copy_(data)
                    write_back(param)
        for param in self.params:
            release(param)
        note_freed(self.params)  # loading module by module frees a whole module each time
        return False
