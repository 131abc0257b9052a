"""deepspeed_cpp.moe.utils: non-MoE models pass through the param-group helper; expert
parameters get groups of their own per expert group name, as DeepSpeed splits them."""

import pytest
import torch
from torch import nn

import deepspeed_cpp.moe as moe
from deepspeed_cpp.moe.utils import (
    has_moe_layers,
    is_moe_param,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))


def test_one_group_dict_comes_back_as_a_list_with_the_same_parameters():
    model = small_model()
    group = {"params": [p for p in model.parameters()], "name": "parameters", "lr": 0.3}
    groups = split_params_into_different_moe_groups_for_optimizer(group)
    assert len(groups) == 1
    assert groups[0]["name"] == "parameters" and groups[0]["lr"] == 0.3
    assert [id(p) for p in groups[0]["params"]] == [id(p) for p in model.parameters()]


def test_generators_lists_and_tuples_of_groups_keep_order_and_options():
    first, second = small_model(), small_model()
    groups = split_params_into_different_moe_groups_for_optimizer(
        ({"params": first.parameters(), "weight_decay": 0.1}, {"params": second.parameters()})
    )
    assert [len(g["params"]) for g in groups] == [4, 4]
    assert groups[0]["weight_decay"] == 0.1 and "weight_decay" not in groups[1]
    assert all(isinstance(g["params"], list) for g in groups)
    assert groups[1]["params"][3] is list(second.parameters())[3]
    listed = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [groups[0]["params"][0]]}]
    )
    assert listed[0]["params"][0] is groups[0]["params"][0]


def test_the_result_trains_like_the_plain_parameter_list():
    # The groups feed an optimizer exactly as model.parameters() would: same update, bit for bit.
    model = small_model()
    reference = small_model()
    reference.load_state_dict(model.state_dict())
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    group_options = {k: v for k, v in groups[0].items() if k != "name"}
    ours = torch.optim.Adam([group_options], lr=0.01)
    theirs = torch.optim.Adam(reference.parameters(), lr=0.01)
    inputs = torch.randn(11, 7)
    for net, optimizer in ((model, ours), (reference, theirs)):
        for _ in range(3):
            optimizer.zero_grad()
            net(inputs).square().mean().backward()
            optimizer.step()
    for mine, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, expected)


def test_expert_parameters_get_groups_of_their_own_per_group_name():
    model = small_model()
    params = list(model.parameters())  # w0 (5, 7), b0 (5), w1 (3, 5), b1 (3)
    for index, name in ((0, "ep_size_1"), (2, "ep_size_2"), (3, "ep_size_1")):
        params[index].allreduce = False
        params[index].group_name = name
    source = [
        {"params": params[:2], "name": "first", "lr": 0.1},
        {"params": params[2:], "name": "second", "weight_decay": 0.5},
    ]
    groups = split_params_into_different_moe_groups_for_optimizer(source)
    index = {id(p): i for i, p in enumerate(params)}
    summary = [(g["name"], g.get("moe", False), [index[id(p)] for p in g["params"]])
               for g in groups]  # fmt: skip
    assert summary == [
        ("first", False, [1]),
        ("second", False, []),
        ("ep_size_1", True, [0]),
        ("ep_size_2", True, [2]),
        ("ep_size_1", True, [3]),
    ]
    assert groups[2]["lr"] == 0.1 and groups[3]["weight_decay"] == 0.5 and "lr" not in groups[3]
    assert [len(g["params"]) for g in source] == [2, 2]  # the input is left alone
    # max_group_size splits greedily; a parameter larger than the limit stands alone.
    for p in params:
        p.allreduce, p.group_name = False, "ep_size_1"
    limited = split_params_into_different_moe_groups_for_optimizer({"params": params}, 20)
    sizes = [[p.numel() for p in g["params"]] for g in limited]
    assert sizes == [[], [35], [5, 15], [3]]
    unlimited = split_params_into_different_moe_groups_for_optimizer({"params": params}, None)
    assert [len(g["params"]) for g in unlimited] == [0, 4]


def test_expert_parameter_without_group_name_is_named():
    model = small_model()
    list(model.parameters())[1].allreduce = False
    with pytest.raises(
        ValueError, match=r"param_groups\[0\] params\[1\] of shape \(5,\) is an expert"
    ):
        split_params_into_different_moe_groups_for_optimizer({"params": model.parameters()})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("params", "param_groups is a str; expected a dict with 'params'"),
        ([["a"]], r"param_groups\[0\] is a list; expected a dict"),
        ([{"name": "x", "lr": 1}], r"param_groups\[0\] has keys \['lr', 'name'\] but no 'params'"),
    ],
)
def test_malformed_groups_are_named(bad, message):
    with pytest.raises(TypeError, match=message):
        split_params_into_different_moe_groups_for_optimizer(bad)


def test_shared_and_expert_split_helpers():
    model = small_model()
    params = list(model.parameters())
    params[1].allreduce = False
    assert [is_moe_param(p) for p in params] == [False, True, False, False]
    shared, expert = split_params_into_shared_and_expert_params(params)
    assert [id(p) for p in shared] == [id(params[i]) for i in (0, 2, 3)]
    assert [id(p) for p in expert] == [id(params[1])]
    model(torch.randn(4, 7)).sum().backward()
    params[3].grad = None
    shared_grads, expert_grads = split_params_grads_into_shared_and_expert_params(params)
    assert len(shared_grads) == 2 and torch.equal(expert_grads[0], params[1].grad)


def test_moe_layers_are_found_and_plain_models_have_none():
    layer = moe.layer.MoE(hidden_size=84, expert=nn.Linear(84, 84), num_experts=4, ep_size=1, k=1)
    assert has_moe_layers(nn.Sequential(nn.Linear(84, 84), layer)) == (True, 4)
    assert has_moe_layers(small_model()) == (False, 0)


def test_a_moe_layer_splits_into_shared_and_expert_groups():
    layer = moe.layer.MoE(hidden_size=6, expert=nn.Linear(6, 6), num_experts=2)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": layer.parameters(), "name": "parameters"}
    )
    assert [(g["name"], len(g["params"])) for g in groups] == [("parameters", 1), ("ep_size_1", 4)]
    assert groups[0]["params"][0] is layer.deepspeed_moe.gate.wg.weight
