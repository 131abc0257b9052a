"""The symbol versions a shared library needs from the C and C++ runtimes, against the highest
ones manylinux_2_28 allows (glibc 2.28, gcc 8's libstdc++ and libgcc: auditwheel's policy).

A library lists in its .gnu.version_r section every version it needs per library; the dynamic
loader refuses to load it where one is missing, so this is exactly what decides whether it loads
on an older system.
"""

from pathlib import Path

from elftools.elf.elffile import ELFFile

# Version prefix -> the highest version manylinux_2_28 allows.
MANYLINUX_2_28_LIMITS = {
    "GLIBC_": (2, 28),
    "GLIBCXX_": (3, 4, 24),
    "CXXABI_": (1, 3, 11),
    "GCC_": (4, 8, 0),
}


def needed_versions(library: Path) -> list[tuple[str, str]]:
    """(library it is needed from, version name) for every version `library` needs."""
    with open(library, "rb") as handle:
        section = ELFFile(handle).get_section_by_name(".gnu.version_r")
        if section is None:
            return []
        return [(needed.name, aux.name) for needed, auxes in section.iter_versions()
                for aux in auxes]  # fmt: skip


def _number(text: str) -> tuple[int, ...] | None:
    parts = text.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def too_new_for_manylinux_2_28(library: Path) -> list[str]:
    """'libc.so.6: GLIBC_2.32' for every needed version above manylinux_2_28's limit."""
    too_new = []
    for needed_from, version in needed_versions(library):
        for prefix, limit in MANYLINUX_2_28_LIMITS.items():
            number = _number(version[len(prefix) :]) if version.startswith(prefix) else None
            if number is not None and number > limit:
                too_new.append(f"{needed_from}: {version}")
    return too_new
