"""Checks that a shared library file is whole and for this machine before it is loaded.

``dlopen`` maps a library's segments straight from the file: a truncated file (a copy cut short,
a build on a full disk) maps pages past its end, and the first touch of them kills the process
with SIGBUS, no Python error at all. A library for another CPU architecture fails with a terse
"wrong ELF class" or "cannot open shared object file". Reading the ELF header, the program
headers and the section header table first turns each of these into an error naming the file.
"""

from __future__ import annotations

import platform
import struct
import sys
from pathlib import Path

_ELF_MAGIC = b"\x7fELF"
_ELFCLASS64 = 2
_ET_DYN = 3
_PT_LOAD = 1
# e_machine of the architectures a wheel of ours can be built for.
_MACHINES = {62: "x86_64", 183: "aarch64", 3: "i386", 40: "arm", 21: "ppc64", 22: "s390x"}
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64", "ppc64le": "ppc64"}


class DamagedLibraryError(RuntimeError):
    """A library file is truncated, not ELF or for another machine; the message says which."""


def this_machine() -> str:
    name = platform.machine().lower()
    return _MACHINE_ALIASES.get(name, name)


def check_loadable(path: Path) -> None:
    """Raises DamagedLibraryError if `path` is not a complete 64-bit ELF shared library for this
    machine's architecture and byte order. Reads only the headers (a few hundred bytes)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            header = file.read(64)
            problem = _header_problem(header, size)
            if not problem:
                problem = _segments_problem(file, header, size)
    except OSError as error:
        raise DamagedLibraryError(f"{path}: cannot be read ({error})") from error
    if problem:
        raise DamagedLibraryError(f"{path} is not a loadable shared library: {problem}")


def _header_problem(header: bytes, size: int) -> str:
    if len(header) < 64 or header[:4] != _ELF_MAGIC:
        start = header[:4]
        return f"it is not an ELF file ({size} bytes, starting with {start!r})"
    if header[4] != _ELFCLASS64:
        return "it is a 32-bit ELF file; this is a 64-bit process"
    little = header[5] == 1
    if little != (sys.byteorder == "little"):
        return f"its byte order is {'little' if little else 'big'}-endian, unlike this machine"
    e_type, e_machine = struct.unpack(_order(header) + "HH", header[16:20])
    machine = _MACHINES.get(e_machine, f"machine number {e_machine}")
    if machine != this_machine():
        return f"it was built for {machine}; this machine is {this_machine()}"
    if e_type != _ET_DYN:
        return f"it is an ELF file of type {e_type}, not a shared library (type {_ET_DYN})"
    return ""


def _segments_problem(file, header: bytes, size: int) -> str:
    order = _order(header)
    (e_phoff, e_shoff) = struct.unpack(order + "QQ", header[32:48])
    (e_phentsize, e_phnum, e_shentsize, e_shnum) = struct.unpack(order + "HHHH", header[54:62])
    needed = max(e_phoff + e_phentsize * e_phnum, e_shoff + e_shentsize * e_shnum)
    file.seek(e_phoff)
    table = file.read(e_phentsize * e_phnum)
    if len(table) == e_phentsize * e_phnum:
        for i in range(e_phnum):
            entry = table[i * e_phentsize : (i + 1) * e_phentsize]
            p_type, _, p_offset, _, _, p_filesz = struct.unpack(order + "IIQQQQ", entry[:40])
            if p_type == _PT_LOAD:
                needed = max(needed, p_offset + p_filesz)
    if size < needed:
        return f"it is truncated ({size} bytes; its headers describe {needed} bytes)"
    return ""


def _order(header: bytes) -> str:
    return "<" if header[5] == 1 else ">"
