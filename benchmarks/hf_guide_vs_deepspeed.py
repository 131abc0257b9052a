"""The Hugging Face DeepSpeed guide's ZeRO-3 routes, deepspeed_cpp under its alias beside real
DeepSpeed, side by side (numbers for the issue note, not CI).

    python benchmarks/hf_guide_vs_deepspeed.py [--deepspeed-path /work/ds_target] [CASE ...]

Each case is one script, written as a user of ``import deepspeed`` and transformers writes it,
run twice on 2 gloo ranks: under ``python -m deepspeed_cpp.launcher --alias-deepspeed`` (ours)
and under ``torch.distributed.run`` with DeepSpeed importable (``DS_ACCELERATOR=cpu``; its
accelerate made to pick gloo, as our alias does on a machine without a GPU). Tiny models built
from configs and saved locally first (no downloads; token ids instead of a tokenizer):

- ``gpt2_zero3``: the stock ``Trainer`` with ``deepspeed=`` a stage-3 config, the model from
  ``from_pretrained`` of the saved GPT-2 (so transformers builds it under zero.Init), 4 steps;
- ``gpt2_zero3_offload``: the same with ``offload_param`` (and ``offload_optimizer``) on the CPU;
- ``t5_seq2seq_zero3``: ``Seq2SeqTrainer`` (run_translation's trainer) on a tiny T5, 4 steps;
- ``llama_zero3``: a tiny ``LlamaConfig``, ``HfDeepSpeedConfig`` then ``from_config``, then
  ``deepspeed.initialize`` and 2 steps;
- ``t0_inference``: the guide's ``t0.py`` (ZeRO Inference: stage 3, ``offload_param`` cpu,
  ``from_pretrained`` under ``HfDeepSpeedConfig``, ``deepspeed.initialize(...)[0].module``,
  ``generate(synced_gpus=True)``, each rank its own input) on a tiny T5.

Printed per case: each engine's logged losses (rank 0) or generated token ids, and the largest
difference. transformers' own ``run_clm.py`` needs ``datasets`` and ``evaluate``, which the
project venv lacks; the Trainer cases here are its training path without the data loading.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES = ("gpt2_zero3", "gpt2_zero3_offload", "t5_seq2seq_zero3", "llama_zero3", "t0_inference")
STEPS, MICRO, SEQ, VOCAB, LR = 4, 2, 16, 96, 5e-3


def stage3(offload: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    if offload:
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    return config


# --- models, saved once by the driver ----------------------------------------------------------


def save_models(directory: Path) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ).save_pretrained(directory / "gpt2")  # fmt: skip
    torch.manual_seed(1)
    T5ForConditionalGeneration(
        T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                 dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ).save_pretrained(directory / "t5")  # fmt: skip


# --- the worker: one rank of one case, one engine --------------------------------------------


def gloo_for_accelerate() -> None:
    """accelerate 1.15 gives its DeepSpeed mode no backend on a machine without a GPU; choose
    gloo (what its CPU path picks), for real DeepSpeed only (our alias does the same)."""
    from accelerate.state import DistributedType, PartialState

    chosen = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        picked, kind = chosen(self, cpu, sagemaker_dp, backend)
        if picked is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "gloo", DistributedType.MULTI_CPU
        return picked, kind

    PartialState._prepare_backend = prepare_backend


def _tokens(rows: int, seed: int):
    import torch

    return torch.randint(2, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _trainer_case(case: str, models: Path, out: Path) -> dict:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        Trainer,
        TrainingArguments,
    )

    world = int(os.environ["WORLD_SIZE"])
    seq2seq = case.startswith("t5")
    arguments = dict(
        output_dir=str(out / case), per_device_train_batch_size=MICRO, max_steps=STEPS,
        learning_rate=LR, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_pin_memory=False, ddp_backend="gloo", seed=42,
        deepspeed=stage3(offload=case.endswith("offload")),
    )  # fmt: skip
    args = (Seq2SeqTrainingArguments if seq2seq else TrainingArguments)(**arguments)
    # After TrainingArguments: it sets up the live stage-3 config that from_pretrained reads.
    if seq2seq:
        model = AutoModelForSeq2SeqLM.from_pretrained(models / "t5")
        sources, targets = _tokens(STEPS * MICRO * world, 7), _tokens(STEPS * MICRO * world, 8)
        data = [{"input_ids": s, "labels": t[:8]} for s, t in zip(sources, targets)]
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=data)
    else:
        model = AutoModelForCausalLM.from_pretrained(models / "gpt2")
        data = [{"input_ids": r, "labels": r} for r in _tokens(STEPS * MICRO * world, 7)]
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    logs = trainer.state.log_history
    return {
        "losses": [e["loss"] for e in logs if "loss" in e],
        "lrs": [e["learning_rate"] for e in logs if "learning_rate" in e],
    }


def _llama_case() -> dict:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import HfDeepSpeedConfig

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - the guide: keep this object alive
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(3)
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=SEQ)  # fmt: skip
    model = AutoModelForCausalLM.from_config(llama)
    parameters = model.parameters()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters, config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tokens = _tokens(2 * MICRO * world, 11)
    losses = []
    for step in range(2):
        rows = tokens[(step * world + rank) * MICRO : (step * world + rank + 1) * MICRO]
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


def _t0_case(models: Path) -> dict:
    # The guide's t0.py, its two CUDA device lines dropped (CPU), a tiny local T5 and token ids.
    import deepspeed
    import torch
    from transformers import AutoModelForSeq2SeqLM
    from transformers.integrations import HfDeepSpeedConfig

    local_rank = int(os.getenv("LOCAL_RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    deepspeed.init_distributed(dist_backend="gloo")
    ds_config = {
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 32 * 32,
            # The guide writes 0.9 * hidden * hidden, a float that DeepSpeed 0.19.8's config
            # refuses (pydantic int_from_float) for this and for T0's sizes alike: int() added.
            "stage3_prefetch_bucket_size": int(0.9 * 32 * 32),
            "stage3_param_persistence_threshold": 10 * 32,
        },
        "steps_per_print": 2000,
        "train_batch_size": 1 * world_size,
        "train_micro_batch_size_per_gpu": 1,
        "wall_clock_breakdown": False,
    }
    dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - keep this object alive
    model = AutoModelForSeq2SeqLM.from_pretrained(models / "t5")
    ds_engine = deepspeed.initialize(model=model, config_params=ds_config)[0]
    ds_engine.module.eval()
    inputs = _tokens(world_size, 21)[local_rank : local_rank + 1]
    with torch.no_grad():
        outputs = ds_engine.module.generate(inputs, synced_gpus=True, max_new_tokens=8)
    return {"generated": outputs[0].tolist()}


def worker(case: str, engine: str, models: Path, out: Path) -> None:
    if engine == "deepspeed":
        gloo_for_accelerate()
    if case == "llama_zero3":
        report = _llama_case()
    elif case == "t0_inference":
        report = _t0_case(models)
    else:
        report = _trainer_case(case, models, out)
    import deepspeed

    report["deepspeed_module"] = f"{deepspeed.__name__} {deepspeed.__version__}"
    rank = int(os.environ["RANK"])
    (out / f"{case}_{engine}_rank{rank}.json").write_text(json.dumps(report))


# --- the driver ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(case: str, engine: str, models: Path, out: Path, ds_path: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tail = [__file__, "--worker", case, engine, str(models), str(out)]
    if engine == "ours":
        env["PYTHONPATH"] = str(REPO_ROOT)
        launch = ["-m", "deepspeed_cpp.launcher", "--num_procs", "2", "--alias-deepspeed"]
        command = [sys.executable, *launch, "--master_port", str(free_port()), *tail]
    else:
        env.update(PYTHONPATH=ds_path, DS_ACCELERATOR="cpu")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                   "--master_port", str(free_port()), *tail]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
    path = out / f"{case}_{engine}_rank0.json"
    if done.returncode != 0 or not path.exists():
        return {"error": (done.stdout + done.stderr)[-3000:]}
    return json.loads(path.read_text())


def _row(values) -> str:
    return " ".join(f"{v:.6f}" if isinstance(v, float) else str(v) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=4, metavar=("CASE", "ENGINE", "MODELS", "OUT"))
    parser.add_argument("--deepspeed-path", default="/work/ds_target")
    parser.add_argument("cases", nargs="*", default=list(CASES))
    args, _ = parser.parse_known_args()  # launchers may add --local_rank
    if args.worker:
        case, engine, models, out = args.worker
        worker(case, engine, Path(models), Path(out))
        return
    with tempfile.TemporaryDirectory() as scratch:
        models, out = Path(scratch) / "models", Path(scratch) / "out"
        out.mkdir()
        save_models(models)
        for case in args.cases:
            ours = run(case, "ours", models, out, args.deepspeed_path)
            theirs = run(case, "deepspeed", models, out, args.deepspeed_path)
            print(f"== {case}")
            for name, report in (("deepspeed_cpp", ours), ("DeepSpeed", theirs)):
                if "error" in report:
                    print(f"  {name:13s} FAILED:\n{report['error']}")
                    continue
                key = "generated" if "generated" in report else "losses"
                print(f"  {name:13s} {key}: {_row(report[key])}  ({report['deepspeed_module']})")
                if "lrs" in report:
                    print(f"  {name:13s} lrs: {_row(report['lrs'])}")
            if "error" not in ours and "error" not in theirs:
                key = "generated" if "generated" in ours else "losses"
                if key == "generated":
                    print(f"  same generations: {ours[key] == theirs[key]}")
                else:
                    gap = max(abs(a - b) for a, b in zip(ours[key], theirs[key]))
                    print(f"  max |loss difference|: {gap:.3g} over {len(ours[key])} logged")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
