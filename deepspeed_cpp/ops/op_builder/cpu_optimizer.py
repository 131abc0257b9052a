from .builder import OpBuilder

# Torch-free pieces every CPU optimizer family compiles: the run-time ISA choice, the step that
# dispatches on it, the extern "C" query of the chosen level and one translation unit per ISA
# level (each compiles to nothing on other architectures). They are the same files for every
# family; what differs is the family's folder on the include path, whose cpu_optim_family.h names
# its per-element step and its query symbol (see csrc/cpu_optim/family_levels.h). The rest
# (csrc/common/cpu_*.h) is header-only.
_SHARED_SOURCES = [
    "cpu_optim/cpu_optim_dispatch.cpp",
    "cpu_optim/cpu_optim_isa_query.cpp",
    *(f"cpu_optim/cpu_optim_{level}.cpp" for level in ("scalar", "avx2", "avx512", "neon")),
    "common/cpu_isa.cpp",
]


class CPUOptimizerBuilder(OpBuilder):
    """A CPU optimizer family: csrc/<NAME>/ with its op, its kernel entry and its per-element step,
    compiled with the shared per-ISA loops of csrc/cpu_optim/. Its glue uses only PyTorch's stable
    C ABI (csrc/cpu_optim/cpu_optimizer_glue.h)."""

    STABLE_ABI = True

    def sources(self) -> list[str]:
        family = self.NAME
        return [f"{family}/{family}_op.cpp", f"{family}/{family}_kernel.cpp", *_SHARED_SOURCES]

    def include_dirs(self) -> list[str]:
        return [self.NAME]

    def extra_cflags(self) -> list[str]:
        return super().extra_cflags() + ["-fopenmp"]

    def extra_ldflags(self) -> list[str]:
        return ["-fopenmp"]
