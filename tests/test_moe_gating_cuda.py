"""The MoE gating op's CUDA kernel: built with nvcc on any machine (no GPU needed) and registered
for CUDA tensors, run through its fake implementation on fake CUDA tensors; on a machine with a
GPU, equal to the CPU kernel (the same per-token body, csrc/moe/gating_token.h): the same experts,
slots and kept tokens, and weights within a few units in the last place (CUDA's exp is not
glibc's: both are within 1 ulp of the exact value, not always the same one)."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT
from prebuild_ops import MOE_CUDA_ARCH_LIST

_BUILD_SCRIPT = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from deepspeed_cpp.ops.op_builder import MoECudaBuilder
from deepspeed_cpp.ops.moe import load_moe, moe_gating

builder = MoECudaBuilder()
assert builder.is_compatible() == (True, ""), builder.is_compatible()
load_moe("cuda")
for op in ("moe_gating", "moe_gating_backward"):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"deepspeed_cpp::{op}", "CUDA"), op
with FakeTensorMode():
    # (no backward() here: the autograd engine needs a real device for its streams)
    logits = torch.randn(11, 5, device="cuda")
    out = moe_gating(logits, 2, 4, noise=torch.randn(11, 5, device="cuda"))
    assert out.weight.device.type == "cuda" and out.expert.shape == (11, 2)
    grad = torch.ops.deepspeed_cpp.moe_gating_backward.default(out.weight, logits, out.expert,
                                                               out.kept)
    assert grad.shape == (11, 5) and grad.device.type == "cuda"
print("CUDA GATING BUILT")
"""


def test_cuda_kernel_builds_and_registers():
    # One architecture keeps the nvcc build short; the kernel is architecture-independent code.
    # (tests/prebuild_ops.py builds the same in the session's background: then this loads it.)
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST=MOE_CUDA_ARCH_LIST, PYTHONPATH=str(REPO_ROOT))
    ran = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "CUDA GATING BUILT" in ran.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("k", [1, 2])
def test_cuda_equals_cpu(k):
    from deepspeed_cpp.ops.moe import moe_gating

    logits = torch.randn(4099, 7, dtype=torch.float64) * 2
    noise = torch.randn_like(logits)
    priority = torch.rand(4099) if k == 1 else None
    for capacity in (300, -1):
        cpu = moe_gating(logits, k, capacity, noise=noise, priority=priority)
        gpu = moe_gating(logits.cuda(), k, capacity, noise=noise.cuda(),
                         priority=None if priority is None else priority.cuda())  # fmt: skip
        for field, ours, theirs in zip(cpu._fields, gpu, cpu):
            if theirs.is_floating_point():  # seen on an H200: 1 ulp where glibc's exp differs
                torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-15, atol=1e-15, msg=field)
            else:
                assert torch.equal(ours.cpu(), theirs), field
        grad = torch.randn(4099, k, dtype=torch.float64)
        backward = torch.ops.deepspeed_cpp.moe_gating_backward.default
        back = [backward(grad.to(d), logits.to(d), out.expert, out.kept)
                for d, out in (("cpu", cpu), ("cuda", gpu))]  # fmt: skip
        # atol: gradients that cancel to ~0 keep the ulps of the O(1) terms they came from.
        torch.testing.assert_close(back[1].cpu(), back[0], rtol=1e-14, atol=1e-15)
