"""Tensor parallelism for training (DeepSpeed's AutoTP): column-/row-parallel linear layers
(``layers.py``), per-architecture policies (``tp_policies.py``) and the split of a model
(``auto_tp.py``)."""

from .auto_tp import (
    TensorParallelInfo,
    gather_full_state_dict,
    merge_tensor_parallel_parts,
    planned_slices,
    shard_model,
    tensor_parallel_info,
    tensor_parallel_slices,
)
from .layers import LinearAllreduce, LinearLayer, is_tensor_parallel_param
from .tp_policies import TensorParallelPolicy, register_tp_policy

__all__ = [
    "LinearAllreduce",
    "LinearLayer",
    "TensorParallelInfo",
    "TensorParallelPolicy",
    "gather_full_state_dict",
    "is_tensor_parallel_param",
    "merge_tensor_parallel_parts",
    "planned_slices",
    "register_tp_policy",
    "shard_model",
    "tensor_parallel_info",
    "tensor_parallel_slices",
]
