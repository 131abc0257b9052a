"""One replica at ZeRO stage 0 (runtime/zero/in_place_grads.py): the parameters' .grad are views
of the flat gradients, and training equals torch's own, bit for bit, also where user code clears
a gradient between micro-steps or replaces a parameter's data (then the engine reduces as
usual)."""

import pytest
import torch

import deepspeed_cpp as deepspeed


@pytest.fixture(autouse=True)
def _no_world_left_behind():
    """initialize() makes a world of one in this pytest process; later tests expect none."""
    was_initialized = torch.distributed.is_initialized()
    yield
    if torch.distributed.is_initialized() and not was_initialized:
        torch.distributed.destroy_process_group()


def _model():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


@pytest.mark.parametrize("mode", ["plain", "user_clears", "data_replaced"])
def test_one_replica_trains_like_torch(mode):
    model, reference = _model(), _model()
    reference.load_state_dict(model.state_dict())
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 3,
            "gradient_clipping": 0.0,  # torch's reference does not clip
        },
    )
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    flat = engine.optimizer.shard_grads[0]
    flat_range = range(flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size())
    if mode == "data_replaced":
        for param in model.parameters():
            param.data = param.data.clone()
    in_flat = []
    for _ in range(3):
        for micro in range(3):
            x, y = torch.randn(2, 6), torch.randn(2, 3)
            engine.backward(torch.nn.functional.mse_loss(model(x), y))
            in_flat.append(model[0].weight.grad.data_ptr() in flat_range)
            (torch.nn.functional.mse_loss(reference(x), y) * (1.0 / 3)).backward()
            if mode == "user_clears" and micro == 0:
                model[0].weight.grad = None  # dropped: the later micro-steps' sum only
                reference[0].weight.grad = None
            engine.step()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine, theirs)
    assert all(in_flat) == (mode != "data_replaced"), in_flat
    assert ("in place" in engine.optimizer.describe()) == (mode != "data_replaced")


def test_two_replicas_all_reduce_in_place_like_the_reducer(pool2):
    """ZeRO 0, two replicas, buckets of ~40 elements, a head some micro-steps leave unused on
    one rank only, a gradient cleared by user code: bit for bit the reducer's result (same
    buffers, same all-reduce, same scaling), and torch's training on the global batch within
    fp32 rounding of the summation order."""
    import random

    import in_place_grads_jobs as jobs

    for result in pool2.run(jobs.replicas_equal_reducer_and_torch, random.randrange(2**31), 3):
        assert result["uses_in_place"] and result["buckets"] > 2, result
        assert "all-reduced in place" in result["describe"], result
        assert result["views_in_flat"], result
        assert result["bitwise_vs_reducer"], result
        assert result["worst_vs_torch"] < 1e-6, result


def test_a_layer_used_twice_in_one_backward_is_reduced_once_complete_or_refused(pool2):
    """A layer applied in two reentrant checkpoints (its gradient accumulates twice, the second
    time after the layer in front is done): one bucket waits for all, and training equals
    torch's with the replicas equal; with a bucket per parameter the shared layer's bucket is
    complete, and sent, before its second accumulation: refused, naming it, on every rank."""
    import random

    import in_place_grads_jobs as jobs

    seed = random.randrange(2**31)
    for result in pool2.run(jobs.shared_layer_in_reentrant_checkpoints, seed, 10**6):
        assert result["in_place"] and result["buckets"] == 1, result
        assert result["worst"] < 1e-6 and result["replicas_equal"], result
    for result in pool2.run(jobs.shared_layer_in_reentrant_checkpoints, seed, 20):
        assert result["in_place"] and result["buckets"] > 2, result
        error = result.get("error", "")
        assert "was accumulated again after gradient bucket" in error, result
        assert "shape [16, 16]" in error or "shape [16]" in error, result
        assert "use_reentrant=False" in error, result
