"""DeepSpeed's ``deepspeed.runtime.zero.tiling``: ``TiledLinear``, a linear layer stored as an
``out_splits`` x ``in_splits`` grid of smaller linear layers.

Under ZeRO-3 each tile is a module of its own, so only one tile's weight needs to be gathered at
a time: a layer too large to gather whole can still run (with ``stage3_unit_min_numel`` 0, or
tiles above it, each tile is its own fetch unit). The result is the whole layer's: tile
``[o][i]`` holds rows ``out_parts[o]:out_parts[o+1]`` and columns ``in_parts[i]:in_parts[i+1]``
of the weight; the output rows of ``o`` are the sum over ``i`` of the tiles' outputs on their
input columns; the bias of rows ``o`` lives in the last tile of the row (``in_splits - 1``), so
it is added once. ``TiledLinearReturnBias`` is the variant for layers that return
``(output, bias)`` and leave the bias addition to the caller (Megatron-LM's style).
"""

from __future__ import annotations

import torch

from ..layer_partitions import partition_uniform


def _check_splits(name: str, splits: int, features: int) -> None:
    if not isinstance(splits, int) or splits < 1 or splits > features:
        raise RuntimeError(
            f"TiledLinear: {name} = {splits!r}: expected an integer in [1, {features}] (each "
            f"tile needs at least one of the {features} features)"
        )


class TiledLinear(torch.nn.Module):
    """``torch.nn.Linear(in_features, out_features, bias)`` computed by a grid of tiles.

    ``linear_cls`` builds each tile (``linear_cls(in, out, bias=..., **kwargs)``);
    ``init_linear``: a linear layer of the full shape whose weight (and bias) the tiles copy;
    ``input_is_already_split``: the input is a list of ``in_splits`` tensors, each the
    columns of its tile; ``combine_out_splits`` false returns the list of the ``out_splits``
    outputs instead of their concatenation.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 in_splits: int = 1, out_splits: int = 1, input_is_already_split: bool = False,
                 combine_out_splits: bool = True, linear_cls=torch.nn.Linear, init_linear=None,
                 **kwargs):  # fmt: skip
        super().__init__()
        _check_splits("in_splits", in_splits, in_features)
        _check_splits("out_splits", out_splits, out_features)
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for out_id in range(out_splits):
            rows = self.out_parts[out_id + 1] - self.out_parts[out_id]
            row = torch.nn.ModuleList()
            for in_id in range(in_splits):
                columns = self.in_parts[in_id + 1] - self.in_parts[in_id]
                tile_bias = bias and in_id == in_splits - 1  # the row's bias, added once
                row.append(linear_cls(columns, rows, bias=tile_bias, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copies the weight (and bias) of ``other``, a linear layer of the full shape."""
        expected = (self.out_features, self.in_features)
        if tuple(other.weight.shape) != expected:
            raise ValueError(
                f"TiledLinear.copy_params_from: weight of shape {tuple(other.weight.shape)}, "
                f"expected {expected} (out_features, in_features)"
            )
        if self.use_bias and getattr(other, "bias", None) is None:
            raise ValueError("TiledLinear.copy_params_from: this layer has a bias, the other none")
        for out_id, row in enumerate(self.linears):
            rows = slice(self.out_parts[out_id], self.out_parts[out_id + 1])
            for in_id, tile in enumerate(row):
                columns = slice(self.in_parts[in_id], self.in_parts[in_id + 1])
                tile.weight.copy_(other.weight[rows, columns])
                if tile.bias is not None:
                    tile.bias.copy_(other.bias[rows])

    def _split_input(self, input):
        if self.input_is_already_split:
            if len(input) != self.in_splits:
                raise ValueError(
                    f"TiledLinear: input_is_already_split with {len(input)} parts, expected "
                    f"in_splits = {self.in_splits}"
                )
            return list(input)
        if input.shape[-1] != self.in_features:
            raise ValueError(
                f"TiledLinear: input of shape {tuple(input.shape)}, expected a last dimension of "
                f"in_features = {self.in_features}"
            )
        return [input[..., self.in_parts[i] : self.in_parts[i + 1]] for i in range(self.in_splits)]

    def _row_output(self, row, parts):
        """One output row's result: the sum of its tiles' outputs."""
        total = None
        for tile, part in zip(row, parts):
            out = tile(part)
            total = out if total is None else total + out
        return total

    def forward(self, input):
        parts = self._split_input(input)
        outputs = [self._row_output(row, parts) for row in self.linears]
        return torch.cat(outputs, dim=-1) if self.combine_out_splits else outputs


class TiledLinearReturnBias(TiledLinear):
    """``TiledLinear`` over tiles that return ``(output, bias)``: returns the combined output
    and the combined bias (None without one), the bias not added."""

    def _row_output(self, row, parts):
        total, bias = None, None
        for tile, part in zip(row, parts):
            out, tile_bias = tile(part)
            total = out if total is None else total + out
            if tile_bias is not None:
                bias = tile_bias if bias is None else bias + tile_bias
        return total, bias

    def forward(self, input):
        parts = self._split_input(input)
        rows = [self._row_output(row, parts) for row in self.linears]
        outputs = [out for out, _ in rows]
        biases = [bias for _, bias in rows]
        if not self.combine_out_splits:
            return outputs, biases
        bias = None if any(b is None for b in biases) else torch.cat(biases, dim=-1)
        return torch.cat(outputs, dim=-1), bias
