"""What the ranks' set-up agreement costs: initialize() against the check inside it, and
zero.Init's per-module agreement against the model build it guards.

A transformer-like stack (``--layers`` encoder layers of ``--width``, 12 parameters each: 25
layers hold 300 parameters plus the head) is set up on ``--procs`` gloo ranks, ``--repeats``
times. ``initialize()`` is timed whole (ZeRO stage 1, AdamW); the check is timed by calling it
alone with the same arguments, 10 times per build (describing the set-up and the 32-byte
all-gather; describing alone is a row too), and its share of initialize() is printed. The
ZeRO-3 rows time building the model under zero.Init as before the agreement (its step without
the check, one broadcast after the other, reproduced here) and now (one 32-byte all-gather per
module, then the module's broadcasts launched together).

Seen on a busy 2-core machine (3 other developers' builds and tests beside it), 302 parameters:
the check 1.8-4.1 ms, 0.13-0.91% of initialize() (0.45-2.3 s); zero.Init +21..36% at width 128
(5M parameters, latency-bound); at width 512 (79M parameters) no slower: -31% in one run.

    python benchmarks/bench_rank_agreement.py [--procs 2] [--layers 25] [--width 128]
                                              [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks


def _model(layers: int, width: int) -> torch.nn.Module:
    body = [
        torch.nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width)
        for _ in range(layers)
    ]
    return torch.nn.Sequential(*body, torch.nn.Linear(width, 8))


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
    }


def _partition_own_before(self, module: torch.nn.Module) -> None:
    """zero.Init's step before the agreement: each parameter broadcast, nothing checked."""
    from deepspeed_cpp.runtime.zero import partition_parameters as pp

    for param in module.parameters(recurse=False):
        if not pp.is_zero_param(param):
            pp.partition_parameter(
                param,
                self.group,
                persist=param.numel() <= self.persistence_threshold,
                dtype=self.dtype if param.is_floating_point() else None,
                device=self.device,
            )


def _timed(action) -> float:
    dist.barrier()
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _worker(rank: int, layers: int, width: int, repeats: int) -> dict:
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.config import DeepSpeedConfig
    from deepspeed_cpp.runtime.rank_consistency import check_ranks_agree, describe_setup
    from deepspeed_cpp.runtime.zero import partition_parameters

    torch.manual_seed(rank)
    times: dict[str, list[float]] = {}

    def record(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    config = DeepSpeedConfig.load(_config(1), world_size=dist.get_world_size())
    for _ in range(repeats):
        model = _model(layers, width)
        for _ in range(10):  # the check is short: more samples of it
            record("check", _timed(lambda: check_ranks_agree(config, model)))  # noqa: B023
            start = time.perf_counter()
            describe_setup(config, model)
            record("describe", time.perf_counter() - start)
        engine = None

        def build():
            nonlocal engine
            engine, *_ = deepspeed.initialize(model=model, config=_config(1))  # noqa: B023

        record("initialize", _timed(build))
        engine.destroy()

    new_way = partition_parameters.Init._partition_own
    for checked in (True, False) * repeats:
        partition_parameters.Init._partition_own = new_way if checked else _partition_own_before
        key = "zero.Init with agreement" if checked else "zero.Init without"

        def build_partitioned():
            with deepspeed.zero.Init(config_dict_or_path=_config(3)):
                _model(layers, width)

        record(key, _timed(build_partitioned))
    partition_parameters.Init._partition_own = new_way
    model = _model(layers, width)
    return {
        "parameters": len(list(model.parameters())),
        "modules with parameters": sum(
            1 for m in model.modules() if any(True for _ in m.parameters(recurse=False))
        ),
        "times": {key: statistics.median(values) for key, values in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--layers", type=int, default=25)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    options = parser.parse_args()
    results = run_on_ranks(options.procs, _worker, options.layers, options.width, options.repeats)
    # A collective ends when its slowest rank arrives: the slowest rank's median is the cost.
    times = {key: max(r["times"][key] for r in results) for key in results[0]["times"]}
    print(
        f"{options.procs} gloo ranks, {results[0]['parameters']} parameters in "
        f"{results[0]['modules with parameters']} modules, median of {options.repeats}"
    )
    print(f"{'what':<30}{'ms':>10}{'ratio':>12}")
    print(f"{'initialize() (ZeRO stage 1)':<30}{times['initialize'] * 1e3:>10.2f}{'':>12}")
    share = times["check"] / times["initialize"]
    print(f"{'  its rank agreement check':<30}{times['check'] * 1e3:>10.2f}{share:>11.2%}")
    part = times["describe"] / times["initialize"]
    print(f"{'    of which describing':<30}{times['describe'] * 1e3:>10.2f}{part:>11.2%}")
    without, with_check = times["zero.Init without"], times["zero.Init with agreement"]
    print(f"{'zero.Init, before (unchecked)':<30}{without * 1e3:>10.2f}{'':>12}")
    extra = with_check / without - 1.0
    print(f"{'zero.Init, now (agreement)':<30}{with_check * 1e3:>10.2f}{extra:>+11.2%}")


if __name__ == "__main__":
    main()
