"""``deepspeed.runtime.constants``: ds_config key names and defaults scripts import.

``GRADIENT_CLIPPING_DEFAULT`` is deepspeed_cpp's default (0.0: no clipping unless the config asks).
DeepSpeed 0.19.8 changed its default to 1.0, so a config without ``gradient_clipping`` clips at 1.0
under DeepSpeed and not here; see the issue-26 note.
"""

GRADIENT_CLIPPING = "gradient_clipping"
GRADIENT_CLIPPING_DEFAULT = 0.0
TRAIN_BATCH_SIZE = "train_batch_size"
TRAIN_MICRO_BATCH_SIZE_PER_GPU = "train_micro_batch_size_per_gpu"
GRADIENT_ACCUMULATION_STEPS = "gradient_accumulation_steps"
STEPS_PER_PRINT = "steps_per_print"
