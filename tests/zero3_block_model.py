"""The repeated-block model of the ZeRO-3 unit tests (``test_zero3_blocks.py``, on gloo) and of
their GPU form (``test_gpu_new_paths.py``): three blocks of Linear, LayerNorm and Linear in an
``nn.ModuleList``, its batches and loss, and the one-process torch AdamW reference."""

from __future__ import annotations

import torch

WIDTH, BLOCKS, STEPS, MICRO_BATCH = 192, 3, 3, 4
# Adam's update lr * m / (sqrt(v) + eps) moves by up to lr / (4 * eps) per unit of gradient where a
# gradient is near eps, magnifying the fp32 rounding of the 2 ranks' gradient sum (against the one
# process's global batch; the norm's backward cancels heavily). Largest difference from the
# reference on an AMD EPYC host, every seed and unit layout alike: 4.6e-6 at eps 1e-6 (over the
# 2e-6 bound), 1.1e-6 at 1e-4, 2.9e-7 at 1e-3.
LR, EPS = 1e-2, 1e-3


class Block(torch.nn.Module):
    """74,496 partitioned elements: above the old whole-subtree merge cap (4 x 16,384), so the
    per-module rules make three units of it (two Linears, the norm joining the block)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.down = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.norm(self.up(x))))


class BlockNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_model() -> BlockNet:
    torch.manual_seed(0)
    return BlockNet()


def batches(world: int):
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(MICRO_BATCH * world, 8, generator=generator) for _ in range(STEPS)]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def reference(world: int) -> dict:
    """One process, the global batch (the mean of the ranks' equal micro-batches), torch AdamW."""
    torch.set_num_threads(1)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.01)
    for x in batches(world):
        optimizer.zero_grad()
        loss_of(model(x)).backward()
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def collectives_so_far(groups) -> int:
    """Collectives issued so far on ``groups``, by their own sequence numbers."""
    return sum(int(group._get_sequence_number_for_group()) for group in groups)
