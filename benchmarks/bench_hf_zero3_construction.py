"""Peak host memory per rank of transformers' own ZeRO-3 construction under the alias.

    python benchmarks/bench_hf_zero3_construction.py [--layers 16] [--width 768] [--world 2]

Saves a GPT-2 built from a config (fp32, small vocabulary, so that the transformer blocks and not
the embedding hold the weight), then on ``--world`` gloo ranks under ``python -m
deepspeed_cpp.launcher --alias-deepspeed`` runs the guide's non-Trainer pattern
(tests/hf_zero3_guide_job.py: ``HfDeepSpeedConfig`` at stage 3 kept alive, then
``AutoModelForCausalLM.from_pretrained``), and the same call without the config (every rank
builds and loads the whole model) as the reference. Each rank measures the call alone (after a
warm-up ``from_pretrained`` of a tiny model, so imports are not counted): the peak resident set
and the peak anonymous memory, above the resident set before the call. The target for ZeRO-3 is
at most the largest module's parameters whole plus this rank's shards. transformers maps the
checkpoint file on rank 0 (its loader reads every tensor there, the other ranks see shapes only):
those pages are file-backed, count in rank 0's resident set, and are the kernel's to drop, so the
anonymous figure is the one the target speaks of.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
JOB = REPO_ROOT / "tests" / "hf_zero3_guide_job.py"
MIB = 1 << 20
ALIGN = 16  # elements: partition_parameters.SHARD_ALIGNMENT


def _gpt2_config(layers: int, width: int, vocab: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=width, n_layer=layers, n_head=max(1, width // 64)
    )


def _sizes(config, world: int) -> dict:
    """Whole model, largest module's own parameters, this rank's shards (bytes, fp32)."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    largest, shards, total, seen = 0, 0, 0, set()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        largest = max(largest, sum(p.numel() for p in own) * 4)
        for param in own:
            total += param.numel() * 4
            multiple = world * ALIGN
            shards += -(-param.numel() // multiple) * multiple // world * 4
    return {"whole": total, "largest_module": largest, "shards": shards}


def _run(model_dir: Path, warmup_dir: Path, world: int, zero3: bool, reports: Path) -> list[dict]:
    import os
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), MEMORY_ONLY="1")
    env.update(MODEL_DIR=str(model_dir), WARMUP_DIR=str(warmup_dir), REPORT_DIR=str(reports))
    env["ZERO3"] = "1" if zero3 else "0"
    command = [
        sys.executable, "-m", "deepspeed_cpp.launcher", "--num_gpus", str(world),
        "--master_port", str(port), "--alias-deepspeed", str(JOB),
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(run.stdout[-4000:] + run.stderr[-4000:])
    return [json.loads((reports / f"rank{r}.json").read_text())["memory"] for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import GPT2LMHeadModel

    config = _gpt2_config(args.layers, args.width, args.vocab)
    sizes = _sizes(config, args.world)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(tmp / "model")
        GPT2LMHeadModel(_gpt2_config(1, 64, 64)).save_pretrained(tmp / "warmup")
        results = {
            name: _run(tmp / "model", tmp / "warmup", args.world, zero3, tmp / name)
            for name, zero3 in (("zero3", True), ("whole", False))
        }
    bound = sizes["largest_module"] + sizes["shards"]
    print(
        f"GPT-2 {args.layers} layers x {args.width} wide, vocab {args.vocab}: whole model "
        f"{sizes['whole'] / MIB:.1f} MiB, largest module {sizes['largest_module'] / MIB:.1f} MiB, "
        f"shards per rank {sizes['shards'] / MIB:.1f} MiB; target per rank (largest + shards) "
        f"{bound / MIB:.1f} MiB; {args.world} gloo ranks"
    )
    print(f"{'route':<34}{'rank':>5}{'peak RSS':>12}{'peak anon':>12}{'anon/target':>13}")
    for name, label in (
        ("zero3", "ZeRO-3 from_pretrained (alias)"),
        ("whole", "from_pretrained, no ZeRO-3"),
    ):
        for rank, memory in enumerate(results[name]):
            rss = memory["peak_rss_mib"]
            rss_text = "n/a" if rss is None else f"{rss:.1f} MiB"
            anon = memory["peak_anon_mib"]
            print(f"{label:<34}{rank:>5}{rss_text:>12}{anon:>8.1f} MiB{anon * MIB / bound:>12.2f}x")


if __name__ == "__main__":
    main()
