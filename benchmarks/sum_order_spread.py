"""How far one fp32 training run drifts from itself when only the order of a sum changes.

The checkpoint tests compare our engines with ``tests/checkpoint_training.py``'s one-process AdamW
reference (``reference``), which adds gradients in the engine's order for 1 and 2 ranks. Among
3 ranks gloo's all-reduce adds in an order of its own, so those comparisons need a tolerance:
``SUM_ORDER_TOLERANCE``. This script measures its size: for many random model and data seeds it
runs the reference twice in one process, once as it is and once with the 3 ranks' gradients
added in the reverse order, and prints how often the largest relative difference (per tensor,
relative to its largest element, as the tests measure it) passes each threshold. Adam's
m / sqrt(v) enlarges the rounding of a gradient that nearly cancels, so the spread has a long
tail; one step fewer is > 1e-3 away.

    python benchmarks/sum_order_spread.py [--runs 4000] [--worlds 3,3,3,2,2] [--seed 22]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import checkpoint_training as case  # noqa: E402

THRESHOLDS = (1e-7, 1e-6, 3e-6, 1e-5, 3e-5, 1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4000)
    parser.add_argument("--worlds", default="3,3,3,2,2", help="ranks per step, comma-separated")
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    torch.set_num_threads(1)
    worlds = [int(w) for w in args.worlds.split(",")]
    generator = torch.Generator().manual_seed(args.seed)
    spreads = []
    for _ in range(args.runs):
        model_seed, data_seed = (int(v) for v in torch.randint(0, 2**30, (2,), generator=generator))
        as_is = case.reference(model_seed, data_seed, worlds)
        reversed_ = case.reference(model_seed, data_seed, worlds, reverse_ranks=True)
        spreads.append(case.max_relative_difference(reversed_, as_is))
    spreads = torch.tensor(spreads)
    print(f"worlds {worlds}, {args.runs} seeded runs (--seed {args.seed})")
    for threshold in THRESHOLDS:
        print(f"  > {threshold:g}: {int((spreads > threshold).sum())}")
    print(f"  largest: {spreads.max().item():.3g}")
    print(f"  SUM_ORDER_TOLERANCE: {case.SUM_ORDER_TOLERANCE:g}")


if __name__ == "__main__":
    main()
