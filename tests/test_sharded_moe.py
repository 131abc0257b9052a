"""``deepspeed.moe.sharded_moe`` (DeepSpeed's gating functions, dense and sparse results,
TopKGate, MOELayer) against plain-torch references written from DeepSpeed's semantics
(tests/moe_reference.py for top-1/top-2, a per-expert loop here for top-k)."""

import pytest
import torch
import torch.nn.functional as F
from moe_reference import capacity_for, reference_gating

import deepspeed_cpp.moe.sharded_moe as sharded_moe
from deepspeed_cpp.moe.sharded_moe import (
    MOELayer,
    TopKGate,
    _route_slots,
    _sparse_decode,
    _sparse_encode,
    top1gating,
    top2gating,
    topkgating,
)


def dense_from(expert, position, kept, weight, experts, capacity):
    tokens, k = expert.shape
    combine = torch.zeros(tokens, experts, capacity, dtype=weight.dtype)
    for t in range(tokens):
        for s in range(k):
            if kept[t, s]:
                combine[t, expert[t, s], position[t, s]] += weight[t, s]
    return combine


def reference_topk(logits, k, capacity, policy):
    """DeepSpeed's topkgating, one expert at a time: an expert over capacity keeps the tokens
    that gave it the highest probability ('probs') or its first ones ('position')."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    chosen = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        chosen[t, torch.topk(gates[t], k).indices] = True
    kept = torch.zeros_like(chosen)
    for e in range(experts):
        mine = [t for t in range(tokens) if chosen[t, e]]
        if capacity >= 0 and policy == "probs":
            mine = sorted(mine, key=lambda t: -float(gates[t, e]))[: min(capacity, tokens)]
        elif capacity >= 0:
            mine = mine[:capacity]
        kept[mine, e] = True
    width = capacity if capacity >= 0 else int(chosen.sum(0).max())
    combine = torch.zeros(tokens, experts, width, dtype=logits.dtype)
    for e in range(experts):
        for location, t in enumerate(torch.nonzero(kept[:, e]).flatten().tolist()):
            combine[t, e, location] = gates[t, e] / (gates[t] * kept[t]).sum()
    me, ce = gates.mean(0), chosen.to(logits.dtype).mean(0)
    return combine, chosen.sum(0), torch.mean(me * ce) * experts * experts / k


@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("k", [1, 2])
def test_top1_top2_dense_and_sparse_match_reference(k, drop_tokens):
    tokens, experts, factor = 29, 5, 0.8
    logits = torch.randn(tokens, experts, dtype=torch.float64) * 2
    if k == 1:
        result = top1gating(logits, factor, 0, drop_tokens=drop_tokens, use_rts=False)
        sparse = top1gating(
            logits, factor, 0, drop_tokens=drop_tokens, use_rts=False, sparse_routes=True
        )
    else:
        result = top2gating(
            logits, factor, 0, drop_tokens=drop_tokens, top2_2nd_expert_sampling=False
        )
        sparse = top2gating(
            logits,
            factor,
            0,
            drop_tokens=drop_tokens,
            top2_2nd_expert_sampling=False,
            sparse_routes=True,
        )
    capacity = capacity_for(tokens, experts, factor, 0, k) if drop_tokens else -1
    expert, position, kept, weight, slot_counts, l_aux = reference_gating(logits, k, capacity)
    if not drop_tokens:
        capacity = int(slot_counts.sum(0).max())
    l_aux_ours, combine, dispatch, exp_counts = result
    expected = dense_from(expert, position, kept, weight, experts, capacity)
    torch.testing.assert_close(combine, expected, rtol=1e-15, atol=1e-15)
    assert torch.equal(dispatch, expected.bool())
    assert torch.equal(exp_counts, slot_counts.sum(0))
    torch.testing.assert_close(l_aux_ours, l_aux, rtol=1e-14, atol=0)
    # The sparse routes: [k, tokens] indices (-1 dropped), locations, gates; same dispatch.
    _, sparse_capacity, num_experts, indices, locations, gates, _ = sparse
    assert (int(sparse_capacity), num_experts) == (capacity, experts)
    assert indices.shape == (k, tokens) and indices.dtype == torch.int32
    assert torch.equal(indices.t().long(), torch.where(kept, expert, -1))
    hidden = torch.randn(tokens, 6, dtype=torch.float64)
    slots = _route_slots(indices, locations, experts, capacity)
    encoded = _sparse_encode(hidden, slots, experts, capacity)
    torch.testing.assert_close(
        encoded, torch.einsum("sec,sm->ecm", expected.bool().double(), hidden)
    )
    expert_output = torch.randn_like(encoded)
    decoded = _sparse_decode(expert_output.view(-1, 6), slots, gates, tokens)
    torch.testing.assert_close(decoded, torch.einsum("sec,ecm->sm", expected, expert_output))


def test_top1_random_token_selection_uses_the_draw_it_is_given():
    tokens, experts = 40, 3
    logits = torch.randn(tokens, experts, dtype=torch.float64)
    torch.manual_seed(1234)
    _, combine, _, _ = top1gating(logits, 0.5, 0, use_rts=True)
    torch.manual_seed(1234)
    priority = torch.rand(tokens)
    capacity = capacity_for(tokens, experts, 0.5, 0, 1)
    expert, position, kept, weight, _, _ = reference_gating(logits, 1, capacity, None, priority)
    torch.testing.assert_close(
        combine, dense_from(expert, position, kept, weight, experts, capacity)
    )


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("k, drop_tokens", [(3, True), (2, True), (3, False)])
def test_topk_matches_reference(k, drop_tokens, policy):
    tokens, experts, factor = 23, 6, 0.7
    logits = torch.randn(tokens, experts, dtype=torch.float64)
    l_aux, combine, dispatch, exp_counts = topkgating(
        logits, k, factor, 0, drop_tokens=drop_tokens, drop_policy=policy
    )
    capacity = capacity_for(tokens, experts, factor, 0, k) if drop_tokens else -1
    expected, counts, expected_l_aux = reference_topk(logits, k, capacity, policy)
    torch.testing.assert_close(combine, expected, rtol=1e-15, atol=1e-15)
    assert torch.equal(dispatch, expected.bool())
    assert torch.equal(exp_counts, counts)
    torch.testing.assert_close(l_aux, expected_l_aux, rtol=1e-14, atol=0)
    sparse = topkgating(
        logits, k, factor, 0, drop_tokens=drop_tokens, drop_policy=policy, sparse_routes=True
    )
    slots = _route_slots(sparse[3], sparse[4], experts, int(sparse[1]))
    expert_output = torch.randn(experts * int(sparse[1]), 4, dtype=torch.float64)
    decoded = _sparse_decode(expert_output, slots, sparse[5], tokens)
    torch.testing.assert_close(
        decoded, torch.einsum("sec,ecm->sm", expected, expert_output.view(experts, -1, 4))
    )


def test_capacity_above_tokens_and_min_capacity_size_the_buffer():
    logits = torch.randn(8, 2)
    assert top1gating(logits, 4.0, 0, use_rts=False)[2].shape == (8, 2, 16)
    assert topkgating(logits, 1, 1.0, 8, drop_policy="position")[2].shape == (8, 2, 8)
    dispatch = topkgating(logits, 2, 2.0, 0, drop_policy="probs")[2]
    assert dispatch.shape[-1] == 16 and int(dispatch.sum()) == 16


def test_bad_arguments_are_named():
    logits = torch.randn(4, 3)
    with pytest.raises(ValueError, match="drop_policy='first'"):
        topkgating(logits, 2, 1.0, 0, drop_policy="first")
    with pytest.raises(ValueError, match="k=4 must be in 1..3"):
        topkgating(logits, 4, 1.0, 0)
    with pytest.raises(ValueError, match="fewer than min_capacity=8"):
        top1gating(logits, 1.0, 8)
    with pytest.raises(ValueError, match=r"shape \(12,\)"):
        top2gating(logits.flatten(), 1.0, 0)


def test_no_ep_group_runs_no_collective(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective without an ep_group")

    monkeypatch.setattr(sharded_moe.dist, "get_world_size", refuse)
    monkeypatch.setattr(sharded_moe.dist, "all_reduce", refuse)
    top2gating(torch.randn(8, 4), 1.0, 0, drop_tokens=False, top2_2nd_expert_sampling=False)


def test_gate_returns_deepspeeds_tuple_and_moe_layer_routes_the_same():
    torch.manual_seed(7)
    gate = TopKGate(6, 4, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    tokens = torch.randn(10, 6)
    l_aux, combine, dispatch, exp_counts = gate(tokens)
    logits = tokens @ gate.wg.weight.t()
    expected = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    torch.testing.assert_close(combine, expected[1])
    torch.testing.assert_close(l_aux, expected[0])
    from deepspeed_cpp.moe.experts import Experts

    experts = Experts(torch.nn.Linear(6, 6), 4, "ep_size_1")
    layer = MOELayer(gate, experts, "ep_size_1", 1, 4, use_tutel=False)
    out = layer(tokens.unsqueeze(0))
    outputs = torch.stack([e(tokens) for e in experts.deepspeed_experts])  # [E, T, M]
    expected_out = torch.einsum("tec,etm->tm", combine, outputs)
    torch.testing.assert_close(out.squeeze(0), expected_out, rtol=1e-5, atol=1e-6)
