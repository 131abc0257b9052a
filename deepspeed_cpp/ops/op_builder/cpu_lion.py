from .cpu_optimizer import CPUOptimizerBuilder


class CPULionBuilder(CPUOptimizerBuilder):
    """csrc/cpu_lion: Lion on CPU tensors (fp32/bf16/fp16), ISA chosen at run time."""

    NAME = "cpu_lion"
