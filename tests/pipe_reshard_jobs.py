"""Jobs for tests/test_pipe.py: a pipeline checkpoint saved at one number of stages resumed at
another (2 -> 3 and 3 -> 2, one replica), beside the run that was never interrupted."""

from __future__ import annotations

import torch
from pipe_jobs import _config, _schedule, layer_specs, loss_fn, make_batches


def _build(seed: int, stages: int):
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import PipelineModule

    pipe = PipelineModule(
        layer_specs(True), num_stages=stages, loss_fn=loss_fn, partition_method="uniform",
        seed_layers=True, base_seed=seed % 1000,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=pipe,
        optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-2),
        lr_scheduler=_schedule,
        config=_config(2, 1, 0.05, 0),  # 2 micro-batches, clipping 0.05: the same global batch
    )
    return pipe, engine


def save_then_continue(seed: int, directory: str, stages: int) -> dict:
    """Trains 2 steps, saves, trains 2 more; returns this stage's weights after the 4 steps
    (the uninterrupted run) and the last loss."""
    pipe, engine = _build(seed, stages)
    batches = make_batches(seed, 4, 1, 2)
    for step in range(2):
        engine.train_batch(iter(batches[step][0]))
    engine.save_checkpoint(directory)
    for step in range(2, 4):
        loss = engine.train_batch(iter(batches[step][0]))
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    engine.destroy()
    return {"state": state, "loss": float(loss)}


def resume_and_compare(seed: int, directory: str, stages: int, uninterrupted: dict) -> dict:
    """A fresh engine of ``stages`` stages (other initial weights) loads the checkpoint and
    trains the same 2 steps; returns its largest difference from the uninterrupted weights."""
    torch.manual_seed(seed + 99)
    pipe, engine = _build(seed + 1, stages)  # other initial weights: all must come from the file
    engine.load_checkpoint(directory)
    batches = make_batches(seed, 4, 1, 2)
    for step in range(2, 4):
        loss = engine.train_batch(iter(batches[step][0]))
    state = pipe.state_dict()
    steps = sorted({int(s["step"]) for s in engine.optimizer.state.values() if "step" in s})
    result = {
        "stage": engine.stage_id,
        "names": sorted(state),
        "diff": max((v - uninterrupted[k]).abs().max().item() for k, v in state.items()),
        "loss": float(loss),
        "adam_steps": steps,
        "global_steps": engine.global_steps,
    }
    engine.destroy()
    return result
