"""Collectives per training step of ZeRO-3: deepspeed_cpp's against FSDP2 on the same model.

A collective is counted by every process group's own sequence number (C++ and Python collectives
alike, whatever group issued them), before and after a step, so the count includes the
coordinator's gathers and use checks, the reducer's reduce-scatters and any broadcast a gather
is built from. Two models, 2 gloo processes by default:

- ``encoder``: a 6-layer ``nn.TransformerEncoder`` (width 64) and a linear head (74 parameters);
- ``deep``: 48 blocks of ``Linear(256, 256)`` + ``LayerNorm(256)`` (biases and norms: many small
  parameters, a latency-bound model).

FSDP2 wraps each layer/block and the root (``fully_shard``). Our ZeRO-3 runs with
``stage3_param_persistence_threshold`` 0 (every parameter partitioned, the worst case for a
per-parameter design) unless ``--persistence`` is given.

    python benchmarks/bench_zero3_collectives.py [--procs 2] [--steps 5] [--models encoder deep]

"Before" is the same script with another checkout's package first on the path
(``PYTHONPATH=/path/to/other/checkout``). Measured 2026-11-27, 2 gloo ranks on the 2-core dev
machine with nothing else running, 6 steps, two rounds with before/after interleaved (step ms of
round 1 / round 2; FSDP2's ranged 56-68 ms and 385-410 ms over the four launches):

    model    implementation                  units  collectives/step  step ms
    encoder  ours, per parameter (cb4983e)      37               298  609 / 596
    encoder  ours, units                        37               114  374 / 287
    encoder  FSDP2                               7                20   56-68
    deep     ours, per parameter (cb4983e)      97               778  446 / 462
    deep     ours, units                        97               294  318 / 280
    deep     FSDP2                              49               146  385-410

Then one reduction per unit and small modules merged into their parent's unit
(``stage3_unit_min_numel``, default 16384; ``--unit-min-numel 16384 0`` runs both), counted
2026-11-27 with ~7 other jobs on the 2 cores (load average 20-28), so no step time of that run
is worth quoting (the same run measured main's 114-collective encoder step at 5.3 s):

    model    implementation                          units  collectives/step
    encoder  ours, reduction per unit, unit per module  37                77
    encoder  ours, reduction per unit, merged units     13                29
    encoder  FSDP2                                       7                20
    deep     ours, reduction per unit, unit per module  97               197
    deep     ours, reduction per unit, merged units     49               101
    deep     FSDP2                                      49               146

Then a module whose whole subtree fits in the merge cap (4x the min numel) became one unit (each
encoder layer one unit, not its attention and the rest as two), counted 2026-11-27 15:02 with
--steps 5 --unit-min-numel 16384 0, again with other jobs on the 2 cores (load average 18-26;
step times not quotable):

    model    implementation                          units  collectives/step
    encoder  ours, merged units                          7                17
    encoder  ours, unit per module                      37                77
    encoder  FSDP2                                       7                20
    deep     ours, merged units                         49               101
    deep     ours, unit per module                      97               197
    deep     FSDP2                                      49               146

Then repeated blocks as units (the children of a ModuleList/Sequential that repeat a class, one
unit each, whole), the prefetches launched at one use sharing one all-gather (up to
stage3_prefetch_bucket_size) and consecutive units sharing one gradient reduction (up to
reduce_bucket_size, a unit never split), counted 2026-11-27 15:47 (issue 27, branch s4-blocks)
with --steps 5 --unit-min-numel 16384 0, main beside it in the same minutes (load average 6-10:
step times only rough, ratios within one run):

    model    implementation                 units  collectives/step (main -> blocks)
    encoder  ours, merged units                 7                  17 -> 6
    encoder  ours, unit per module             37                  77 -> 6
    encoder  FSDP2                              7                  20
    deep     ours, merged units                49                 101 -> 6
    deep     ours, unit per module             97                 197 -> 6
    deep     FSDP2                             49                 146

Then the rank agreement folded into the gathers (issue 27, branch s5-agree: from a trace's
second replay on, each gather carries a 40-byte header instead of a check per launch; one check
per pass remains, at its end), counted 2026-11-27 with --steps 5 --unit-min-numel 16384 0, the
branch's base (74a15c7) at 17:23 and the branch at 18:10 (load average 2 and 26: step times not
comparable):

    model    implementation                 units  collectives/step (base -> folded)
    encoder  ours, merged units                 7                   6 -> 5
    encoder  ours, unit per module             37                   6 -> 5
    encoder  FSDP2                              7                  20
    deep     ours, merged units                49                   6 -> 5
    deep     ours, unit per module             97                   6 -> 5
    deep     FSDP2                             49                 146
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import run_on_ranks  # noqa: E402

OURS3 = "deepspeed_cpp ZeRO-3"
FSDP2 = "FSDP2 (fully_shard per layer)"


def make_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "encoder":
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        body = torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        return torch.nn.Sequential(body, torch.nn.Linear(64, 8))
    if name == "deep":
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU())
            for _ in range(48)
        ]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(256, 8))
    raise ValueError(f"unknown model {name!r}")


def make_input(name: str, generator: torch.Generator) -> torch.Tensor:
    if name == "encoder":
        return torch.randn(4, 16, 64, generator=generator)
    return torch.randn(32, 256, generator=generator)


def layers_of(model: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    if name == "encoder":
        return list(model[0].layers)
    return list(model)[:-1]


def collectives_so_far() -> int:
    """The sum of every live process group's sequence number."""
    total = 0
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            total += int(group._get_sequence_number_for_group())
        except RuntimeError:
            pass
    return total


def build(kind: str, model_name: str, persistence: int, unit_min_numel: int | None = None):
    """(step function, closer) of one implementation over a fresh model."""
    model = make_model(model_name)
    if kind == OURS3:
        import deepspeed_cpp

        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence},
            "steps_per_print": 10**9,
        }
        if unit_min_numel is not None:
            config["zero_optimization"]["stage3_unit_min_numel"] = unit_min_numel
        engine, *_ = deepspeed_cpp.initialize(model=model, config=config)

        def step(x):
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()

        return step, engine.destroy, len(engine._zero_stage.coordinator.units)
    from torch.distributed.fsdp import fully_shard

    for layer in layers_of(model, model_name):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x):
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, lambda: None, len(layers_of(model, model_name)) + 1


def worker(rank: int, args) -> list:
    rows = []
    generator = torch.Generator().manual_seed(rank)
    variants = [(OURS3, n) for n in args.unit_min_numel or [None]] + [(FSDP2, None)]
    for model_name in args.models:
        for kind, unit_min_numel in variants:
            step, close, units = build(kind, model_name, args.persistence, unit_min_numel)
            counts, times = [], []
            for index in range(args.warmup + args.steps):
                x = make_input(model_name, generator)
                dist.barrier()
                before = collectives_so_far()
                start = time.perf_counter()
                step(x)
                elapsed = time.perf_counter() - start
                after = collectives_so_far()
                if index >= args.warmup:
                    counts.append(after - before)
                    times.append(elapsed)
            close()
            label = kind if unit_min_numel is None else f"{kind}, min unit {unit_min_numel}"
            rows.append((model_name, label, units, max(counts), statistics.median(times)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--persistence", type=int, default=0)
    parser.add_argument("--models", nargs="+", default=["encoder", "deep"])
    parser.add_argument(
        "--unit-min-numel",
        type=int,
        nargs="*",
        help="ours once per value of stage3_unit_min_numel (unset: the default, not given)",
    )
    args = parser.parse_args()
    rows = run_on_ranks(args.procs, worker, args)[0]
    print(f"{args.procs} gloo processes; step = forward + backward + optimizer step")
    print(f"{'model':8} {'implementation':48} {'units':>5} {'collectives/step':>16} {'step ms':>8}")
    for model_name, kind, units, count, seconds in rows:
        print(f"{model_name:8} {kind:48} {units:5d} {count:16d} {seconds * 1e3:8.1f}")


if __name__ == "__main__":
    main()
