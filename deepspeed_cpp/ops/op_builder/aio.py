import functools
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .builder import OpBuilder

# Each optional engine: the header and library it needs, a call that must link, and the Debian
# package that provides them.
_OPTIONAL_ENGINES = {
    "io_uring": (
        "liburing.h",
        "uring",
        "struct io_uring ring; io_uring_queue_init(1, &ring, 0)",
        "liburing-dev",
    ),
    "libaio": ("libaio.h", "aio", "io_context_t context = 0; io_setup(1, &context)", "libaio-dev"),
}


@functools.cache
def _links(header: str, library: str, call: str) -> tuple[bool, str]:
    """Whether a program including `header` and calling into `-l<library>` compiles and links."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return False, f"no C++ compiler ('{compiler}')"
    with tempfile.TemporaryDirectory(prefix="deepspeed_cpp_aio_probe_") as folder:
        source = Path(folder) / "probe.cpp"
        source.write_text(f"#include <{header}>\nint main() {{ {call}; return 0; }}\n")
        try:
            result = subprocess.run(
                [compiler, str(source), "-o", str(Path(folder) / "probe"), f"-l{library}"],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return False, f"probe compile failed to run: {error}"
    if result.returncode == 0:
        return True, ""
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    return False, (lines[0].strip() if lines else f"{compiler} exited with {result.returncode}")


class AsyncIOBuilder(OpBuilder):
    """csrc/aio: the asynchronous file I/O handle (io_uring, libaio, a pread/pwrite pool).

    Which kernel interfaces are compiled in is decided here, from the headers and libraries found
    at build time; which one a handle uses is decided at load time (see ``csrc/aio/README.md``).
    """

    NAME = "aio"

    def engine_support(self) -> dict[str, tuple[bool, str]]:
        """Per engine: whether it will be compiled in, and if not, what is missing."""
        support = {}
        for engine, (header, library, call, package) in _OPTIONAL_ENGINES.items():
            ok, why = _links(header, library, call)
            support[engine] = (
                ok,
                "" if ok else f"{header}/-l{library} unusable ({why}); install {package}",
            )
        support["threads"] = (True, "")
        return support

    def compiled_engines(self) -> list[str]:
        return [engine for engine, (ok, _) in self.engine_support().items() if ok]

    def sources(self) -> list[str]:
        sources = [
            "aio/aio_handle_op.cpp",
            "aio/aio_handle.cpp",
            "aio/io_worker.cpp",
            "aio/file_request.cpp",
            "aio/engine_select.cpp",
            "aio/thread_pool_engine.cpp",
            "aio/locked_memory.cpp",
            "aio/os_error.cpp",
            "aio/errno_name.cpp",
        ]
        engines = self.compiled_engines()
        if "io_uring" in engines:
            sources.append("aio/io_uring_engine.cpp")
        if "libaio" in engines:
            sources.append("aio/libaio_engine.cpp")
        return sources

    def extra_cflags(self) -> list[str]:
        engines = self.compiled_engines()
        return super().extra_cflags() + [
            f"-DDS_AIO_HAVE_LIBURING={int('io_uring' in engines)}",
            f"-DDS_AIO_HAVE_LIBAIO={int('libaio' in engines)}",
        ]

    def extra_ldflags(self) -> list[str]:
        engines = self.compiled_engines()
        return (["-luring"] if "io_uring" in engines else []) + (
            ["-laio"] if "libaio" in engines else []
        )

    def is_compatible(self) -> tuple[bool, str]:
        if not sys.platform.startswith("linux"):
            return False, f"needs Linux (pread/pwrite, O_DIRECT), this is {sys.platform}"
        support = self.engine_support()
        compiled = ", ".join(engine for engine, (ok, _) in support.items() if ok)
        missing = "; ".join(f"{engine}: {why}" for engine, (ok, why) in support.items() if not ok)
        left_out = f" (left out: {missing})" if missing else ""
        return True, f"engines compiled in: {compiled}{left_out}"

    def load(self, verbose: bool = False):
        """Loads the library and returns ``deepspeed_cpp.ops.aio``, whose ``aio_handle`` is the
        handle class, as DeepSpeed's ``AsyncIOBuilder().load().aio_handle(...)`` expects."""
        super().load(verbose=verbose)
        return importlib.import_module("deepspeed_cpp.ops.aio")
