"""Every op library this test session loaded loads on glibc 2.28 (manylinux_2_28): it needs no
symbol version newer than that system's C and C++ runtimes have, although it was built on a newer
one (csrc/common/glibc_compat.h binds pow, exp, ... to their old versions and gives each library
its own __libc_single_threaded). The wheel itself is checked with auditwheel in
test_stable_abi_wheel.py.
"""

from symbol_versions import needed_versions, too_new_for_manylinux_2_28

from deepspeed_cpp.ops.op_builder import (
    ALL_OPS,
    CPUAdamBuilder,
    FusedAdamHostBuilder,
    RegistryBuilder,
)


def test_op_libraries_need_nothing_newer_than_glibc_2_28():
    # These two at least (compiled, or found compiled, for this session); with them every op
    # library that earlier tests of this process loaded. Older builds lying in the cache are not
    # looked at: they may come from older sources.
    for op in (RegistryBuilder(), CPUAdamBuilder()):
        op.load()
    families = (*ALL_OPS.values(), RegistryBuilder, FusedAdamHostBuilder)
    libraries = sorted({f().loaded_library() for f in families} - {None})
    assert len(libraries) >= 2, libraries
    for library in libraries:  # the section was found and read: libc's versions are listed
        assert any(v.startswith("GLIBC_") for _, v in needed_versions(library)), library
    too_new = {str(p): too_new_for_manylinux_2_28(p) for p in libraries}
    assert not any(too_new.values()), {p: v for p, v in too_new.items() if v}
