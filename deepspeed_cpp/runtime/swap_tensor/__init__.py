"""DeepSpeed's ``deepspeed.runtime.swap_tensor`` names scripts read.

``MIN_SWAPPABLE_BYTES``: DeepSpeed swaps to NVMe only tensors of at least this many bytes (1 MiB).
deepspeed_cpp's swapper (``runtime/swap``) has no lower limit, so a tensor of this size or more is
swapped under both; scripts use the number to size tensors that must reach the disk.
"""

MIN_SWAPPABLE_BYTES = 1024**2
