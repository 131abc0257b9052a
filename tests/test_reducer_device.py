"""Where the gradient reducer's buffers live, without a process group or a GPU.

csrc/zero/reducer_buffers.* makes every allocation and device decision of GradientReducer; the
test-only ReducerBuffers class exposes it. On `meta` nothing is computed, so these checks stand
in for an accelerator: a device the buffers are not on is as foreign as a GPU would be.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed_cpp.ops.zero import load_zero, plan_buckets

# Three buckets of 8, 104 and 8 elements (see test_zero_ops.py's hand-computed plan); bucket 0
# holds params 0 and 1 in 8 of its elements, bucket 2 holds params 3 (empty) and 4.
NUMELS = [5, 3, 100, 0, 7]
GROUPS = [0, 0, 0, 1, 1]


def make_buffers(device: str):
    load_zero()
    plan = plan_buckets(NUMELS, GROUPS, capacity=10, world_size=2, alignment=4)
    buffers = torch.classes.deepspeed_cpp.ReducerBuffers(
        plan.param_bucket, plan.param_offset, plan.param_numel, plan.bucket_sizes, device
    )
    return plan, buffers


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_buffers_are_float32_on_the_reducers_device_with_the_padded_size(device):
    plan, buffers = make_buffers(device)
    assert buffers.device() == device and buffers.buffer(1) is None
    grad = torch.randn(10, 10, device=device).bfloat16()
    assert buffers.add_grad(2, grad)  # allocates bucket 1's buffer
    buffer = buffers.buffer(1)
    assert buffer.device == torch.device(device)
    assert buffer.dtype == torch.float32 and buffer.shape == (plan.bucket_sizes[1],)
    assert buffers.complete(1)
    assert buffers.add_grad(0, torch.ones(5, device=device))
    assert not buffers.add_grad(1, torch.ones(3, device=device))  # the same bucket: no allocation
    if device == "cpu":
        torch.testing.assert_close(buffer[:100], grad.reshape(-1).float(), rtol=0, atol=0)
        assert (buffer[100:] == 0).all(), "the padding must be zeros"


@pytest.mark.parametrize("reducer_device, grad_device", [("meta", "cpu"), ("cpu", "meta")])
def test_a_gradient_on_another_device_is_refused(reducer_device, grad_device):
    _, buffers = make_buffers(reducer_device)
    with pytest.raises(
        RuntimeError,
        match=f"the gradient of param 4 is on {grad_device} but the reducer's buffers are on "
        f"{reducer_device}",
    ):
        buffers.add_grad(4, torch.ones(7, device=grad_device))
    # Refused before anything was allocated or marked arrived: the right gradient still goes in.
    assert buffers.buffer(2) is None
    buffers.add_grad(4, torch.ones(7, device=reducer_device))
    assert buffers.buffer(2).device == torch.device(reducer_device)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_buckets_without_gradients_are_zeros_on_the_reducers_device(device):
    plan, buffers = make_buffers(device)
    buffers.add_grad(0, torch.full((5,), 3.0, device=device))
    assert not buffers.complete(0)
    assert not buffers.fill_missing(0)  # partly filled: param 1's slice is zeroed in place
    assert buffers.fill_missing(1) and buffers.fill_missing(2)  # nothing arrived: allocated
    for bucket, size in enumerate(plan.bucket_sizes):
        buffer = buffers.buffer(bucket)
        assert buffers.complete(bucket)
        assert buffer.device == torch.device(device)
        assert buffer.dtype == torch.float32 and buffer.shape == (size,)
        if device == "cpu":
            want = torch.zeros(size)
            if bucket == 0:
                want[:5] = 3.0
            assert torch.equal(buffer, want)
    buffers.reset()
    assert all(buffers.buffer(b) is None for b in range(3)) and not buffers.complete(0)
    buffers.add_grad(0, torch.ones(5, device=device))  # a new step takes param 0 again


def test_destinations_must_be_on_the_reducers_device():
    _, buffers = make_buffers("meta")
    buffers.check_destination(1, torch.zeros(52, device="meta"), 52)
    with pytest.raises(
        RuntimeError,
        match="destination 1 is on cpu but the reducer's buffers are on meta; reduced buckets "
        "are not copied between devices",
    ):
        buffers.check_destination(1, torch.zeros(52), 52)
    with pytest.raises(RuntimeError, match="must be a contiguous 1-D float32 tensor of 52"):
        buffers.check_destination(1, torch.zeros(52, dtype=torch.float64, device="meta"), 52)


def test_device_strings_parse_without_an_accelerator():
    # An explicit CUDA index needs no GPU: nothing is allocated until a gradient arrives.
    assert make_buffers("cuda:0")[1].device() == "cuda:0"
    assert make_buffers("cuda:1")[1].device() == "cuda:1"
    # CPU tensors carry no index, so "cpu:0" is the plain CPU they compare equal to.
    assert make_buffers("cpu:0")[1].device() == "cpu"
    with pytest.raises(RuntimeError, match="cannot parse device 'gpu'"):
        make_buffers("gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_buffers_and_a_bare_cuda_device():
    plan, buffers = make_buffers("cuda")
    assert buffers.device() == f"cuda:{torch.cuda.current_device()}"
    with pytest.raises(RuntimeError, match="the gradient of param 2 is on cpu"):
        buffers.add_grad(2, torch.ones(100))
    grad = torch.randn(100, device="cuda").half()
    assert buffers.add_grad(2, grad)
    buffer = buffers.buffer(1)
    assert buffer.device == torch.device(buffers.device()) and buffer.dtype == torch.float32
    assert torch.equal(buffer[:100], grad.float()) and (buffer[100:] == 0).all()
    assert buffers.fill_missing(2) and buffers.buffer(2).is_cuda
    assert not buffers.buffer(2).any()
