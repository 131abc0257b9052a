"""ZeRO-3 groups consecutive small repeated blocks into one unit (``unit_tree.py``): the first
block's forward gathers the group and the last one's is done with it. Trained on 2 real gloo
processes, each pattern equals ZeRO-2 on the same model: blocks run in order, a step that skips the
group's first block (LayerDrop), a loss that reads an earlier block's output only (the group's last
block then gets no gradient, and the earlier block's backward starts the group's), and activation
checkpointing per block, reentrant or not; blocks marked as leaves (``set_z3_leaf_modules``) stay
units of their own. ``stage3_max_reuse_distance`` 0 releases every unit after its forward, so the
backward gathers the groups again through the blocks' hooks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

WIDTH, BLOCKS, MICRO, STEPS = 48, 5, 3, 4
# Blocks of 4,800 elements; stage3_unit_min_numel 1,024 makes them repeated blocks (each at least
# that) grouped up to 16 x 1,024 elements: four blocks, then the fifth alone.
UNIT_MIN_NUMEL = 1024
GROUPED_NAMES = ["<root>", "blocks.0..blocks.3", "blocks.4"]
LEAF_NAMES = ["<root>"] + [f"blocks.{index}" for index in range(BLOCKS)]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.down = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.norm(self.up(x))))


class GroupNet(torch.nn.Module):
    def __init__(self, pattern: str):
        super().__init__()
        self.embed = torch.nn.Linear(8, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 4)
        self.pattern = pattern
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = self.embed(x)
        tapped = None
        for index, block in enumerate(self.blocks):
            if self.pattern == "skip first" and index == 0 and self.calls % 2 == 0:
                continue  # LayerDrop on every second step: the group starts at its second block
            if self.pattern.startswith("checkpoint"):
                reentrant = self.pattern == "checkpoint reentrant"
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
            else:
                x = block(x)
            if index == 1:
                tapped = x
        # "tap": the loss reads block 1's output only; blocks 2-4 still run (inside the group
        # and after it) and get no gradient.
        return self.head(tapped if self.pattern == "tap" else x)


def train_job(stage: int, pattern: str, seed: int) -> dict:
    import deepspeed_cpp as deepspeed

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    zero = {"stage": stage}
    if stage == 3:
        zero.update({
            "stage3_param_persistence_threshold": 0,
            "stage3_unit_min_numel": UNIT_MIN_NUMEL,
            "stage3_max_reuse_distance": 0,
        })  # fmt: skip
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}},
        "zero_optimization": zero,
    }
    model = GroupNet(pattern)
    if pattern == "leaf blocks":  # leaves stay units of their own, never grouped
        from deepspeed_cpp.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [Block])
    engine, *_ = deepspeed.initialize(model=model, config=config)
    try:
        generator = torch.Generator().manual_seed(seed + 1)
        for _ in range(STEPS):
            x = torch.randn(MICRO * world, 8, generator=generator)
            engine.backward(engine(x[rank * MICRO : (rank + 1) * MICRO]).square().mean())
            engine.step()
        result = {"params": {k: v.clone() for k, v in engine.full_module_state_dict().items()}}
        if stage == 3:
            coordinator = engine._zero_stage.coordinator
            result["names"] = list(coordinator.unit_names)
            result["live"] = coordinator.live_numel()
            # Units the blocks' forwards had to borrow by reading a parameter not gathered:
            # none, a skipped first block included (the next block gathers the group).
            blocks = engine.module.blocks
            own = coordinator.unit_of_module
            result["borrowed"] = [
                unit
                for block in blocks
                for unit in coordinator._module_units[id(block)]
                if unit != own.get(id(block))
            ]
        return result
    finally:
        engine.destroy()


@pytest.mark.parametrize(
    "pattern",
    ["in order", "skip first", "tap", "checkpoint reentrant", "checkpoint", "leaf blocks"],
)
def test_grouped_blocks_train_like_zero2(pool2, pattern):
    seed = int(torch.randint(0, 2**30, ()).item())
    zero2 = pool2.run(train_job, 2, pattern, seed, timeout=180.0)
    zero3 = pool2.run(train_job, 3, pattern, seed, timeout=180.0)
    for rank in range(2):
        names = LEAF_NAMES if pattern == "leaf blocks" else GROUPED_NAMES
        assert zero3[rank]["names"] == names, zero3[rank]["names"]
        assert zero3[rank]["live"] == 0  # every unit released by the end of the step
        assert zero3[rank]["borrowed"] == [], zero3[rank]["borrowed"]
        expected, got = zero2[rank]["params"], zero3[rank]["params"]
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            scale = max(value.abs().max().item(), 1e-3)
            assert (got[name] - value).abs().max().item() <= 1e-6 * scale, (pattern, name)
    # The ranks hold the same model.
    for name, value in zero3[0]["params"].items():
        assert torch.equal(value, zero3[1]["params"][name]), name
