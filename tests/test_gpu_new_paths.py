"""The paths added without a GPU, run on one (issue 31; scripts/gpu_check.sh runs this file):
torch's Adam/AdamW stepped in chunks over CUDA tensors (runtime/zero/chunked_step.py), in-place
gradients at ZeRO 0 on one GPU (runtime/zero/in_place_grads.py), and ZeRO-3 units from repeated
blocks with their coalesced prefetch gathers (tests/zero3_block_model.py) on NCCL in one
process. Two processes cannot share one GPU under NCCL (it refuses a duplicate device), so the
multi-rank forms of these paths are left to the gloo tests. Skipped where no CUDA device exists;
each check's CPU form is in test_chunked_step.py, test_in_place_grads.py, test_zero3_blocks.py.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed_cpp.runtime.zero.chunked_step import can_step_in_chunks, step_in_chunks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    """initialize() makes a world of one (NCCL) in this pytest process; later tests expect none."""
    was_initialized = torch.distributed.is_initialized()
    yield
    if torch.distributed.is_initialized() and not was_initialized:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    "kind,options",
    [
        (torch.optim.Adam, {}),  # foreach, torch's default on CUDA
        (torch.optim.AdamW, {"weight_decay": 0.1, "amsgrad": True, "foreach": False}),
        (torch.optim.Adam, {"fused": True}),
    ],
)
def test_chunked_step_on_cuda_equals_whole_tensor_step(kind, options):
    generator = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    sizes = [1000, 4099, 37]
    made = [[torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in sizes] for _ in range(2)]
    for a, b in zip(*made):
        a.data.copy_(torch.randn(a.shape, generator=generator, device="cuda"))
        b.data.copy_(a.data)
    reference, chunked = (kind(params, lr=1e-2, **options) for params in made)
    for step in range(4):
        for p, q in zip(*made):
            p.grad = torch.randn(p.shape, generator=generator, device="cuda")
            q.grad = p.grad.clone()
        reference.step()
        if step == 0:
            chunked.step()  # the state is made by a whole step
            continue
        assert can_step_in_chunks(chunked)
        step_in_chunks(chunked, chunk_elements=512)
    for p, q in zip(*made):
        assert torch.equal(p, q)
        for key, value in reference.state[p].items():
            assert torch.equal(value, chunked.state[q][key]), key
            assert chunked.state[q][key].device == value.device, key


def test_in_place_gradients_at_zero0_on_one_gpu():
    """Gradients accumulated into the flat fp32 buffer on the device, 3 micro-steps, torch's
    Adam (foreach on CUDA) stepped in chunks over the flat master: bit for bit torch's own
    training of the same model on the same GPU."""
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 300)
        ).cuda()

    ours, reference = model(), model()
    reference.load_state_dict(ours.state_dict())
    engine, *_ = deepspeed.initialize(
        model=ours,
        optimizer=torch.optim.Adam(ours.parameters(), lr=1e-3),
        config={
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 3,
            "gradient_clipping": 0.0,  # torch's reference does not clip
        },
    )
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    flat = engine.optimizer.shard_grads[0]
    assert flat.device.type == "cuda" and flat.numel() > (1 << 18)  # more than one chunk
    begin, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    in_flat = []
    for _ in range(3):
        for _ in range(3):
            x, y = torch.randn(8, 64, device="cuda"), torch.randn(8, 300, device="cuda")
            engine.backward(torch.nn.functional.mse_loss(ours(x), y))
            in_flat.append(all(begin <= p.grad.data_ptr() < end for p in ours.parameters()))
            (torch.nn.functional.mse_loss(reference(x), y) * (1.0 / 3)).backward()
            engine.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    assert all(in_flat), in_flat
    assert "in place" in engine.optimizer.describe()
    for mine, theirs in zip(ours.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    engine.destroy()


def test_zero3_block_units_on_one_gpu():
    """The block model of tests/zero3_block_model.py at ZeRO 3 on CUDA: every block one unit (the
    per-module rules with ``stage3_unit_min_numel`` 0), gathered by a few coalesced collectives
    per step, training equal to torch's AdamW on the same GPU within the fused kernels'
    rounding (ours vs torch's differ by up to ~1e-6 per step, test_fused_adam_cuda.py)."""
    import zero3_block_model as blocks

    import deepspeed_cpp as deepspeed

    def reference() -> dict:
        model = blocks.make_model().cuda()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=blocks.LR, eps=blocks.EPS, weight_decay=0.01
        )
        for x in blocks.batches(1):
            optimizer.zero_grad()
            blocks.loss_of(model(x.cuda())).backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    expected = reference()
    for extra, names in (
        ({}, ["<root>", "blocks.0", "blocks.1", "blocks.2"]),
        ({"stage3_unit_min_numel": 0}, None),
    ):
        config = {
            "train_micro_batch_size_per_gpu": blocks.MICRO_BATCH,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": blocks.LR, "eps": blocks.EPS, "weight_decay": 0.01},
            },
            "gradient_clipping": 0.0,  # the torch AdamW reference does not clip
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **extra},
        }
        engine, *_ = deepspeed.initialize(model=blocks.make_model(), config=config)
        try:
            assert engine.device.type == "cuda", engine.device
            coordinator = engine._zero_stage.coordinator
            everything = list(torch.distributed.distributed_c10d._world.pg_map)
            counts = []
            for x in blocks.batches(1):
                before = blocks.collectives_so_far(everything)
                engine.backward(blocks.loss_of(engine(x.cuda())))
                engine.step()
                counts.append(blocks.collectives_so_far(everything) - before)
            state = engine.full_module_state_dict()
            units = list(coordinator.unit_names)
            if names is not None:
                assert units == names, units
                assert max(counts[1:]) <= 8, counts
            else:
                assert len(units) == 3 * blocks.BLOCKS + 2, units
            worst = max(
                (state[name].to(p.device) - p).abs().max().item() for name, p in expected.items()
            )
            assert worst <= 1e-5, (extra, worst)
        finally:
            engine.destroy()
