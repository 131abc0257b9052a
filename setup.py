"""Build script: packages deepspeed_cpp and pre-builds the native ops that DS_BUILD_* ask for.

Nothing is compiled by default; ops then compile just in time on first use. Flags (1 or 0):

  DS_BUILD_OPS=1         pre-build every op that can be built on this machine
  DS_BUILD_<OP>=1        pre-build that op, failing the install if it cannot be built here
  DS_BUILD_<OP>=0        never pre-build that op (overrides DS_BUILD_OPS=1)

DeepSpeed's flags for ops that have no library of their own here (DS_BUILD_UTILS, ...) print
one line saying what stands in for them; any other unknown DS_BUILD_* stops the build, naming
the nearest known flag. MAX_JOBS (parallel compile jobs; from ``build_ext -jN`` when unset, else
derived from cores and free memory), TORCH_CUDA_ARCH_LIST and CUDA_HOME are honoured. No GPU is
needed to build.
"""

import difflib
import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent.resolve()


def load_op_builder():
    """Imports deepspeed_cpp/ops/op_builder on its own, without the rest of the package."""
    package_dir = ROOT / "deepspeed_cpp" / "ops" / "op_builder"
    spec = importlib.util.spec_from_file_location(
        "_deepspeed_cpp_op_builder",
        package_dir / "__init__.py",
        submodule_search_locations=[str(package_dir)],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def read_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise SystemExit(f"deepspeed_cpp setup: {name}={value!r} is not valid; use 1 or 0")
    return value == "1"


# DeepSpeed's DS_BUILD_* flags for ops deepspeed_cpp does not build as such: what stands in for
# each (scripts and Dockerfiles written for DeepSpeed set them; failing their build helps no one).
DEEPSPEED_ONLY_FLAGS = {
    "UTILS": "flatten/unflatten are part of the zero op (DS_BUILD_ZERO)",
    "FUSED_LAMB": "no fused LAMB op; use Adam/AdamW (DS_BUILD_FUSED_ADAM, DS_BUILD_CPU_ADAM)",
    "FUSED_LION": "no fused CUDA Lion op; CPU Lion is DS_BUILD_CPU_LION",
    "SPARSE_ATTN": "no sparse-attention kernels (training engine only)",
    "TRANSFORMER": "no transformer-layer kernels (training engine only)",
    "STOCHASTIC_TRANSFORMER": "no transformer-layer kernels (training engine only)",
    "TRANSFORMER_INFERENCE": "no inference kernels (training engine only)",
    "INFERENCE_CORE_OPS": "no inference kernels (training engine only)",
    "CUTLASS_OPS": "no inference kernels (training engine only)",
    "RAGGED_OPS": "no inference kernels (training engine only)",
    "RAGGED_DEVICE_OPS": "no inference kernels (training engine only)",
    "SPATIAL_INFERENCE": "no inference kernels (training engine only)",
    "EVOFORMER_ATTN": "no Evoformer attention kernels",
    "QUANTIZER": "no quantization kernels",
    "FP_QUANTIZER": "no quantization kernels",
    "RANDOM_LTD": "no random-LTD kernels",
    "DEEP_COMPILE": "no DeepCompile passes",
    "GDS": "no GPUDirect Storage; NVMe offload uses the aio op (DS_BUILD_AIO)",
    "CCL_COMM": "collectives go through torch.distributed (gloo, nccl)",
    "SHM_COMM": "collectives go through torch.distributed (gloo, nccl)",
    "PIN_MEMORY": "page-locked buffers come from torch; nothing to build",
    "STRING": "the version is deepspeed_cpp.__version__ (+torch<version> with pre-built ops)",
}


def check_flag_names(op_builder) -> None:
    """Says what a DeepSpeed-only flag means here; stops on a misspelt or unknown one."""
    known = {"OPS", *(name.upper() for name in op_builder.ALL_OPS)}
    for variable in sorted(os.environ):
        if not variable.startswith("DS_BUILD_"):
            continue
        name = variable[len("DS_BUILD_") :]
        if name in known:
            continue
        if name in DEEPSPEED_ONLY_FLAGS:
            print(f"deepspeed_cpp setup: {variable} ignored: {DEEPSPEED_ONLY_FLAGS[name]}")
            continue
        candidates = sorted(known | DEEPSPEED_ONLY_FLAGS.keys())
        nearest = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
        hint = f"did you mean DS_BUILD_{nearest[0]}? " if nearest else ""
        raise SystemExit(
            f"deepspeed_cpp setup: unknown flag {variable}; {hint}known op flags: "
            + ", ".join(f"DS_BUILD_{n}" for n in sorted(known))
        )


def ops_to_prebuild(op_builder) -> list:
    check_flag_names(op_builder)
    build_all = read_flag("DS_BUILD_OPS") or False
    chosen = []
    for name, builder_class in op_builder.ALL_OPS.items():
        flag = f"DS_BUILD_{name.upper()}"
        explicit = read_flag(flag)
        if explicit is False or (explicit is None and not build_all):
            continue
        builder = builder_class()
        compatible, why = builder.is_compatible()
        if not compatible:
            if explicit:
                raise SystemExit(
                    f"deepspeed_cpp setup: {flag}=1 asks to pre-build op '{name}', but it cannot "
                    f"be built on this machine: {why}"
                )
            print(f"deepspeed_cpp setup: skipping op '{name}' (DS_BUILD_OPS=1): {why}")
            continue
        chosen.append(builder)
    if chosen:
        chosen.insert(0, op_builder.RegistryBuilder())
    return chosen


def extension_for(builder):
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    # A family with .cu sources is compiled by nvcc with the builder's flags (architectures
    # included); prepare_build() first points torch at the CUDA toolkit the builder found.
    builder.prepare_build()
    extension_class = CUDAExtension if builder.is_cuda() else CppExtension
    compile_args = {"cxx": builder.extra_cflags()}
    if builder.is_cuda():
        compile_args["nvcc"] = builder.extra_cuda_cflags()
    return extension_class(
        name=f"deepspeed_cpp._ops.{builder.NAME}",
        # A stable-ABI library touches neither Python's C API nor torch's C++ ABI: named
        # <op>.abi3.so, it is the same file for every Python 3 and every torch it targets.
        py_limited_api=builder.STABLE_ABI,
        sources=[f"csrc/{source}" for source in builder.sources()],
        include_dirs=[
            str(ROOT / "csrc"),
            *(str(ROOT / "csrc" / d) for d in builder.include_dirs()),
        ],
        extra_compile_args=compile_args,
        extra_link_args=builder.extra_ldflags(),
    )


class BuildPyWithSources(build_py):
    """Ships csrc/ inside the package so that JIT builds work from a non-editable install."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "deepspeed_cpp" / "csrc"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / "csrc", target, ignore=shutil.ignore_patterns("*.o", "*.so"))


def package_version() -> str:
    """deepspeed_cpp.__version__, read from the source (importing the package needs torch)."""
    text = (ROOT / "deepspeed_cpp" / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.MULTILINE).group(1)


# The oldest Python an abi3 wheel names (cp311-abi3): the libraries use no Python API at all, so
# the bound is the oldest Python the wheel was tested on, or the building one when older.
ABI3_PYTHON = (3, 11)


def abi3_python_tag() -> str:
    major, minor = min(ABI3_PYTHON, tuple(sys.version_info[:2]))
    return f"cp{major}{minor}"


def setup_kwargs() -> dict:
    op_builder = load_op_builder()
    builders = ops_to_prebuild(op_builder)
    kwargs = {"version": package_version(), "cmdclass": {"build_py": BuildPyWithSources}}
    if not builders:
        return kwargs
    # Pre-built ops load only under the torch they were compiled against: the wheel's local
    # version says which (pip shows it; the loader checks build_info.json). A wheel of stable-ABI
    # libraries only serves every torch from the targeted one on, and every Python 3 from
    # ABI3_PYTHON on: its version and tags say that instead.
    stable = [b.NAME for b in builders if b.STABLE_ABI]
    min_torch = op_builder.builder.STABLE_ABI_MIN_TORCH
    if len(stable) == len(builders):
        local = op_builder.build_info.stable_abi_local_version(min_torch)
        kwargs["options"] = {"bdist_wheel": {"py_limited_api": abi3_python_tag()}}
    else:
        local = op_builder.build_info.wheel_local_version(
            op_builder.build_info.current_build_info()
        )
    kwargs["version"] += f"+{local}"
    from torch.utils.cpp_extension import BuildExtension

    print("deepspeed_cpp setup: pre-building ops:", ", ".join(b.NAME for b in builders))

    class BuildExtensionWithInfo(BuildExtension):
        """Records the torch the ops were built against; the loader ignores them for another.

        Extensions are built one after the other, each compiling its objects in parallel:
        torch's ninja build writes one ``build.ninja`` into the shared build folder, so two
        extensions built at once (setuptools' ``-jN``) overwrite each other's and link objects
        that were never compiled for them. ``-jN`` therefore becomes MAX_JOBS=N."""

        def finalize_options(self):
            super().finalize_options()
            if self.parallel and "MAX_JOBS" not in os.environ:
                jobs = os.cpu_count() if self.parallel is True else int(self.parallel)
                os.environ["MAX_JOBS"] = str(jobs)
            self.parallel = None
            os.environ.setdefault("MAX_JOBS", str(op_builder.builder.default_max_jobs()))

        def run(self):
            super().run()
            ops_dir = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
            info = {
                **op_builder.build_info.current_build_info(),
                "ops": [b.NAME for b in builders],
                "stable_abi_ops": stable,
                "stable_abi_min_torch": "{}.{}".format(*min_torch),
            }
            (ops_dir / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")

    kwargs["ext_modules"] = [extension_for(b) for b in builders]
    kwargs["cmdclass"]["build_ext"] = BuildExtensionWithInfo.with_options(use_ninja=True)
    return kwargs


setup(**setup_kwargs())
