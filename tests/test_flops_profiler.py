"""The flops profiler (issue 30): torch's counter, attributed per module, against FLOPs counted
by hand for Linear, Conv2d and attention; DeepSpeed's API and printed layout."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from deepspeed_cpp.profiling.flops_profiler import FlopsProfiler, get_model_profile

B, C, HW, OUT, HEADS, SEQ, DIM = 2, 3, 16, 10, 2, 4, 8


class Attention(torch.nn.Module):
    def forward(self, x):  # x: (B, HEADS, SEQ, DIM), self-attention
        return F.scaled_dot_product_attention(x, x, x)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(C, 8, kernel_size=3, padding=1)
        self.head = torch.nn.Linear(8 * HW * HW, OUT)
        self.attention = Attention()

    def forward(self, image, tokens):
        y = self.head(torch.relu(self.conv(image)).flatten(1))
        return y, self.attention(tokens)


CONV_MACS = B * 8 * HW * HW * (C * 3 * 3)  # every output element: C*k*k multiply-adds
LINEAR_MACS = B * (8 * HW * HW) * OUT
ATTENTION_MACS = 2 * B * HEADS * SEQ * SEQ * DIM  # Q @ K^T and P @ V
PARAMS = (C * 9 * 8 + 8) + (8 * HW * HW * OUT + OUT)


def _inputs():
    return torch.randn(B, C, HW, HW), torch.randn(B, HEADS, SEQ, DIM)


def test_counts_match_hand_computed():
    model = Net()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.no_grad():
        model(*_inputs())
    assert profiler._module_flops(model.conv) == 2 * CONV_MACS
    assert profiler._module_flops(model.head) == 2 * LINEAR_MACS
    assert profiler._module_flops(model.attention) == 2 * ATTENTION_MACS
    total_macs = CONV_MACS + LINEAR_MACS + ATTENTION_MACS
    assert profiler.get_total_flops() == 2 * total_macs
    assert profiler.get_total_macs() == total_macs
    assert profiler.get_total_params() == PARAMS
    assert profiler.get_total_duration() > 0
    profiler.stop_profile()
    with torch.no_grad():
        model(*_inputs())  # not profiled any more
    assert profiler.get_total_flops() == 2 * total_macs
    profiler.end_profile()
    assert profiler.get_total_flops() == 0


def test_backward_is_not_counted():
    model = Net()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    y, a = model(*_inputs())
    (y.sum() + a.sum()).backward()
    assert profiler.get_total_macs() == CONV_MACS + LINEAR_MACS + ATTENTION_MACS


def test_get_model_profile_and_printout(capsys):
    model = Net()
    flops, macs, params = get_model_profile(
        model, args=list(_inputs()), as_string=False, print_profile=True, top_modules=2
    )
    assert macs == CONV_MACS + LINEAR_MACS + ATTENTION_MACS and flops == 2 * macs
    assert params == PARAMS
    text = capsys.readouterr().out
    assert "DeepSpeed Flops Profiler" in text and "Aggregated Profile per GPU" in text
    assert "Detailed Profile per GPU" in text
    assert "(conv): Conv2d(" in text and "MACs" in text
    assert f"{'fwd MACs per GPU:':<60}" in text
    # The tree's extra_repr is put back after printing.
    assert "MACs" not in repr(model)


def test_linear_model_from_input_shape():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    flops, macs, params = get_model_profile(model, input_shape=(5, 32), print_profile=False)
    assert macs == f"{round((5 * 32 * 64 + 5 * 64 * 4) / 1e3, 2)} KMACs"
    assert params == "2.37 K"


@pytest.mark.parametrize("depth", [0, 1])
def test_module_depth_filters_the_tree(depth):
    model = Net()
    profiler = FlopsProfiler(model)
    profiler.start_profile()
    with torch.no_grad():
        model(*_inputs())
    text = profiler.print_model_profile(module_depth=depth, output_file=None)
    assert ("(conv): Conv2d(224 = " in text) == (depth >= 1)


def test_reachable_as_attributes_after_import_deepspeed(monkeypatch):
    """``import deepspeed; deepspeed.profiling.flops_profiler.get_model_profile(...)`` works in
    DeepSpeed, so it must after ``import deepspeed_cpp as deepspeed`` too. Here the subpackage is
    already imported (and so an attribute): it is taken away for the test, as in a fresh
    interpreter, and put back after."""
    import deepspeed_cpp as deepspeed

    monkeypatch.delattr(deepspeed.profiling, "flops_profiler")
    monkeypatch.delitem(sys.modules, "deepspeed_cpp.profiling.flops_profiler")
    fp = deepspeed.profiling.flops_profiler
    _, macs, _ = fp.get_model_profile(
        torch.nn.Linear(3, 2), input_shape=(4, 3), print_profile=False, as_string=False
    )
    assert macs == 4 * 3 * 2 and fp.FlopsProfiler.__name__ == "FlopsProfiler"
