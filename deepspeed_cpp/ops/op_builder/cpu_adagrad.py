from .cpu_optimizer import CPUOptimizerBuilder


class CPUAdagradBuilder(CPUOptimizerBuilder):
    """csrc/cpu_adagrad: Adagrad on CPU tensors (fp32/bf16/fp16), ISA chosen at run time."""

    NAME = "cpu_adagrad"
