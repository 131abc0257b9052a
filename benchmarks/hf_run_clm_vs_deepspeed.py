"""transformers' own ``examples/pytorch/language-modeling/run_clm.py``, unmodified, under
deepspeed_cpp's ``import deepspeed`` alias and under real DeepSpeed, at ZeRO-2 and ZeRO-3 (also
with CPU offload) on 2 gloo ranks (numbers for the issue note, not CI: ``datasets`` and
``evaluate`` are not in CI).

    python benchmarks/hf_run_clm_vs_deepspeed.py --run-clm PATH/run_clm.py \
        [--extra-path /work/hf_extra] [--deepspeed-path /work/ds_target] [--stages 2 3 3-offload]

``--run-clm``: the file from transformers' repository (not shipped here: it is their code).
``--stages``: any of 2, 3 and 3-offload (the ZeRO-3 template with ``offload_param`` and
``offload_optimizer`` on the CPU), all by default. ``--extra-path``: a folder with ``datasets``
and ``evaluate`` (``pip install --target``), put on PYTHONPATH after this repository /
DeepSpeed. Everything is local: a tiny GPT-2 and a word-level
tokenizer saved with ``save_pretrained``, a generated text file as ``--train_file`` and
``--validation_file`` (``--do_train`` only: ``--do_eval`` makes run_clm fetch the "accuracy"
metric from the Hub), the guide's ``"auto"`` configs. Ours: ``python -m deepspeed_cpp.launcher
--alias-deepspeed run_clm.py ...``; DeepSpeed: ``torch.distributed.run`` of this file's
``--shim``, which makes accelerate choose gloo on a machine without a GPU (as our alias does)
and then runs run_clm.py as ``__main__``. Printed per stage: both libraries' logged losses (from
the ``trainer_state.json`` run_clm saves), learning rates, and the largest loss difference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_guide_vs_deepspeed import REPO_ROOT, free_port, gloo_for_accelerate  # noqa: E402

WORDS = ("the cat dog sat ran on under a mat log big small red blue quickly slowly and then "
         "it was again home tree bird sang").split()  # fmt: skip
BLOCK, MICRO, STEPS, LR = 16, 2, 6, 5e-3
ENGINE_LINES = {
    "ours": r"deepspeed_cpp: engine ready: ZeRO stage \d[^\n]*",
    "deepspeed": r"real DeepSpeed [^\n]*",
}


def guide_config(case: str) -> dict:
    """The guide's ZeRO-2 / ZeRO-3 templates, "auto" wherever it writes "auto"; "3-offload" is
    its ZeRO-3 template with parameters and optimizer state offloaded to the CPU."""
    stage = int(case[0])
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": "auto"}  # fmt: skip
    if case.endswith("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 2:
        zero.update(allgather_partitions=True, allgather_bucket_size=2e8, reduce_scatter=True)
    else:
        zero.update(sub_group_size=1e9, stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto", stage3_max_live_parameters=1e9,
                    stage3_max_reuse_distance=1e9,
                    stage3_gather_16bit_weights_on_model_save=True)  # fmt: skip
    return {
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },  # fmt: skip
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
            },
        },  # fmt: skip
        "zero_optimization": zero,
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 2000,
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "wall_clock_breakdown": False,
    }


def save_inputs(folder: Path) -> None:
    """A tiny GPT-2 and a word-level tokenizer over WORDS, saved as a Hub folder would hold
    them, and train/validation text files of generated sentences."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    rng = random.Random(0)
    for name, lines in (("train.txt", 160), ("validation.txt", 32)):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
                         for _ in range(lines))  # fmt: skip
        (folder / name).write_text(text + "\n")
    vocab = {word: i for i, word in enumerate(["<unk>", "<eos>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        eos_token="<eos>", model_max_length=BLOCK * 2)  # fmt: skip
    tokenizer.save_pretrained(folder / "gpt2")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(vocab), n_positions=BLOCK * 2, n_embd=32, n_layer=2,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=1, eos_token_id=1)  # fmt: skip
    GPT2LMHeadModel(config).save_pretrained(folder / "gpt2")


def run_clm_args(folder: Path, case: str, out: Path) -> list[str]:
    config = folder / f"ds_config_zero{case}.json"
    config.write_text(json.dumps(guide_config(case)))
    return [
        "--model_name_or_path", str(folder / "gpt2"),
        "--train_file", str(folder / "train.txt"),
        "--validation_file", str(folder / "validation.txt"),
        "--do_train", "--block_size", str(BLOCK),
        "--per_device_train_batch_size", str(MICRO), "--max_steps", str(STEPS),
        "--learning_rate", str(LR), "--warmup_steps", "2", "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_pin_memory", "false", "--seed", "42",
        "--deepspeed", str(config), "--output_dir", str(out),
    ]  # fmt: skip


def run(engine: str, run_clm: Path, args: list[str], paths: argparse.Namespace, cache: Path):
    # The datasets cache is not named "deepspeed": cwd is on sys.path, the alias would see it.
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(cache / f"datasets_cache_{engine}"),
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    port = str(free_port())
    if engine == "ours":
        env["PYTHONPATH"] = f"{REPO_ROOT}:{paths.extra_path}"
        command = [sys.executable, "-m", "deepspeed_cpp.launcher", "--num_procs", "2",
                   "--master_port", port, "--alias-deepspeed", str(run_clm), *args]  # fmt: skip
    else:
        env.update(PYTHONPATH=f"{paths.deepspeed_path}:{paths.extra_path}", DS_ACCELERATOR="cpu")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", port, __file__, "--shim", str(run_clm), *args]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=cache)
    state = Path(args[args.index("--output_dir") + 1]) / "trainer_state.json"
    if done.returncode != 0 or not state.exists():
        return {"error": (done.stdout + done.stderr)[-4000:]}
    logs = json.loads(state.read_text())["log_history"]
    # Which library trained, and at which stage: the line each one logs as it builds the engine.
    found = re.search(ENGINE_LINES[engine], done.stdout + done.stderr)
    return {
        "engine_line": found.group(0) if found else "(no engine line found)",
        "losses": [entry["loss"] for entry in logs if "loss" in entry],
        "lrs": [entry["learning_rate"] for entry in logs if "learning_rate" in entry],
        "train_loss": next(entry["train_loss"] for entry in logs if "train_loss" in entry),
    }


def _announce_deepspeed_engines() -> None:
    """In the shim: say on rank 0 which DeepSpeed built the Trainer's engine, and its stage
    (accelerate looks ``deepspeed.initialize`` up when it prepares the model)."""
    import deepspeed

    build = deepspeed.initialize

    def initialize(*args, **kwargs):
        built = build(*args, **kwargs)
        if int(os.environ.get("RANK", "0")) == 0:
            where = Path(deepspeed.__file__).parent
            stage = built[0].zero_optimization_stage()
            print(f"real DeepSpeed {deepspeed.__version__} ({where}): ZeRO stage {stage}")
        return built

    deepspeed.initialize = initialize


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--shim":
        gloo_for_accelerate()
        _announce_deepspeed_engines()
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-clm", type=Path, required=True)
    parser.add_argument("--extra-path", default="/work/hf_extra")
    parser.add_argument("--deepspeed-path", default="/work/ds_target")
    parser.add_argument("--stages", nargs="+", default=["2", "3", "3-offload"],
                        choices=["2", "3", "3-offload"])  # fmt: skip
    paths = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        save_inputs(folder)
        for stage in paths.stages:
            reports = {}
            for engine in ("ours", "deepspeed"):
                out = folder / f"out_{engine}_{stage}"
                reports[engine] = run(engine, paths.run_clm, run_clm_args(folder, stage, out),
                                      paths, folder)  # fmt: skip
            print(f"== run_clm.py, ZeRO-{stage}, 2 gloo ranks")  # e.g. ZeRO-3-offload
            for engine, name in (("ours", "deepspeed_cpp"), ("deepspeed", "DeepSpeed")):
                report = reports[engine]
                if "error" in report:
                    print(f"  {name:13s} FAILED:\n{report['error']}")
                    continue
                print(f"  {name:13s} losses: {' '.join(f'{v:.6f}' for v in report['losses'])}")
                print(f"  {name:13s} lrs:    {' '.join(f'{v:.6g}' for v in report['lrs'])}")
                print(f"  {name:13s} train_loss {report['train_loss']:.6f}")
                print(f"  {name:13s} log: {report['engine_line']}")
            if all("error" not in r for r in reports.values()):
                ours, theirs = reports["ours"]["losses"], reports["deepspeed"]["losses"]
                gap = max(abs(a - b) for a, b in zip(ours, theirs))
                print(f"  max |loss difference|: {gap:.3g} over {len(ours)} logged steps")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
