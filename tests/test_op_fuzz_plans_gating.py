"""Property-based fuzzing (hypothesis) of ZeRO's bucket planning and of the MoE gating op: each
example matches an independent reference, or raises a RuntimeError naming what was wrong; never
a crash, never a silent wrong answer.

- ``zero_plan_buckets`` over element counts from zero to the int64 limit, capacities, world
  sizes and alignments of any size: the plan equals a Python (unbounded integer) planner, or the
  op refuses what cannot be represented in int64 rather than wrapping round.
- ``moe_gating`` forward over token and expert counts, k, capacities, tied logits, noise and
  priorities holding NaN and infinities, against tests/moe_reference.py (DeepSpeed's gating with
  one-hot masks); backward against autograd through the same weights, and expert indices out of
  range refused by name.

Settings (examples per property, the "thorough" profile): tests/fuzz_settings.py.
"""

from __future__ import annotations

import math

import torch
from fuzz_settings import FUZZ  # skips the module without hypothesis
from hypothesis import given
from hypothesis import strategies as st
from moe_reference import reference_gating

INT64_MAX = 2**63 - 1

# --- zero_plan_buckets ----------------------------------------------------------------------------
SIZES = st.one_of(
    st.integers(0, 40),
    st.integers(2**31 - 3, 2**31 + 3),  # around int32's limit
    st.integers(2**40, 2**62),
    st.integers(INT64_MAX - 40, INT64_MAX),  # padding these overflows int64
)


def _reference_plan(numels, groups, capacity, world_size, alignment):
    """(param_bucket, param_offset, bucket_sizes) with Python's unbounded integers, or the reason
    the plan does not fit int64."""
    multiple = world_size * alignment
    if multiple > INT64_MAX:
        return "world_size * alignment"
    buckets, offsets, used, sizes, group_of = [], [], 0, [], []
    for numel, group in zip(numels, groups):
        if not group_of or group_of[-1] != group or used + numel > capacity:
            if group_of:
                sizes.append(used)
            group_of.append(group)
            used = 0
        buckets.append(len(group_of) - 1)
        offsets.append(used)
        used += numel
    if group_of:
        sizes.append(used)
    padded = [-(-max(size, 1) // multiple) * multiple for size in sizes]
    if any(size > INT64_MAX for size in padded):
        return "cannot be padded"
    return buckets, offsets, padded


@FUZZ
@given(
    st.lists(st.tuples(SIZES, st.integers(0, 2)), max_size=8),
    st.one_of(st.integers(1, 64), st.integers(2**31, INT64_MAX), st.integers(-2, 0)),
    st.one_of(st.integers(1, 9), st.integers(2**32, 2**62)),
    st.one_of(st.sampled_from([1, 2, 16]), st.integers(2**30, 2**40)),
)
def test_zero_plan_buckets_fuzz(params, capacity, world_size, alignment):
    from deepspeed_cpp.ops.zero import plan_buckets

    numels, groups = [n for n, _ in params], [g for _, g in params]
    expected = (
        "capacity, world_size and alignment must be >= 1"
        if capacity < 1
        else _reference_plan(numels, groups, capacity, world_size, alignment)
    )
    try:
        plan = plan_buckets(
            numels, groups, capacity=capacity, world_size=world_size, alignment=alignment
        )
    except RuntimeError as error:
        assert isinstance(expected, str), f"a valid plan was refused: {error}"
        assert expected in str(error), (expected, str(error))
        return
    assert not isinstance(expected, str), f"accepted although {expected!r} overflows: {plan}"
    buckets, offsets, sizes = expected
    assert (plan.param_bucket, plan.param_offset, plan.bucket_sizes) == (buckets, offsets, sizes)
    assert plan.bucket_groups == [groups[buckets.index(b)] for b in range(len(sizes))]


def test_zero_plan_buckets_names_bad_lists():
    from deepspeed_cpp.ops.zero import plan_buckets

    for numels, groups, named in (([3, -1], [0, 0], "numels[1] is negative"),
                                  ([3, 4], [0], "groups has 1")):  # fmt: skip
        try:
            plan_buckets(numels, groups, capacity=8, world_size=2)
        except RuntimeError as error:
            assert named in str(error), str(error)
        else:
            raise AssertionError(f"{numels}, {groups} accepted")


# --- moe_gating ---------------------------------------------------------------------------------
PRIORITIES = st.sampled_from([0.5, 0.25, 0.0, -0.0, 1.0, math.nan, math.inf, -math.inf])


@st.composite
def gating_case(draw):
    tokens, experts = draw(st.integers(0, 24)), draw(st.integers(1, 7))
    k = draw(st.sampled_from([1, 2, 2]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    if draw(st.booleans()):  # few distinct values: ties between experts
        logits = torch.randint(-2, 3, (tokens, experts), generator=generator).to(dtype)
    else:
        logits = torch.randn(tokens, experts, generator=generator, dtype=dtype) * 4
    if draw(st.booleans()) and tokens > 1:
        logits = logits.t().contiguous().t()  # a transposed (non-contiguous) layout
    noise = None
    if draw(st.booleans()):
        noise = torch.randn(tokens, experts, generator=generator, dtype=dtype)
    priority = None
    if k == 1 and draw(st.booleans()):
        priority = torch.tensor(draw(st.lists(PRIORITIES, min_size=tokens, max_size=tokens)),
                                dtype=dtype)  # fmt: skip
        if tokens:
            priority += torch.rand(tokens, generator=generator, dtype=dtype) * draw(
                st.sampled_from([0.0, 1.0])
            )  # all-distinct, or many ties
    capacity = draw(st.one_of(st.just(-1), st.integers(0, tokens + 1)))
    return logits, k, capacity, noise, priority


@FUZZ
@given(gating_case())
def test_moe_gating_forward_fuzz(drawn):
    from deepspeed_cpp.ops.moe import moe_gating

    logits, k, capacity, noise, priority = drawn
    if k > logits.shape[1]:
        try:
            moe_gating(logits, k, capacity, noise=noise, priority=priority)
        except RuntimeError as error:
            assert f"k={k} needs at least {k} experts" in str(error), str(error)
            return
        raise AssertionError(f"k={k} accepted with {logits.shape[1]} experts")
    got = moe_gating(logits, k, capacity, noise=noise, priority=priority)
    expert, position, kept, weight, slot_counts, _ = reference_gating(
        logits, k, capacity, noise=noise, priority=priority
    )
    assert torch.equal(got.expert, expert)
    assert torch.equal(got.kept, kept), (got.kept, kept, priority)
    assert torch.equal(got.position, position)
    assert torch.equal(got.slot_counts, slot_counts)
    if capacity >= 0:  # no expert holds more than its capacity, whatever the priorities
        for e in range(logits.shape[1]):
            assert int((got.expert[got.kept] == e).sum()) <= capacity
    torch.testing.assert_close(got.weight, weight, rtol=1e-6, atol=1e-7)


def _reference_logit_grad(grad_weight, logits, expert, kept):
    """d(sum(weight * grad_weight))/d(logits) by autograd through the combine weights."""
    x = logits.detach().clone().requires_grad_(True)
    prob = torch.softmax(x, dim=1).gather(1, expert)
    held = prob * kept.to(prob.dtype)
    if expert.shape[1] == 1:
        weight = held
    else:
        weight = held / held.sum(1, keepdim=True).clamp(min=torch.finfo(x.dtype).eps)
    (weight * grad_weight).sum().backward()
    return x.grad


@FUZZ
@given(gating_case(), st.sampled_from(["valid", "valid", "negative", "too_big", "huge"]))
def test_moe_gating_backward_fuzz(drawn, corruption):
    from deepspeed_cpp.ops.moe import load_moe

    load_moe()
    logits, k, capacity, noise, _ = drawn
    tokens, experts = logits.shape
    if k > experts:
        return
    generator = torch.Generator().manual_seed(tokens * 31 + experts)
    order = torch.rand(tokens, experts, generator=generator).argsort(1)[:, :k]  # distinct slots
    expert = order.contiguous()
    kept = torch.rand(tokens, k, generator=generator) < 0.7
    grad_weight = torch.randn(tokens, k, generator=generator, dtype=logits.dtype)
    if corruption != "valid" and tokens:
        bad = {"negative": -1, "too_big": experts, "huge": 2**40}[corruption]
        expert[tokens // 2, k - 1] = bad
        try:
            torch.ops.deepspeed_cpp.moe_gating_backward(grad_weight, logits, expert, kept)
        except RuntimeError as error:
            want = f"expert[{tokens // 2}][{k - 1}] is {bad}, not an expert index in [0, {experts})"
            assert want in str(error), str(error)
            return
        raise AssertionError(f"expert index {bad} accepted")
    got = torch.ops.deepspeed_cpp.moe_gating_backward(grad_weight, logits, expert, kept)
    want = _reference_logit_grad(grad_weight, logits, expert, kept)
    tolerance = 1e-5 if logits.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


@FUZZ
@given(st.integers(INT64_MAX - 64, INT64_MAX), st.integers(1, 9))
def test_zero_flatten_refuses_offsets_near_the_int64_limit(offset, numel):
    """``offset + numel`` wraps round past int64: the bounds check must not wrap with it."""
    from deepspeed_cpp.ops.zero import flatten_into, unflatten_from

    flat, tensor = torch.zeros(16), torch.ones(numel)
    for run in (lambda: flatten_into([tensor], flat, [offset]),
                lambda: unflatten_from(flat, [tensor], [offset])):  # fmt: skip
        try:
            run()
        except RuntimeError as error:
            assert f"at offset {offset}) does not fit in flat of 16" in str(error), str(error)
        else:
            raise AssertionError(f"offset {offset} accepted")
    assert torch.equal(flat, torch.zeros(16)) and torch.equal(tensor, torch.ones(numel))
