"""One GPU, a ~1B-parameter model: step time of ZeRO-3 (optimizer on the GPU) and of ZeRO-3 with
the optimizer offloaded to the CPU, beside plain PyTorch (bf16 autocast, fp32 weights, fused
AdamW) and the PCIe bandwidth of a pinned ``copy_`` of the bytes the offload moves.

Per configuration: forward, backward and optimizer-step times (CUDA synchronised, median of the
measured steps after a warm-up), and the whole step. For the offload rows the table also prints
the extra time of backward and step against the in-GPU run, next to what pinned ``copy_``s of
the bytes the offload moves (bf16 gradients down, bf16 parameters up) take alone. Without a CUDA
device it says so and exits.

    python benchmarks/bench_gpu_zero3.py [--hidden 4096] [--blocks 8] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


class Block(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_model(hidden: int, blocks: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = torch.nn.Sequential(*[Block(hidden) for _ in range(blocks)])
    return model.to(dtype)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(forward, backward, step, warmup: int, steps: int) -> dict:
    rows = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = forward()
        torch.cuda.synchronize()
        middle = time.perf_counter()
        backward(loss)
        torch.cuda.synchronize()
        end = time.perf_counter()
        out = {"forward": middle - start, "backward": end - middle, "step": timed(step)}
        if i >= warmup:
            rows.append(out)
    return {k: statistics.median(r[k] for r in rows) for k in ("forward", "backward", "step")}


def run_torch(args, x) -> dict:
    model = make_model(args.hidden, args.blocks, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).float().pow(2).mean()

    result = measure(forward, lambda loss: loss.backward(),
                     lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)),
                     args.warmup, args.steps)  # fmt: skip
    optimizer.state.clear()
    return result


def run_ours(args, x, offload: bool, stage: int = 3) -> dict:
    import deepspeed_cpp

    zero = {"stage": stage, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e8}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": zero,
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(args.hidden, args.blocks, torch.bfloat16), config=config
    )
    xb = x.to(torch.bfloat16)
    result = measure(lambda: engine(xb).float().pow(2).mean(), engine.backward, engine.step,
                     args.warmup, args.steps)  # fmt: skip
    result["optimizer"] = type(engine.optimizer).__name__
    engine.destroy()
    torch.cuda.empty_cache()
    return result


def pinned_copy_seconds(nbytes: int) -> tuple[float, float]:
    """(host->device, device->host) seconds of one pinned copy_ of nbytes (median of 5)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    up = statistics.median(timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(5))
    down = statistics.median(timed(lambda: host.copy_(device, non_blocking=True)) for _ in range(5))
    return up, down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip", action="append", default=[], help="torch, zero3, offload")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_zero3: no CUDA device here; nothing measured")
        return 0
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29541")):  # fmt: skip
        os.environ.setdefault(key, value)
    torch.backends.cuda.matmul.allow_tf32 = False
    numel = sum(p.numel() for p in make_model(args.hidden, 1, torch.bfloat16).parameters())
    params = numel * args.blocks
    torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{params / 1e9:.3f}B parameters, {args.tokens} tokens per step")  # fmt: skip
    x = torch.randn(args.tokens, args.hidden, device="cuda")
    rows = {}
    runs = (
        ("torch AdamW(fused) bf16 autocast", "torch", lambda: run_torch(args, x)),
        ("ours ZeRO-3 bf16, optimizer on GPU", "zero3", lambda: run_ours(args, x, False)),
        ("ours ZeRO-3 bf16, optimizer on CPU", "offload", lambda: run_ours(args, x, True)),
    )
    for label, key, run in runs:
        if key in args.skip:
            continue
        torch.cuda.empty_cache()
        try:
            rows[label] = run()
        except Exception as error:  # noqa: BLE001 - the table says what failed
            rows[label] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(f"  {label}: {rows[label]}", flush=True)
    print(f"\n{'configuration':40s} {'fwd ms':>8s} {'bwd ms':>8s} {'step ms':>8s} {'total':>8s}")
    base = None
    for label, row in rows.items():
        if "error" in row:
            print(f"{label:40s} {row['error']}")
            continue
        total = row["forward"] + row["backward"] + row["step"]
        base = base or total
        times = " ".join(f"{row[k] * 1e3:8.1f}" for k in ("forward", "backward", "step"))
        print(f"{label:40s} {times} {total * 1e3:8.1f}  ({total / base:.2f}x the first row)")
    moved = 2 * params  # bf16 bytes each way per step
    up, down = pinned_copy_seconds(moved)
    print(f"\npinned copy_ of {moved / 2**30:.2f} GiB: host->device {up * 1e3:.1f} ms "
          f"({moved / up / 1e9:.1f} GB/s), device->host {down * 1e3:.1f} ms "
          f"({moved / down / 1e9:.1f} GB/s)")  # fmt: skip
    offload = rows.get("ours ZeRO-3 bf16, optimizer on CPU", {})
    in_gpu = rows.get("ours ZeRO-3 bf16, optimizer on GPU", {})
    if "backward" in offload and "backward" in in_gpu:
        extra = offload["backward"] - in_gpu["backward"]
        # Where the gradients' copy to the host happens (during backward or in the step) is the
        # engine's choice: these are the phase times as measured, beside the copy alone.
        print(
            f"offload backward - in-GPU backward: {extra * 1e3:.1f} ms; offload step - in-GPU "
            f"step: {(offload['step'] - in_gpu['step']) * 1e3:.1f} ms; pinned copies of the "
            f"gradients down and the parameters up alone: {(down + up) * 1e3:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
