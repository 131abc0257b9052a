"""Moving tensors between memory and files (NVMe offload) through the aio handle."""

from .tensor_swapper import ChunkCallback, TensorSwapper

__all__ = ["ChunkCallback", "TensorSwapper"]
