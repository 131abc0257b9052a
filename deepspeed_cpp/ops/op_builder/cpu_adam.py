from .builder import OpBuilder


class CPUAdamBuilder(OpBuilder):
    """csrc/cpu_adam: Adam/AdamW over fp32 CPU tensors, ISA chosen at run time."""

    NAME = "cpu_adam"

    def sources(self) -> list[str]:
        return [
            "cpu_adam/cpu_adam_op.cpp",
            "cpu_adam/cpu_adam_kernel.cpp",
            "common/cpu_isa.cpp",
        ]

    def extra_cflags(self) -> list[str]:
        return super().extra_cflags() + ["-fopenmp"]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]
