from .cpu_optimizer import CPUOptimizerBuilder


class CPUAdamBuilder(CPUOptimizerBuilder):
    """csrc/cpu_adam: Adam/AdamW on CPU tensors (fp32/bf16/fp16), ISA chosen at run time."""

    NAME = "cpu_adam"
