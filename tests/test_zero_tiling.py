"""``deepspeed.runtime.zero.tiling.TiledLinear``: a grid of tiles computing exactly the linear
layer it was copied from (float64, fresh random shapes and inputs), alone and at ZeRO-3 with each
tile gathered on its own (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from deepspeed_cpp.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias


class ReturnsBias(torch.nn.Linear):
    """Megatron-style: the bias is added and also returned."""

    def forward(self, input):
        return super().forward(input), self.bias


def _shapes(generator):
    in_f, out_f = (int(v) for v in torch.randint(7, 40, (2,), generator=generator))
    return in_f, out_f


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (3, 2), (7, 7)])
def test_tiles_compute_the_copied_linear_layer(bias, in_splits, out_splits):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    in_f, out_f = _shapes(generator)
    base = torch.nn.Linear(in_f, out_f, bias=bias).double()
    tiled = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        init_linear=copy.deepcopy(base)).double()  # fmt: skip
    assert len(tiled.in_parts) == in_splits + 1 and tiled.in_parts[-1] == in_f
    for o, row in enumerate(tiled.linears):
        for i, tile in enumerate(row):
            rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            assert torch.equal(tile.weight, base.weight[rows, cols])
            assert (tile.bias is not None) == (bias and i == in_splits - 1)
    x = torch.randn(3, 5, in_f, dtype=torch.float64, generator=generator)
    expected, ours = base(x), tiled(x)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    expected.square().sum().backward()
    ours.square().sum().backward()
    for o, row in enumerate(tiled.linears):
        rows = slice(tiled.out_parts[o], tiled.out_parts[o + 1])
        for i, tile in enumerate(row):
            cols = slice(tiled.in_parts[i], tiled.in_parts[i + 1])
            torch.testing.assert_close(tile.weight.grad, base.weight.grad[rows, cols])
            if tile.bias is not None:
                torch.testing.assert_close(tile.bias.grad, base.bias.grad[rows])
    split = TiledLinear(in_f, out_f, bias=bias, in_splits=in_splits, out_splits=out_splits,
                        input_is_already_split=True, combine_out_splits=False,
                        init_linear=base).double()  # fmt: skip
    parts = [x[..., split.in_parts[i] : split.in_parts[i + 1]] for i in range(in_splits)]
    torch.testing.assert_close(torch.cat(split(parts), dim=-1), expected.detach())


@pytest.mark.parametrize("bias", [True, False])
def test_return_bias_variant_leaves_the_bias_to_the_caller(bias):
    base = ReturnsBias(23, 29, bias=bias).double()
    tiled = TiledLinearReturnBias(23, 29, bias=bias, in_splits=2, out_splits=3,
                                  linear_cls=ReturnsBias, init_linear=base).double()  # fmt: skip
    x = torch.randn(4, 23, dtype=torch.float64)
    (expected, expected_bias), (ours, ours_bias) = base(x), tiled(x)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    if bias:
        assert torch.equal(ours_bias, expected_bias)
    else:
        assert ours_bias is None


def test_bad_splits_and_shapes_are_named():
    for splits in (0, 33):
        with pytest.raises(RuntimeError, match=f"in_splits = {splits}: expected an integer in"):
            TiledLinear(32, 40, in_splits=splits)
    with pytest.raises(ValueError, match=r"weight of shape \(40, 31\), expected \(40, 32\)"):
        TiledLinear(32, 40, init_linear=torch.nn.Linear(31, 40))
    with pytest.raises(ValueError, match="expected a last dimension of in_features = 32"):
        TiledLinear(32, 40)(torch.randn(2, 31))


def zero3_tiled_job(seed: int) -> dict:
    """One ZeRO-3 step of a TiledLinear model (every tile its own fetch unit) vs the same step
    of the untiled layer under ZeRO-3; the tiles' updated weights put together."""
    import deepspeed_cpp
    from deepspeed_cpp.zero import GatheredParameters

    torch.manual_seed(seed)
    base = torch.nn.Linear(24, 18)
    x = torch.randn(4, 24) * (1 + dist.get_rank())
    results = {}
    for kind in ("plain", "tiled"):
        model = copy.deepcopy(base) if kind == "plain" else TiledLinear(
            24, 18, in_splits=3, out_splits=2, init_linear=copy.deepcopy(base))  # fmt: skip
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "stage3_unit_min_numel": 0}}  # fmt: skip
        engine, *_ = deepspeed_cpp.initialize(model=model, config=config)
        engine.backward(engine(x).square().mean())
        engine.step()
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            if kind == "plain":
                results[kind] = (model.weight.detach().clone(), model.bias.detach().clone())
            else:
                weight = torch.cat([torch.cat([t.weight for t in row], 1) for row in model.linears])
                bias = torch.cat([row[-1].bias for row in model.linears])
                results[kind] = (weight.detach().clone(), bias.detach().clone())
        results[kind + "_partitioned"] = all(p.numel() == 0 or hasattr(p, "ds_id") for p in params)
        engine.destroy()
    return results


def test_tiles_train_at_zero3_like_the_whole_layer(pool2):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    for result in pool2.run(zero3_tiled_job, seed):
        assert result["tiled_partitioned"]
        for ours, expected in zip(result["tiled"], result["plain"]):
            torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)
