"""Damaged libraries and unusable JIT caches: each a clear error naming the file or folder and
what to do, never a crash (a truncated library used to kill the process with SIGBUS).

The libraries are the real cpu_adam and registry builds of this checkout (compiled once into the
suite's JIT cache; cached after that), copied and then damaged or locked down."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from deepspeed_cpp.ops.cpu_adam import load_cpu_adam
from deepspeed_cpp.ops.op_builder import CPUAdamBuilder, RegistryBuilder
from deepspeed_cpp.ops.op_builder.builder import jit_cache_root
from deepspeed_cpp.ops.op_builder.library_check import (
    DamagedLibraryError,
    check_loadable,
    this_machine,
)

STEP_SCRIPT = """
import torch
from deepspeed_cpp.ops import cpu_adam_step
from deepspeed_cpp.ops.op_builder import CPUAdamBuilder
p, g, m, v = torch.ones(9), torch.ones(9), torch.zeros(9), torch.zeros(9)
cpu_adam_step(p, g, m, v, step=1, lr=0.5)
assert torch.allclose(p, torch.full((9,), 0.5)), p
print("STEP OK", CPUAdamBuilder().loaded_library())
"""

# root may write anything; without CAP_DAC_OVERRIDE it obeys file modes like anyone else.
_AS_UNPRIVILEGED = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                    "--bounding-set=-dac_override,-dac_read_search"]  # fmt: skip


def _run(cache, prefix=()):
    env = dict(os.environ, DS_CPP_EXTENSIONS_DIR=str(cache))
    return subprocess.run([*prefix, sys.executable, "-c", STEP_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def finished_builds():
    """The JIT build folders (with their lock files) of registry and cpu_adam, built if needed."""
    load_cpu_adam()
    return [RegistryBuilder().jit_build_dir(), CPUAdamBuilder().jit_build_dir()]


def _copy_cache(finished_builds, destination, only=None):
    """A JIT cache holding copies of the finished builds (or of those named in `only`)."""
    versioned = destination / jit_cache_root().name
    versioned.mkdir(parents=True)
    for build in finished_builds:
        if only is None or build.name.rsplit("_", 1)[0] in only:
            shutil.copytree(build, versioned / build.name)
            lock = build.with_name(build.name + ".lock")
            shutil.copy(lock, versioned / lock.name)
    return versioned


def _library(build_dir):
    return build_dir / f"{build_dir.name}.so"


def _damaged_copy(finished_builds, tmp_path, change):
    library = tmp_path / "copy.so"
    data = bytearray(_library(finished_builds[1]).read_bytes())
    library.write_bytes(bytes(change(data)))
    return library


def test_intact_library_passes(finished_builds, tmp_path):
    check_loadable(_damaged_copy(finished_builds, tmp_path, lambda data: data))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda data: data[: len(data) // 2], "it is truncated ("),
        (lambda data: data[:40], "it is not an ELF file (40 bytes"),
        (lambda data: b"", "it is not an ELF file (0 bytes"),
        (lambda data: b"<html>404 Not Found</html>" * 4, "starting with b'<htm'"),
        (lambda data: data[:4] + b"\x01" + data[5:], "it is a 32-bit ELF file"),
        (lambda data: data[:16] + b"\x01\x00" + data[18:], "not a shared library (type 3)"),
    ],
)
def test_damaged_library_is_named(finished_builds, tmp_path, change, message):
    library = _damaged_copy(finished_builds, tmp_path, change)
    with pytest.raises(DamagedLibraryError) as error:
        check_loadable(library)
    assert str(error.value).startswith(f"{library} is not a loadable shared library: ")
    assert message in str(error.value)


def test_library_for_another_architecture_is_named(finished_builds, tmp_path):
    other, number = ("aarch64", 183) if this_machine() != "aarch64" else ("x86_64", 62)

    def patch_machine(data):
        return data[:18] + number.to_bytes(2, "little") + data[20:]

    library = _damaged_copy(finished_builds, tmp_path, patch_machine)
    with pytest.raises(DamagedLibraryError, match=f"it was built for {other}; this machine is "):
        check_loadable(library)


def test_truncated_library_in_the_jit_cache_is_an_error_not_a_crash(finished_builds, tmp_path):
    versioned = _copy_cache(finished_builds, tmp_path)
    build = versioned / finished_builds[1].name
    library = _library(build)
    library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    ran = _run(tmp_path)
    assert ran.returncode == 1, (ran.returncode, ran.stderr[-2000:])  # SIGBUS gave -7
    assert ran.returncode != -signal.SIGBUS
    assert f"{library} is not a loadable shared library: it is truncated" in ran.stderr
    assert f"To fix it: delete {build} to have it rebuilt, or set DS_CPP_EXTENSIONS_DIR" in (
        ran.stderr
    )


def _read_only(folder):
    for root, _, files in os.walk(folder):
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
        os.chmod(root, 0o555)


def _unprivileged_prefix():
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a folder read-only for us")
    return _AS_UNPRIVILEGED


def test_read_only_cache_serves_finished_builds_and_names_itself_for_new_ones(
    finished_builds, tmp_path
):
    prefix = _unprivileged_prefix()
    whole, partial = tmp_path / "whole", tmp_path / "partial"
    _copy_cache(finished_builds, whole)
    versioned = _copy_cache(finished_builds, partial, only={"registry"})
    _read_only(whole)
    _read_only(partial)

    served = _run(whole, prefix)
    assert served.returncode == 0, served.stderr[-3000:]
    assert f"STEP OK {whole}" in served.stdout
    assert "just in time" not in served.stderr

    refused = _run(partial, prefix)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert (
        f"op 'cpu_adam' needs compiling just in time, but the JIT cache folder {versioned}: it "
        f"is not writable" in refused.stderr
    )
    assert "Set DS_CPP_EXTENSIONS_DIR to a writable folder" in refused.stderr


def test_jit_cache_on_a_full_disk_says_so(tmp_path):
    from disk_folders import mount_namespace_prefix

    prefix = mount_namespace_prefix(tmp_path)
    if prefix is None:
        pytest.skip("no mount namespace here to make a small file system")
    cache = tmp_path / "small"
    cache.mkdir()
    # Filled before the build starts, so it fails at its first write instead of after minutes of
    # compiling (the same message comes from a compiler that cannot write its object file).
    mounted = (
        f"mount -t tmpfs -o size=64k tmpfs {cache} && "
        f'(dd if=/dev/zero of={cache}/filler bs=4k 2>/dev/null; exec "$@")'
    )
    ran = _run(cache, prefix=[*prefix, "sh", "-c", mounted, "sh"])
    assert ran.returncode == 1, ran.stderr[-3000:]
    assert "JIT build of op 'registry' failed in " in ran.stderr
    assert f"The disk holding {cache / jit_cache_root().name}" in ran.stderr
    assert "free space or set DS_CPP_EXTENSIONS_DIR to a folder on another disk" in ran.stderr
