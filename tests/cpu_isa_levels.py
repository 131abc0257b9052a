"""The CPU kernel ISA levels this machine can run, read the way csrc/common/cpu_isa.cpp decides."""


def supported_isa_levels() -> list[str]:
    levels = ["scalar"]
    flags = open("/proc/cpuinfo").read()
    if " avx2 " in flags and " fma " in flags and " f16c " in flags:
        levels.append("avx2")
        if all(f" {flag} " in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512dq")):
            levels.append("avx512")
    return levels
