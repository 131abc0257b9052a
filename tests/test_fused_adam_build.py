"""Building the fused CUDA Adam without a GPU: the real nvcc build of a wheel with
DS_BUILD_FUSED_ADAM=1, the architectures inside the library (cuobjdump), loading the pre-built
library with no toolkit, driving FusedAdam's CUDA path on fake CUDA tensors, and the builder's
flags and reasons. The wheel build is the one nvcc build of the suite (about a minute here)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from fused_adam_wheel_build import built_wheel

from deepspeed_cpp.ops.op_builder import FusedAdamBuilder
from deepspeed_cpp.ops.op_builder.fused_adam import (
    DEFAULT_CUDA_ARCH_LIST,
    CudaArchListError,
    find_cuda_home,
    gencode_flags,
    parse_cuda_arch_list,
)


def find_cuobjdump() -> str:
    """cuobjdump from PATH, the toolkit, or the copy that torch's triton dependency ships."""
    candidates = [shutil.which("cuobjdump")]
    cuda_home, _ = find_cuda_home()
    if cuda_home is not None:
        candidates.append(str(cuda_home / "bin" / "cuobjdump"))
    try:
        import triton

        candidates.append(str(Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"))
    except ImportError:
        pass
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise AssertionError(f"cuobjdump not found (looked at {candidates}); install the CUDA toolkit")


def test_arch_list_parsing():
    assert parse_cuda_arch_list("8.0;9.0+PTX") == [("80", False), ("90", True)]
    assert parse_cuda_arch_list(" 7.5, 8.6 9.0a;8.6 ") == [("75", False), ("86", False),
                                                          ("90a", False)]  # fmt: skip
    assert parse_cuda_arch_list(DEFAULT_CUDA_ARCH_LIST) == [("80", False), ("90", True)]
    assert gencode_flags([("80", False), ("90", True)]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    with pytest.raises(CudaArchListError, match="entry 'Hopper' is not an architecture"):
        parse_cuda_arch_list("8.0;Hopper")
    with pytest.raises(CudaArchListError, match="names no architecture"):
        parse_cuda_arch_list(" ; ")


def test_flags_follow_torch_cuda_arch_list(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.delenv("NVCC_THREADS", raising=False)
    builder = FusedAdamBuilder()
    default = builder.extra_cuda_cflags()
    assert "--fmad=false" in default
    assert default[-3:] == gencode_flags(parse_cuda_arch_list("8.0;9.0+PTX"))
    digest = builder.source_digest()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert builder.extra_cuda_cflags()[-1] == "-gencode=arch=compute_86,code=sm_86"
    assert builder.source_digest() != digest
    monkeypatch.setenv("NVCC_THREADS", "2")
    assert "--threads=2" in builder.extra_cuda_cflags()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"TORCH_CUDA_ARCH_LIST": "8.0;sm_90"}, "entry 'sm_90' is not an architecture"),
        ({"TORCH_CUDA_ARCH_LIST": "5.0;8.0"}, "cannot build for architecture(s) 50"),
        ({"CUDA_HOME": "/nonexistent/cuda"}, "CUDA_HOME=/nonexistent/cuda is not a CUDA toolkit"),
    ],
)
def test_incompatible_says_why(monkeypatch, env, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    compatible, why = FusedAdamBuilder().is_compatible()
    assert not compatible
    assert message in why


def test_cpu_only_torch_is_incompatible(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    compatible, why = FusedAdamBuilder().is_compatible()
    assert not compatible and "CPU-only build" in why and "needs a CUDA build of torch" in why


def test_compatible_here_with_the_default_archs(monkeypatch):
    # This machine has nvcc and a CUDA build of torch: the op must be buildable (CI builds it).
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert FusedAdamBuilder().is_compatible() == (True, "")


_PREBUILT_SCRIPT = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from deepspeed_cpp.optim import FusedAdam
from deepspeed_cpp.ops.op_builder import FusedAdamBuilder

builder = FusedAdamBuilder()
assert builder.is_compatible() == (True, ""), builder.is_compatible()
builder.load()
assert "site" in str(builder.loaded_library()), builder.loaded_library()
assert torch._C._dispatch_has_kernel_for_dispatch_key("deepspeed_cpp::fused_adam", "CUDA")
print("LOADED", builder.loaded_library().name)

# No GPU here: the library loaded, but the op is not available, and says why; CPU tensors are
# refused by name rather than failing inside the dispatcher.
from deepspeed_cpp.ops.fused_adam import fused_adam, fused_adam_available
from deepspeed_cpp.ops.op_builder import OpNotAvailableError
available, why = fused_adam_available()
assert not available and "no CUDA device is visible" in why, why
p, g, m, v = (torch.zeros(5) for _ in range(4))
try:
    fused_adam([p], [g], [m], [v], step=1, lr=1e-3)
except OpNotAvailableError as error:
    assert "params[0] is on cpu; the op runs on CUDA tensors" in str(error), error
else:
    raise AssertionError("fused_adam ran on CPU tensors")
print("UNAVAILABLE WITHOUT GPU OK")

# FusedAdam's CUDA path on fake CUDA tensors (no GPU): every dtype, both step modes, and the
# GradScaler hand-over, through the op's schema and its meta implementation.
mode = FakeTensorMode(allow_non_fake_inputs=True)
shapes = [(5, 3), (7,), (1,)]
with mode:
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype))
              for dtype in (torch.float32, torch.bfloat16, torch.float16) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", dtype=p.dtype)
optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01)
optimizer.step()
optimizer.step()
assert all(float(optimizer.state[p]["step"]) == 2.0 for p in params)
assert all(optimizer.state[p]["exp_avg"].dtype == p.dtype for p in params)
with mode:
    # A real lr tensor: its range check reads the value, which a fake tensor does not have.
    capturable = FusedAdam(params, lr=torch.tensor(1e-3), capturable=True)
    capturable.grad_scale = torch.tensor(1024.0, device="cuda")
    capturable.found_inf = torch.tensor(0.0, device="cuda")
    capturable.step()
    assert all(capturable.state[p]["step"].device.type == "cuda" for p in params)
    # The meta implementation ran (and checks devices):
    p, m, v = (torch.zeros(4, device="cuda") for _ in range(3))
    try:
        fused_adam([p], [torch.zeros(4)], [m], [v], step=1, lr=1.0)
    except ValueError as error:
        assert "grads[0] is on cpu but params[0] is on cuda:0" in str(error), error
    else:
        raise AssertionError("the meta implementation did not check devices")
print("FAKE CUDA STEPS OK")
"""


def test_wheel_build_holds_each_architecture_and_loads_without_toolkit(tmp_path):
    # Built in the session's background when it got there first (tests/fused_adam_wheel_build.py).
    built = built_wheel(tmp_path / "build")
    assert built["returncode"] == 0, built["stdout"] + built["stderr"]
    (wheel,) = Path(built["wheels"]).glob("deepspeed_cpp-*.whl")
    archive = zipfile.ZipFile(wheel)
    libraries = [n for n in archive.namelist() if n.startswith("deepspeed_cpp/_ops/fused_adam.")]
    assert len(libraries) == 1 and libraries[0].endswith(".so"), archive.namelist()
    library = Path(archive.extract(libraries[0], tmp_path / "unpacked"))

    cuobjdump = find_cuobjdump()
    elf = subprocess.run([cuobjdump, "--list-elf", str(library)], capture_output=True, text=True)
    ptx = subprocess.run([cuobjdump, "--list-ptx", str(library)], capture_output=True, text=True)
    assert elf.returncode == 0 and ptx.returncode == 0, elf.stderr + ptx.stderr
    sass_archs = sorted(line.rsplit(".", 2)[-2] for line in elf.stdout.splitlines() if line)
    ptx_archs = sorted(line.rsplit(".", 2)[-2] for line in ptx.stdout.splitlines() if line)
    assert sass_archs == ["sm_80", "sm_90"], elf.stdout
    assert ptx_archs == ["sm_90"], ptx.stdout  # cuobjdump names compute_90's PTX "sm_90.ptx"

    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    no_toolkit = dict(os.environ, PYTHONPATH=str(site), CUDA_HOME=str(tmp_path / "no-toolkit"),
                      DS_CPP_EXTENSIONS_DIR=str(tmp_path / "empty-cache"))  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", _PREBUILT_SCRIPT], env=no_toolkit, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "LOADED fused_adam." in ran.stdout and "FAKE CUDA STEPS OK" in ran.stdout
    assert "UNAVAILABLE WITHOUT GPU OK" in ran.stdout
    assert "just in time" not in ran.stderr
    assert not (tmp_path / "empty-cache").exists()
