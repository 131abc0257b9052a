"""A pipeline stage's forward and backward passes beside plain torch, in one process.

bench_pipe.py's per-stage busy time mixes the passes with two processes' contention on a shared
machine. Here one process holds both: a 1-stage ``PipelineModule`` of ``--layers`` x
(``Linear(width, width)`` + ``ReLU``) trained by deepspeed_cpp's ``PipelineEngine.train_batch``
(its forward and backward instructions timed), and an ``nn.Sequential`` with the same weights
whose forward and backward run by hand on the same micro-batches, the two alternating per batch
so that load falls on both alike. What the engine adds to a pass (its parameters living in the
optimizer's flat buffers, per-parameter gradient hooks, the loss scaling and buffer handling
around the backward) shows as the ratio; the optimizer step (ours: ``OptimizerStep``, torch's
Adam over the flat fp32 master with the norm and gathers around it; torch: the same Adam over
the separate parameters) too, and our ``ReduceGrads`` (nothing to reduce with one replica).

    python benchmarks/bench_pipe_passes.py [--layers 12] [--width 1024] [--steps 6]

Instrumentation note: wrap a ``PipelineEngine``'s methods by name, not by walking ``dir()``:
``nn.Module.__dir__`` lists a method both from the class and from the instance once it was
wrapped there, so wrapping everything ``dir()`` yields wraps such a method twice and counts its
time twice.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch


def _timed(function, seconds: list):
    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[-1] += time.perf_counter() - began

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)  # one stage of bench_pipe's 24
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")  # fmt: skip
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.pipe import LayerSpec, PipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    width, micro = args.width, args.micro_batch
    specs = []
    for _ in range(args.layers):
        specs += [LayerSpec(torch.nn.Linear, width, width), torch.nn.ReLU()]
    pipe = PipelineModule(specs, num_stages=1, loss_fn=torch.nn.MSELoss())
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": args.micro_batches,
        "train_batch_size": micro * args.micro_batches,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.Adam(pipe.parameters(), lr=1e-4), config=config
    )
    torch.set_num_threads(1)
    plain = torch.nn.Sequential(
        *[m for _ in range(args.layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
    )
    with torch.no_grad():
        for ours, theirs in zip(pipe.parameters(), plain.parameters()):
            theirs.copy_(ours)
    generator = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(micro, width, generator=generator),
         torch.randn(micro, width, generator=generator))
        for _ in range(args.micro_batches)
    ]  # fmt: skip
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=1e-4)
    forward, backward, reduce, step = [], [], [], []
    engine._exec_forward_pass = _timed(engine._exec_forward_pass, forward)
    engine._exec_backward_pass = _timed(engine._exec_backward_pass, backward)
    engine._exec_reduce_grads = _timed(engine._exec_reduce_grads, reduce)
    engine._exec_optimizer_step = _timed(engine._exec_optimizer_step, step)
    plain_forward, plain_backward, plain_step = [], [], []
    for _ in range(2 + args.steps):
        forward.append(0.0), backward.append(0.0), reduce.append(0.0), step.append(0.0)
        engine.train_batch(iter(batches))
        plain_forward.append(0.0), plain_backward.append(0.0), plain_step.append(0.0)
        for x, y in batches:
            began = time.perf_counter()
            out = plain(x)
            middle = time.perf_counter()
            (torch.nn.functional.mse_loss(out, y) / args.micro_batches).backward()
            plain_forward[-1] += middle - began
            plain_backward[-1] += time.perf_counter() - middle
        began = time.perf_counter()
        plain_optimizer.step()  # per parameter, as DeepSpeed's engine steps a client optimizer
        plain_step[-1] += time.perf_counter() - began
        plain.zero_grad(set_to_none=False)

    def median(values: list) -> float:
        return statistics.median(values[2:])  # after 2 warm-up batches

    print(
        f"{args.layers} x Linear({width}) + ReLU, {args.micro_batches} micro-batches of {micro}, "
        f"fp32, 1 thread, one process; median of {args.steps} batches (s per batch)"
    )
    print(f"{'pass':<10}{'torch':>10}{'ours':>10}{'ours/torch':>12}")
    for name, ref, ours in (("forward", plain_forward, forward),
                            ("backward", plain_backward, backward),
                            ("step", plain_step, step)):  # fmt: skip
        print(f"{name:<10}{median(ref):>10.4f}{median(ours):>10.4f}"
              f"{median(ours) / median(ref):>11.2f}x")  # fmt: skip
    # torch has nothing to reduce with one replica; ours should have nothing to do either.
    print(f"{'reduce':<10}{'-':>10}{median(reduce):>10.4f}")


if __name__ == "__main__":
    main()
