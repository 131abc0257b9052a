"""Jobs for tests/test_pipe.py: the one-replica fast path (gradients accumulated straight into
the flat gradient buffers, torch's Adam stepped over cache-sized chunks of the flat master) is
bit for bit the same arithmetic as training the whole model in one process."""

from __future__ import annotations

import torch
from pipe_jobs import Reference, loss_fn, make_batches
from torch import nn

from deepspeed_cpp.runtime.zero.chunked_step import CHUNK_ELEMENTS


def _specs():
    from deepspeed_cpp.pipe import LayerSpec

    # Stage 0 holds 8*640+640 + 640*416+416 elements: more than one chunk of the step.
    return [
        LayerSpec(nn.Linear, 8, 640),
        nn.Tanh(),
        LayerSpec(nn.Linear, 640, 416),
        nn.Tanh(),
        LayerSpec(nn.Linear, 416, 3),
    ]


def trains_bitwise_like_one_process(seed: int, steps: int, micro_batches: int) -> dict:
    """2 stages x 1 replica, fp32, torch's Adam, no clipping, beside the reference that scales
    each micro-batch's loss by 1/micro_batches as the engine does: the weights and the Adam
    state must be equal bit for bit."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    base_seed = seed % 10_000
    pipe = PipelineModule(_specs(), num_stages=2, loss_fn=loss_fn, partition_method="uniform",
                          seed_layers=True, base_seed=base_seed)  # fmt: skip
    reference = Reference(_specs(), base_seed)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": 4 * micro_batches,
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,  # the reference does not clip
    }
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-3), config=config
    )
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    stage = engine.optimizer
    flat = stage.shard_grads[0]
    flat_range = range(flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size())
    grads_in_flat = []  # per accumulation: did autograd write into the flat gradient?
    for param in pipe.parameters():
        param.register_post_accumulate_grad_hook(
            lambda p: grads_in_flat.append(p.grad.data_ptr() in flat_range)
        )
    for batch in make_batches(seed, steps, 1, micro_batches):
        engine.train_batch(iter(batch[0]))
        ref_optimizer.zero_grad()
        for x, y in batch[0]:
            (loss_fn(reference(x), y) * (1.0 / micro_batches)).backward()
        ref_optimizer.step()
    ref_state = reference.named_state()
    ours = pipe.state_dict()
    # The masters' Adam moments, per parameter, beside the reference's.
    master = stage.masters[0]
    moments_equal = True
    named = dict(pipe.named_parameters())
    ref_named = dict(reference.named_parameters())
    for name, param in named.items():
        bucket = stage.buckets[0]
        offset = bucket.offsets[[id(p) for p in bucket.params].index(id(param))]
        ref_moments = ref_optimizer.state[ref_named["layers." + name]]
        for key in ("exp_avg", "exp_avg_sq"):
            mine = stage.optimizer.state[master][key].narrow(0, offset, param.numel())
            moments_equal &= torch.equal(mine.view(param.shape), ref_moments[key])
    return {
        "stage": engine.stage_id,
        "chunked": master.numel() > CHUNK_ELEMENTS,
        "one_state_per_master": len(stage.optimizer.state) == len(stage.masters),
        "grads_in_flat": len(grads_in_flat) > 0 and all(grads_in_flat),
        "weights_equal": all(torch.equal(v, ref_state[k]) for k, v in ours.items()),
        "moments_equal": moments_equal,
        "moved": max((v - p).abs().max().item() for k, v in ours.items()
                     for p in [Reference(_specs(), base_seed).named_state()[k]]),
    }  # fmt: skip
