from .builder import OpBuilder

# Torch-free pieces every CPU optimizer family compiles: the run-time ISA choice. The rest of the
# shared machinery (csrc/common/cpu_*.h) is header-only.
_COMMON_SOURCES = ["common/cpu_isa.cpp"]
# One translation unit per ISA level; each compiles to nothing on other architectures.
_LEVELS = ["scalar", "avx2", "avx512", "neon"]


class CPUOptimizerBuilder(OpBuilder):
    """A CPU optimizer family: csrc/<NAME>/ with an op, a kernel and one loop file per ISA level."""

    def sources(self) -> list[str]:
        family = self.NAME
        return (
            [f"{family}/{family}_op.cpp", f"{family}/{family}_kernel.cpp"]
            + [f"{family}/{family}_{level}.cpp" for level in _LEVELS]
            + _COMMON_SOURCES
        )

    def extra_cflags(self) -> list[str]:
        return super().extra_cflags() + ["-fopenmp"]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]
