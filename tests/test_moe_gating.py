"""csrc/moe's gating op against the plain-torch reference (tests/moe_reference.py): top-1 and
top-2 routing, capacity overflow, ties, min_capacity, random token selection, noisy choices, no
drop; gradients by gradcheck in float64; opcheck; bad input named."""

import pytest
import torch
from moe_reference import capacity_for, gumbel, reference_gating

from deepspeed_cpp.ops.moe import load_moe, moe_gating


@pytest.fixture(scope="module", autouse=True)
def _loaded():
    load_moe()


def check_against_reference(logits, k, capacity, noise=None, priority=None):
    ours = moe_gating(logits, k, capacity, noise=noise, priority=priority)
    expert, position, kept, weight, slot_counts, _ = reference_gating(
        logits, k, capacity, noise, priority
    )
    assert torch.equal(ours.expert, expert)
    assert torch.equal(ours.kept, kept)
    assert torch.equal(ours.position, position)
    assert torch.equal(ours.slot_counts, slot_counts)
    tolerance = 1e-15 if logits.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(ours.weight, weight, rtol=tolerance, atol=tolerance)
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("tokens, experts", [(1, 1), (37, 5), (203, 7), (1031, 3)])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.7])
def test_matches_reference(dtype, k, tokens, experts, capacity_factor):
    if experts < k:
        pytest.skip("top-2 needs two experts")
    logits = torch.randn(tokens, experts, dtype=dtype) * 3
    capacity = capacity_for(tokens, experts, capacity_factor, 0, k)
    ours = check_against_reference(logits, k, capacity)
    if capacity_factor == 0.5 and tokens > experts:
        assert not ours.kept.all()  # the overflow case really drops tokens
    assert (ours.position < capacity).all()


@pytest.mark.parametrize("k", [1, 2])
def test_noise_chooses_the_last_slot_only(k):
    # top-1 RSample: the noisy argmax chooses, the clean softmax weighs; top-2: the noise picks
    # the second expert (DeepSpeed's top2_2nd_expert_sampling).
    generator = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    logits = torch.randn(301, 6)
    noise = gumbel(logits.shape, generator)
    ours = check_against_reference(logits, k, capacity_for(301, 6, 1.0, 4, k), noise=noise)
    clean = moe_gating(logits, k, -1)
    assert not torch.equal(ours.expert[:, k - 1], clean.expert[:, k - 1])
    if k == 2:
        assert torch.equal(ours.expert[:, 0], clean.expert[:, 0])


@pytest.mark.parametrize("capacity", [0, 3, 40, -1])
def test_random_token_selection_keeps_the_highest_priorities(capacity):
    generator = torch.Generator().manual_seed(int(torch.randint(2**31, ())))
    logits = torch.randn(157, 4)
    priority = torch.rand(157, generator=generator)
    ours = check_against_reference(logits, 1, capacity, priority=priority)
    for e in range(4):
        mine = ours.expert[:, 0] == e
        if capacity >= 0 and mine.sum() > capacity:
            kept = ours.kept[:, 0] & mine
            dropped = ~ours.kept[:, 0] & mine
            assert kept.sum() == capacity
            if capacity > 0:
                assert priority[kept].min() > priority[dropped].max()


def test_equal_priorities_go_to_the_lower_token():
    logits = torch.zeros(9, 2)
    logits[:, 1] = 1.0
    priority = torch.tensor([0.5, 0.9, 0.5, 0.5, 0.9, 0.1, 0.5, 0.5, 0.5])
    ours = moe_gating(logits, 1, 4, priority=priority)
    assert ours.kept[:, 0].tolist() == [True, True, True, False, True, False, False, False, False]
    assert ours.position[:, 0].tolist() == [0, 1, 2, -1, 3, -1, -1, -1, -1]


def test_ties_go_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 5.0]])
    top1 = moe_gating(logits, 1, -1)
    assert top1.expert[:, 0].tolist() == [1, 0, 1]
    top2 = moe_gating(logits, 2, -1)
    assert top2.expert.tolist() == [[1, 2], [0, 1], [1, 3]]
    check_against_reference(logits, 2, -1)
    torch.testing.assert_close(top2.weight[1], torch.tensor([0.5, 0.5]))


def test_min_capacity_and_second_slot_offsets():
    # 10 tokens over 5 experts at factor 0.2 would give capacity 1 (top-1); min_capacity makes
    # it 4. Every token prefers expert 0: four kept, in token order.
    assert capacity_for(10, 5, 0.2, 4, 1) == 4 and capacity_for(10, 5, 0.2, 0, 1) == 1
    assert capacity_for(10, 5, 0.2, 0, 2) == 1 and capacity_for(11, 5, 1.0, 0, 2) == 5
    logits = torch.linspace(1, 0, 5).repeat(10, 1)
    ours = check_against_reference(logits, 1, capacity_for(10, 5, 0.2, 4, 1))
    assert ours.kept[:, 0].tolist() == [True] * 4 + [False] * 6
    # top-2: expert 1's second-choice slots start after its (pre-drop) first-choice count, 0 here.
    top2 = check_against_reference(logits, 2, 6)
    assert top2.position[:, 1].tolist() == [0, 1, 2, 3, 4, 5, -1, -1, -1, -1]
    assert top2.slot_counts.tolist() == [[10, 0, 0, 0, 0], [0, 10, 0, 0, 0]]


@pytest.mark.parametrize("k", [1, 2])
def test_no_drop_keeps_every_token(k):
    logits = torch.randn(211, 5)
    ours = check_against_reference(logits, k, -1)
    assert ours.kept.all()
    counts = ours.slot_counts.sum(0)
    assert int(ours.position.max()) == int(counts.max()) - 1


def test_empty_batch():
    ours = moe_gating(torch.randn(0, 3), 2, 4)
    assert ours.expert.shape == (0, 2) and ours.slot_counts.tolist() == [[0, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity", [2, 9, -1])
def test_gradcheck(k, capacity):
    logits = torch.randn(23, 5, dtype=torch.float64, requires_grad=True)
    weights = lambda x: moe_gating(x, k, capacity).weight  # noqa: E731
    assert torch.autograd.gradcheck(weights, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)
    # The op's gradient equals autograd through the reference.
    grad = torch.randn(23, k, dtype=torch.float64)
    (ours,) = torch.autograd.grad(weights(logits), logits, grad)
    (theirs,) = torch.autograd.grad(reference_gating(logits, k, capacity)[3], logits, grad)
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-15)


def test_gradcheck_with_noise_and_priority():
    logits = torch.randn(19, 4, dtype=torch.float64, requires_grad=True)
    noise = torch.randn(19, 4, dtype=torch.float64)
    priority = torch.rand(19)
    for k, extra in ((1, {"noise": noise, "priority": priority}), (2, {"noise": noise})):
        weights = lambda x: moe_gating(x, k, 4, **extra).weight  # noqa: E731, B023
        assert torch.autograd.gradcheck(weights, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_top2_denominator_clamp_gradient():
    # Probabilities below float64's epsilon: the clamped denominator is a constant.
    logits = torch.tensor([[0.0, -80.0, -80.0], [-80.0, 0.0, -80.0]], dtype=torch.float64)
    logits.requires_grad_(True)
    ours = moe_gating(logits, 2, 1)
    assert ours.kept.tolist() == [[True, False], [True, False]]
    weights = lambda x: moe_gating(x, 2, 1).weight  # noqa: E731
    assert torch.autograd.gradcheck(weights, (logits,), eps=1e-7, atol=1e-8, rtol=1e-6)


def sample_inputs():
    yield (torch.randn(13, 3), 1, 5, None, None)
    yield (torch.randn(13, 3, dtype=torch.float64, requires_grad=True), 2, 4, None, None)
    yield (torch.randn(13, 3, requires_grad=True), 2, -1, torch.randn(13, 3), None)
    yield (torch.randn(13, 3, requires_grad=True), 1, 3, torch.randn(13, 3), torch.rand(13))


@pytest.mark.parametrize("index", range(4))
def test_opcheck(index):
    args = list(sample_inputs())[index]
    torch.library.opcheck(torch.ops.deepspeed_cpp.moe_gating.default, args)
    out = moe_gating(*args[:3], noise=args[3], priority=args[4])
    torch.library.opcheck(
        torch.ops.deepspeed_cpp.moe_gating_backward.default,
        (torch.randn_like(out.weight), args[0].detach(), out.expert, out.kept),
    )


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((torch.randn(5), 1, 3), {}, r"logits must be 2-D \[tokens, experts\], got shape \[5\]"),
        ((torch.randn(5, 2, dtype=torch.float16), 1, 3), {}, "must be float32 or float64"),
        ((torch.randn(5, 3), 3, 3), {}, "k must be 1 or 2, got 3"),
        ((torch.randn(5, 1), 2, 3), {}, "k=2 needs at least 2 experts"),
        ((torch.randn(5, 3), 1, 3), {"noise": torch.randn(5, 2)}, "noise must have the logits"),
        ((torch.randn(5, 3), 2, 3), {"priority": torch.rand(5)}, "for k=1 only"),
        ((torch.randn(5, 3), 1, 3), {"priority": torch.rand(4)}, "one value per token"),
    ],
)
def test_bad_input_is_named(args, kwargs, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.deepspeed_cpp.moe_gating.default(
            *args, kwargs.get("noise"), kwargs.get("priority")
        )
