"""Two ``engine.backward()`` calls before one ``engine.step()`` (two losses of one batch, each
with its own backward) train on the sum of both gradients, at every ZeRO stage, with and
without gradient accumulation, also where a parameter is left out of the second backward.

The reference is torch's SGD in float64 on the same global batches: the gradient of a step is
the mean over ranks of every backward's gradient divided by the accumulation steps. Stage 1
used to hand its kept ``.grad`` over again with the second backward's gradient added to it,
counting the first one twice.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

LR, MICRO, STEPS = 0.1, 2, 2


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)
        )
        self.side = torch.nn.Linear(6, 3)  # used by the first loss only

    def forward(self, x, with_side: bool):
        out = self.body(x)
        return out + self.side(x) if with_side else out


def _job(seed: int, stage: int, gas: int):
    import deepspeed_cpp as deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = _Net()
    reference = _Net().double()
    reference.load_state_dict(model.state_dict())
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(STEPS):
        for _ in range(gas):
            x = torch.randn(world, MICRO, 6, generator=generator)
            targets = torch.randn(2, world, MICRO, 3, generator=generator)
            for k, with_side in enumerate((True, False)):  # two losses, two backwards
                engine.backward(
                    torch.nn.functional.mse_loss(model(x[rank], with_side), targets[k, rank])
                )
                for r in range(world):
                    loss = torch.nn.functional.mse_loss(
                        reference(x[r].double(), with_side), targets[k, r].double()
                    )
                    (loss / (gas * world)).backward()
            engine.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    ours = engine.full_module_state_dict()
    worst = max(
        (ours[k].double() - v).abs().max().item() for k, v in reference.state_dict().items()
    )
    moved = max((ours[k] - v).abs().max().item() for k, v in _initial(seed).items())
    engine.destroy()
    return worst, moved


def _initial(seed: int) -> dict:
    torch.manual_seed(seed)
    return _Net().state_dict()


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_backwards_before_a_step_train_on_both_gradients(pool2, stage, gas):
    seed = int(torch.randint(0, 2**30, ()))
    for worst, moved in pool2.run(_job, seed, stage, gas):
        assert moved > 1e-3  # it trained
        assert worst < 1e-6, (stage, gas, worst)
