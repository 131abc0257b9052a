"""Trains one small model under every engine configuration of the GPU parity check, on one
device, in one process, and saves the results (tests/test_gpu_engine.py runs it once on CUDA and
once on the CPU and compares the two).

    python tests/gpu_engine_job.py --device cuda --out cuda.pt [--nvme-folder DIR] [--only NAME]

One process is a world of one (NCCL on CUDA, gloo on the CPU: the accelerator's backend). Every
configuration starts from the same seeded weights and sees the same seeded batches, so the CUDA
and CPU runs differ only by the device's arithmetic (matmul sum order, fused kernels).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

STEPS, MICRO_BATCH, SEED = 4, 8, 1234
IN, HIDDEN, MIDDLE, OUT = 37, 203, 101, 13  # odd sizes: every vector tail of the kernels
LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.99), 1e-6, 0.01


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.mid = torch.nn.Linear(HIDDEN, MIDDLE)
        self.out = torch.nn.Linear(MIDDLE, OUT)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.inp(x)))
        return self.out(torch.tanh(self.mid(h)))


def make_model() -> Net:
    torch.manual_seed(SEED)
    return Net()


def batches():
    generator = torch.Generator().manual_seed(SEED + 1)
    return [
        (torch.randn(MICRO_BATCH, IN, generator=generator),
         torch.randn(MICRO_BATCH, OUT, generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip


def configurations(nvme_folder: str) -> dict[str, dict]:
    """name -> (stage, precision, offload_optimizer, offload_param)."""
    cases = {}
    for stage in (0, 1, 2, 3):
        for precision in ("fp32", "bf16", "fp16"):
            cases[f"zero{stage}-{precision}"] = (stage, precision, None, None)
    for stage in (1, 2, 3):
        cases[f"zero{stage}-bf16-offload-cpu"] = (stage, "bf16", {"device": "cpu"}, None)
    nvme = {"device": "nvme", "nvme_path": nvme_folder}
    cases["zero3-bf16-offload-nvme-both"] = (3, "bf16", dict(nvme), dict(nvme))
    return cases


def ds_config(stage: int, precision: str, offload_optimizer, offload_param) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000},
    }
    zero = config["zero_optimization"]
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter really partitioned
    if offload_optimizer is not None:
        zero["offload_optimizer"] = offload_optimizer
    if offload_param is not None:
        zero["offload_param"] = offload_param
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    return config


def run_case(config: dict) -> dict:
    import deepspeed_cpp

    engine, *_ = deepspeed_cpp.initialize(model=make_model(), config=config)
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for x, y in batches():
        x, y = x.to(engine.device, dtype), y.to(engine.device)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    state = engine.full_module_state_dict()
    params = {n: state[n].detach().double().cpu() for n, _ in engine.module.named_parameters()}
    result = {
        "params": params,
        "losses": losses,
        "skipped_steps": int(engine.skipped_steps),
        "param_device": str(next(iter(state.values())).device),
        "engine_device": str(engine.device),
    }
    engine.destroy()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--nvme-folder", default="/tmp/ds_cpp_gpu_nvme")
    parser.add_argument("--only", action="append", default=[])
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533" if args.device == "cuda" else "29534")
    os.makedirs(args.nvme_folder, exist_ok=True)
    torch.set_num_threads(4)
    results, failures = {}, {}
    for name, case in configurations(args.nvme_folder).items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        print(f"[{args.device}] {name}: starting", flush=True)
        try:
            results[name] = run_case(ds_config(*case))
            status = f"ok, losses {[round(v, 5) for v in results[name]['losses']]}"
        except Exception as error:  # noqa: BLE001 - recorded per case, reported by the test
            failures[name] = f"{type(error).__name__}: {error}"
            status = f"FAILED {failures[name]}"
        print(f"[{args.device}] {name}: {status} ({time.perf_counter() - start:.1f} s)", flush=True)
    torch.save({"results": results, "failures": failures}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
