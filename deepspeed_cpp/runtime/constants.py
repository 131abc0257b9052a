"""``deepspeed.runtime.constants``: ds_config key names and defaults scripts import.

``GRADIENT_CLIPPING_DEFAULT`` is DeepSpeed 0.19.8's, 1.0: a config without ``gradient_clipping``
clips the global gradient norm at 1.0, as it does under DeepSpeed (``0`` turns clipping off).
"""

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = 1.0
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
STEPS_PER_PRINT = "steps_per_print"
