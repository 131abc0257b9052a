"""torch's Adam/AdamW stepped over chunks of flat masters (runtime/zero/chunked_step.py) equal
the same optimizer stepped over the whole tensors, bit for bit, with the same state layout."""

import pytest
import torch

from deepspeed_cpp.runtime.zero.chunked_step import can_step_in_chunks, step_in_chunks


def _pair(kind, options, sizes, generator):
    """Two optimizers over equal fresh parameters (two groups, sizes not multiples of the
    chunk), their gradients equal."""
    made = []
    for _ in range(2):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        made.append(params)
    for a, b in zip(*made):
        a.data.copy_(torch.randn(a.shape, generator=generator))
        b.data.copy_(a.data)
    return [
        kind([{"params": ps[:1]}, {"params": ps[1:], "lr": 3e-3}], lr=1e-2, **options)
        for ps in made
    ]


@pytest.mark.parametrize(
    "kind,options",
    [
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {"weight_decay": 0.1, "amsgrad": True}),
        (torch.optim.Adam, {"foreach": True, "betas": (0.8, 0.95)}),
    ],
)
def test_chunked_step_equals_whole_tensor_step(kind, options):
    generator = torch.Generator().manual_seed(torch.seed() % 2**31)
    reference, chunked = _pair(kind, options, [1000, 4099, 37], generator)
    seen = []  # the sizes the optimizer stepped: chunks of at most 512 where chunked
    chunked.register_step_pre_hook(
        lambda opt, *_: seen.append([p.numel() for g in opt.param_groups for p in g["params"]])
    )
    for step in range(4):
        for a, b in zip(reference.param_groups, chunked.param_groups):
            for p, q in zip(a["params"], b["params"]):
                p.grad = torch.randn(p.shape, generator=generator)
                q.grad = p.grad.clone()
        reference.step()
        if step == 0:
            assert not can_step_in_chunks(chunked)  # state not yet made: a whole step makes it
            chunked.step()
            continue
        assert can_step_in_chunks(chunked)
        step_in_chunks(chunked, chunk_elements=512)
        assert seen[-1] == [512, 488] + [512] * 8 + [3] + [37]
    ref_state, ours_state = reference.state_dict(), chunked.state_dict()
    assert ref_state["param_groups"] == ours_state["param_groups"]
    assert ref_state["state"].keys() == ours_state["state"].keys()
    for index, state in ref_state["state"].items():
        assert state.keys() == ours_state["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(value, ours_state["state"][index][key]), (index, key)
    for a, b in zip(reference.param_groups, chunked.param_groups):
        for p, q in zip(a["params"], b["params"]):
            assert torch.equal(p, q)


def test_other_optimizers_are_not_chunked():
    param = torch.nn.Parameter(torch.randn(10))
    param.grad = torch.randn(10)
    sgd = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    sgd.step()
    assert not can_step_in_chunks(sgd)
