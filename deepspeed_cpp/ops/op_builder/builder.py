"""The base class every op builder derives from: sources, flags, pre-built lookup, JIT build.

A native op family is one shared library that adds kernels to the ``deepspeed_cpp`` operator
namespace. It is found in this order:

1. pre-built by ``setup.py`` (``DS_BUILD_OPS=1`` or ``DS_BUILD_<NAME>=1``) into
   ``deepspeed_cpp/_ops/`` for the same torch version;
2. compiled just in time with ``torch.utils.cpp_extension.load`` into a cache folder whose name is
   a digest of the torch version, the compiler flags and every source and header, so that a change
   of any of those builds afresh and nothing else does.

The JIT build is guarded by an ``fcntl`` lock on a file beside the build folder. The kernel drops
such a lock when its owner dies, so a killed build never blocks a later one, and the next build
finds the mark the killed one left and starts over from an empty folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import ClassVar

from .build_info import current_build_info, mismatch, read_build_info, wheel_local_version
from .library_check import DamagedLibraryError, check_loadable

logger = logging.getLogger("deepspeed_cpp")

_PACKAGE_DIR = Path(__file__).resolve().parents[2]  # .../deepspeed_cpp
PREBUILT_DIR = _PACKAGE_DIR / "_ops"
BUILD_INFO_FILE = PREBUILT_DIR / "build_info.json"

# The flags every C++ translation unit is compiled with. -ffp-contract=off keeps the compiler from
# fusing a*b+c on its own, which would make ISA paths round differently (see adam_math.h);
# -fno-math-errno lets sqrtf vectorise. No -march: one binary runs on every CPU of its arch.
# Every translation unit starts with csrc/common/glibc_compat.h (found through csrc/ on the
# include path), which binds the C library's symbols to versions glibc 2.28 has, so that a
# library built on a newer system still loads on a manylinux_2_28 one.
GLIBC_COMPAT_HEADER = "common/glibc_compat.h"
BASE_CXX_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-include", GLIBC_COMPAT_HEADER]
# The same header for the host code nvcc hands to the C++ compiler.
NVCC_HOST_FLAGS = ["-Xcompiler", f"-include,{GLIBC_COMPAT_HEADER}"]

# The oldest torch whose stable C ABI the STABLE_ABI families are built for: their headers' newer
# APIs are compiled out (TORCH_TARGET_VERSION), so one build loads under this torch and later ones.
STABLE_ABI_MIN_TORCH = (2, 13)
STABLE_ABI_CXX_FLAGS = [
    "-DTORCH_TARGET_VERSION=0x{:02x}{:02x}000000000000".format(*STABLE_ABI_MIN_TORCH)
]

# Loaded libraries, by op name, for this process.
_loaded: dict[str, Path] = {}


class OpNotAvailableError(RuntimeError):
    """An op can be neither found pre-built nor compiled here; the message says why."""


def csrc_dir() -> Path:
    """The C++ sources: shipped inside the package when installed, else the source tree's."""
    for candidate in (_PACKAGE_DIR / "csrc", _PACKAGE_DIR.parent / "csrc"):
        if (candidate / "registration.cpp").is_file():
            return candidate
    raise OpNotAvailableError(
        f"deepspeed_cpp's C++ sources were not found in {_PACKAGE_DIR / 'csrc'} nor in "
        f"{_PACKAGE_DIR.parent / 'csrc'}; the installation is incomplete (reinstall the package)"
    )


def default_max_jobs() -> int:
    """MAX_JOBS when set, else as many jobs as cores and free memory (2 GiB each) allow."""
    if os.environ.get("MAX_JOBS"):
        return max(1, int(os.environ["MAX_JOBS"]))
    jobs = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    jobs = min(jobs, int(line.split()[1]) // (2 * 1024 * 1024))
    return max(1, jobs)


def jit_cache_root() -> Path:
    """Where JIT builds go: DS_CPP_EXTENSIONS_DIR, else under TORCH_EXTENSIONS_DIR or ~/.cache."""
    import torch

    explicit = os.environ.get("DS_CPP_EXTENSIONS_DIR")
    if explicit:
        root = Path(explicit)
    elif os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_cpp"
    else:
        root = Path.home() / ".cache" / "deepspeed_cpp" / "torch_extensions"
    cuda = "cu" + torch.version.cuda.replace(".", "") if torch.version.cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"{python}_torch{torch.__version__.split('+')[0]}_{cuda}"


class OpBuilder:
    """Describes one op family. Subclasses set NAME and list their sources (relative to csrc/)."""

    NAME: ClassVar[str] = ""
    # Every family but the schema library itself needs the schemas loaded first.
    NEEDS_REGISTRY: ClassVar[bool] = True
    # Whether the family uses only PyTorch's stable C ABI (torch/csrc/stable): then a pre-built
    # library serves every torch from STABLE_ABI_MIN_TORCH on, not only the one it was built with.
    # Families holding torch::CustomClassHolder objects or c10d process groups cannot: those are
    # C++ types with no stable form.
    STABLE_ABI: ClassVar[bool] = False

    # --- what subclasses describe -------------------------------------------------------------
    def sources(self) -> list[str]:
        raise NotImplementedError

    def include_dirs(self) -> list[str]:
        """Folders (relative to csrc/) searched for includes besides csrc/ itself."""
        return []

    def extra_cflags(self) -> list[str]:
        return BASE_CXX_FLAGS + (STABLE_ABI_CXX_FLAGS if self.STABLE_ABI else [])

    def extra_ldflags(self) -> list[str]:
        return []

    def extra_cuda_cflags(self) -> list[str]:
        """nvcc flags for the family's .cu sources (architectures included)."""
        return []

    def is_cuda(self) -> bool:
        """Whether the family has CUDA sources: then it builds with nvcc, as a CUDAExtension."""
        return any(source.endswith(".cu") for source in self.sources())

    def prepare_build(self) -> None:
        """Called just before the family is compiled (JIT or setup.py); nothing by default."""

    def is_compatible(self) -> tuple[bool, str]:
        """Whether this op can be built for this machine, and if not, what is missing."""
        return True, ""

    # --- derived ------------------------------------------------------------------------------
    def absolute_include_dirs(self) -> list[Path]:
        root = csrc_dir()
        return [root, *(root / folder for folder in self.include_dirs())]

    def absolute_sources(self) -> list[Path]:
        root = csrc_dir()
        return [root / source for source in self.sources()]

    def source_digest(self) -> str:
        """Digest of torch's version, the flags, this op's sources and every header in csrc/ (by
        their paths inside csrc/ and their contents), not of where csrc/ is: two checkouts, venvs
        or CI jobs with the same sources share one build. A finished build is served without
        torch's build step (``_finished_build``), whose ninja file names the sources of the
        checkout that compiled it by absolute path, so they never take turns rebuilding it."""
        import torch

        root = csrc_dir()
        digest = hashlib.sha256()
        digest.update(f"{torch.__version__}|{torch.version.cuda}|{sys.version_info[:2]}".encode())
        flags = self.extra_cflags() + self.extra_ldflags() + self.extra_cuda_cflags()
        flags += self.include_dirs()
        digest.update("|".join(flags).encode())
        headers = sorted(p for p in root.rglob("*") if p.suffix in (".h", ".cuh", ".hpp"))
        for path in self.absolute_sources() + headers:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def jit_build_dir(self) -> Path:
        return jit_cache_root() / f"{self.NAME}_{self.source_digest()}"

    def prebuilt_library(self) -> Path | None:
        """The pre-built library when it was built for this torch, else None."""
        library, _ = self.find_prebuilt()
        return library

    def find_prebuilt(self) -> tuple[Path | None, str]:
        """(the usable pre-built library or None, why a pre-built one present is not usable)."""
        matches = sorted(PREBUILT_DIR.glob(f"{self.NAME}.*so"))
        if not matches:
            return None, ""
        differs = mismatch(read_build_info(BUILD_INFO_FILE), op=self.NAME)
        if differs:
            return None, f"the pre-built {matches[0]} cannot be used: {differs}"
        return matches[0], ""

    def jit_available(self) -> tuple[bool, str]:
        """Whether a JIT build can be attempted here, and if not, what is missing."""
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            return False, f"no C++ compiler: '{compiler}' is not on PATH (install g++ or set CXX)"
        try:
            import ninja  # noqa: F401
        except ImportError:
            if shutil.which("ninja") is None:
                return False, "ninja is not installed (pip install ninja)"
        return True, ""

    # --- loading ------------------------------------------------------------------------------
    def load(self, verbose: bool = False):
        """Loads the op's library (pre-built first, JIT otherwise) and returns its namespace."""
        import torch

        if self.NAME not in _loaded:
            ok, why = self.is_compatible()
            if not ok:
                raise OpNotAvailableError(f"op '{self.NAME}' cannot run on this machine: {why}")
            if self.NEEDS_REGISTRY:
                from .registry import RegistryBuilder

                RegistryBuilder().load(verbose=verbose)
            library = self._prebuilt_or_jit(verbose)
            if library not in _loaded.values():
                torch.ops.load_library(str(library))
            _loaded[self.NAME] = library
        return torch.ops.deepspeed_cpp

    def _prebuilt_or_jit(self, verbose: bool) -> Path:
        library, stale = self.find_prebuilt()
        if library is not None:
            _check_library(library, remedy=_REINSTALL)
            return library
        if stale:
            logger.warning("deepspeed_cpp: %s; using a just-in-time build instead", stale)
        return self._jit_build(verbose, stale)

    def loaded_library(self) -> Path | None:
        return _loaded.get(self.NAME)

    def c_library(self) -> ctypes.CDLL:
        """The loaded library as a ctypes handle, for the few extern "C" build descriptions."""
        self.load()
        return ctypes.CDLL(str(_loaded[self.NAME]))

    def _jit_build(self, verbose: bool, stale: str = "") -> Path:
        build_dir = self.jit_build_dir()
        library = build_dir / f"{build_dir.name}.so"
        remedy = (
            f"delete {build_dir} to have it rebuilt, or set DS_CPP_EXTENSIONS_DIR to another folder"
        )
        if _finished_build(build_dir, library):
            # Served without torch's build step, which writes into the folder: a read-only
            # cache of finished builds still works, and no compiler is needed.
            _check_library(library, remedy=remedy)
            return library
        ok, why = self.jit_available()
        if not ok and stale:
            running = current_build_info()
            raise OpNotAvailableError(
                f"op '{self.NAME}': {stale}; and it cannot be compiled just in time for torch "
                f"{running['torch_version']} here: {why}. Install deepspeed_cpp built for this "
                f"torch (a wheel whose version ends in +{wheel_local_version(running)}), or the "
                f"torch it was built for, or a C++ compiler."
            )
        if not ok:
            raise OpNotAvailableError(
                f"op '{self.NAME}' is not pre-built for this torch and cannot be compiled just in "
                f"time: {why}. Install a wheel built with DS_BUILD_OPS=1, or fix the above."
            )
        _make_writable_folder(build_dir.parent, self.NAME)
        os.environ.setdefault("MAX_JOBS", str(default_max_jobs()))
        try:
            with _exclusive_build_lock(build_dir):
                self._compile(build_dir, library, remedy, verbose)
        except OSError as error:  # the lock file or the build folder: a full disk, say
            raise OpNotAvailableError(
                f"JIT build of op '{self.NAME}' failed in {build_dir}: {error}."
                f"{_free_space_note(build_dir)}"
            ) from error
        return library

    def _compile(self, build_dir: Path, library: Path, remedy: str, verbose: bool) -> None:
        """Runs torch's build into `build_dir`; called holding the build's exclusive lock."""
        import torch.utils.cpp_extension as cpp_extension

        if library.is_file():
            # torch's build step would find it up to date and load it at once; a truncated
            # file would then crash the process (SIGBUS) instead of raising.
            _check_library(library, remedy=remedy)
        else:
            logger.warning(
                "deepspeed_cpp: compiling op '%s' just in time into %s (first use only)",
                self.NAME,
                build_dir,
            )
        build_dir.mkdir(exist_ok=True)
        self.prepare_build()
        try:
            cpp_extension.load(
                name=build_dir.name,
                sources=[str(p) for p in self.absolute_sources()],
                extra_cflags=self.extra_cflags(),
                extra_ldflags=self.extra_ldflags(),
                extra_cuda_cflags=self.extra_cuda_cflags() or None,
                extra_include_paths=[str(p) for p in self.absolute_include_dirs()],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=verbose,
            )
        except (RuntimeError, OSError, SystemExit) as error:
            raise OpNotAvailableError(
                f"JIT build of op '{self.NAME}' failed in {build_dir}: {error}. The "
                f"compiler's output is printed above.{_free_space_note(build_dir)}"
            ) from error


_REINSTALL = (
    "reinstall deepspeed_cpp (pip install --force-reinstall --no-deps <the wheel>), or delete "
    "the file to have the op compiled just in time"
)


def _check_library(library: Path, remedy: str) -> None:
    try:
        check_loadable(library)
    except DamagedLibraryError as error:
        raise OpNotAvailableError(f"{error}. To fix it: {remedy}.") from error


def _finished_build(build_dir: Path, library: Path) -> bool:
    """Whether `build_dir` holds a build that completed: its library is there and the lock file
    beside it was emptied by the build that made it (see _exclusive_build_lock). Takes the lock
    shared, so it waits for a build in progress, and opens it read-only, so it works in a cache
    the process cannot write."""
    lock_path = build_dir.with_name(build_dir.name + ".lock")
    try:
        with open(lock_path) as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_SH)
            try:
                return lock_file.read().strip() == "" and library.is_file()
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
    except OSError:
        return False


def _make_writable_folder(folder: Path, op: str) -> None:
    """Creates the JIT cache folder; an error names it when it cannot be created or written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
        reason = "it is not writable by this process (read-only, or owned by another user)"
    except OSError as error:
        writable, reason = False, f"it cannot be created ({error.strerror or error})"
    if not writable:
        raise OpNotAvailableError(
            f"op '{op}' needs compiling just in time, but the JIT cache folder {folder}: "
            f"{reason}. Set DS_CPP_EXTENSIONS_DIR to a writable folder (builds already finished "
            f"in a read-only cache are still used)."
        )


def _free_space_note(folder: Path) -> str:
    """' <folder> has only N MiB free.' when the disk is (nearly) full, else ''."""
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        if free < 256 * 1024 * 1024:
            return (
                f" The disk holding {folder} has only {free // (1024 * 1024)} MiB free: free "
                f"space or set DS_CPP_EXTENSIONS_DIR to a folder on another disk."
            )
    return ""


@contextlib.contextmanager
def _exclusive_build_lock(build_dir: Path):
    """Holds an flock beside `build_dir` while building; clears what a killed build left behind.

    The lock file says ``building <pid>`` while a build runs and is emptied when it succeeds.
    The kernel drops an flock when its holder dies, so finding ``building`` once we hold the
    flock means that build was killed (or failed) mid-way: its folder may hold half-written
    objects and, with torch < 2.14, a ``lock`` file on which torch would wait forever. The folder
    is removed and the build starts over.
    """
    lock_path = build_dir.with_name(build_dir.name + ".lock")
    with open(lock_path, "a+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            lock_file.seek(0)
            previous = lock_file.read().split()
            if previous[:1] == ["building"]:
                owner = previous[1] if len(previous) > 1 else "unknown"
                logger.warning(
                    "deepspeed_cpp: cleared a stale build lock on %s: the build by pid %s was "
                    "interrupted (that process is gone); rebuilding from scratch",
                    build_dir,
                    owner,
                )
                shutil.rmtree(build_dir, ignore_errors=True)
            _rewrite(lock_file, f"building {os.getpid()}")
            yield
            _rewrite(lock_file, "")
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _rewrite(lock_file, text: str) -> None:
    lock_file.seek(0)
    lock_file.truncate()
    lock_file.write(text)
    lock_file.flush()
