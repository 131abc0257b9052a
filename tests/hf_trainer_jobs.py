"""Training jobs for the Hugging Face Trainer tests: tiny models built from configs (the GPT-2
and its token data set are the example script's own, examples/hf_trainer/train_tiny_gpt2.py), and
one function that trains with deepspeed_cpp's Trainer (in the pool's ranks) or with
transformers' own Trainer (the one-process reference)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "hf_trainer"))

from train_tiny_gpt2 import tiny_gpt2, token_dataset  # noqa: E402

# Every train() starts with a full gc.collect() (accelerate's free_memory), which walks every
# object torch and transformers created on import: about a second and a half a run on a loaded
# 2-core machine, in the pool's ranks and in the test process alike. Those objects live as long
# as the process, so they are moved out of the collector's sight once (gc.freeze); the objects
# of each run are still collected as usual.
gc.collect()
gc.freeze()

VOCAB = 64


def tiny_t5():
    """A 2-layer T5 encoder-decoder (for the Seq2Seq classes), the same weights every time."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(1234)
    return T5ForConditionalGeneration(config)


def tiny_llama():
    """A 2-layer Llama (RMSNorm, rotary positions, gated MLP, grouped-query attention with one
    key/value head for two query heads, untied output layer), the same weights every time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    return LlamaForCausalLM(config)


class ScalarRegression(torch.nn.Module):
    """y = a * x + b with two 0-dimensional parameters: the smallest model a Trainer takes, and
    an edge case for partitioning (one element per parameter, fewer than the ranks)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Parameter(torch.tensor(-0.25))

    def forward(self, input_x, labels=None):
        prediction = self.a * input_x + self.b
        if labels is None:
            return {"logits": prediction}
        return {"loss": torch.nn.functional.mse_loss(prediction, labels), "logits": prediction}


def regression_dataset(samples: int = 64, seed: int = 11) -> list[dict]:
    """y = 2x + 3 plus noise: the regression model moves towards a = 2, b = 3."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, generator=generator)
    y = 2.0 * x + 3.0 + 0.1 * torch.randn(samples, generator=generator)
    return [{"input_x": xi, "labels": yi} for xi, yi in zip(x, y)]


MODELS = {
    "gpt2": (tiny_gpt2, token_dataset),
    "t5": (tiny_t5, token_dataset),
    "llama": (tiny_llama, token_dataset),
    "regression": (ScalarRegression, regression_dataset),
}


def run_trainer(spec: dict) -> dict:
    """Trains per ``spec`` and returns the logged losses, learning rates and gradient norms, the
    world size the arguments saw, what the engine held, and (rank 0) the final weights.

    spec: output_dir, deepspeed (a ds_config dict, or None for transformers' own Trainer),
    model (a key of MODELS; "gpt2" by default), micro (per-device batch), accumulation,
    max_steps, save_steps (0: no checkpoints), save_at (steps to save at besides save_steps),
    resume (None, True or a path), optim_args (extra TrainingArguments).
    """
    import transformers

    from deepspeed_cpp import hf

    use_engine = spec.get("deepspeed") is not None
    if use_engine:
        # accelerate sets torch's thread count to its own guess (cores / local processes) when
        # OMP_NUM_THREADS is unset; keep the pool's one thread per rank: 2 ranks x 2 threads
        # oversubscribe a 2-core machine, and spinning threads slow every step.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    model_name = spec.get("model", "gpt2")
    build_model, build_dataset = MODELS[model_name]
    seq2seq = model_name == "t5"
    if seq2seq:
        arguments_class = (
            hf.Seq2SeqTrainingArguments if use_engine else transformers.Seq2SeqTrainingArguments
        )
        trainer_class = hf.Seq2SeqTrainer if use_engine else transformers.Seq2SeqTrainer
    else:
        arguments_class = hf.TrainingArguments if use_engine else transformers.TrainingArguments
        trainer_class = hf.Trainer if use_engine else transformers.Trainer
    save_steps = spec.get("save_steps", 0)
    save_at = set(spec.get("save_at", ()))
    extra = dict(spec.get("optim_args", {}))
    if use_engine:
        extra["deepspeed"] = spec["deepspeed"]
    evaluate = spec.get("evaluate", False)
    if evaluate:
        # Evaluate at every checkpoint and reload the "best" at the end. Best is the highest
        # eval loss, so that an earlier checkpoint than the last is reloaded (training lowers it).
        extra.update(
            eval_strategy="steps",
            eval_steps=save_steps,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            greater_is_better=True,
        )
    args = arguments_class(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec.get("micro", 4),
        gradient_accumulation_steps=spec.get("accumulation", 1),
        max_steps=spec.get("max_steps", 6),
        learning_rate=spec.get("learning_rate", 1e-3),
        logging_steps=1,
        save_strategy="steps" if save_steps or save_at else "no",
        save_steps=save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=42,
        **extra,
    )
    if spec.get("zero_init"):
        model = _partitioned_tiny_gpt2(spec["deepspeed"])
    elif spec.get("pretrained"):
        # Straight from a saved folder into ZeRO-3 partitions. As the guide says, the arguments
        # are built first: they keep the stage-3 config alive that the loader asks for.
        model = hf.from_pretrained_zero3(transformers.AutoModelForCausalLM, spec["pretrained"])
        model.train()
    else:
        model = build_model()
    optimizers = (None, None)
    if spec.get("own_optimizer"):
        # The caller's optimizer and schedule (Trainer(optimizers=...)): SGD with momentum and a
        # step decay, neither of which the Trainer or the config would pick.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        optimizers = (optimizer, schedule)
    trainer = trainer_class(
        model=model,
        args=args,
        optimizers=optimizers,
        train_dataset=build_dataset(),
        eval_dataset=build_dataset(seed=3)[:16] if evaluate else None,
        callbacks=[_SaveAt(save_at)] if save_at else None,
    )
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    if evaluate:
        result_evaluation = {
            "eval_losses": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e],
            "best_checkpoint": trainer.state.best_model_checkpoint,
            "final_eval_loss": trainer.evaluate()["eval_loss"],
        }
    engine = getattr(trainer.accelerator, "engine", None) if use_engine else None
    result = {
        "world_size": args.world_size,
        "losses": [entry["loss"] for entry in history],
        "learning_rates": [entry["learning_rate"] for entry in history],
        "grad_norms": [entry.get("grad_norm") for entry in history],
        "global_step": trainer.state.global_step,
        "epoch": trainer.state.epoch,
        # Every per-step log entry whole (loss, grad_norm, learning_rate, epoch, step).
        "log_history": history,
    }
    if evaluate:
        result.update(result_evaluation)
    if engine is not None:
        result["engine_optimizer"] = type(engine.optimizer.optimizer).__name__
        result["engine_scheduler"] = type(engine.lr_scheduler).__name__
        result["zero_stage"] = engine.zero_optimization_stage()
        result["skipped_steps"] = engine.skipped_steps
        result["last_lr"] = trainer.lr_scheduler.get_last_lr()
        result["step_was_skipped"] = trainer.accelerator.optimizer_step_was_skipped
        state = engine.full_module_state_dict(rank0_only=True)
    else:
        state = trainer.model.state_dict()
    rank = int(os.environ.get("RANK", "0"))
    result["weights"] = {k: v.detach().clone() for k, v in state.items()} if rank == 0 else {}
    return result


class _SaveAt(TrainerCallback):
    """Saves a checkpoint after each of the given optimizer steps (besides save_steps')."""

    def __init__(self, steps):
        self.steps = steps

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in self.steps:
            control.should_save = True
        return control


def _partitioned_tiny_gpt2(ds_config: dict):
    """tiny_gpt2 built partitioned (HfDeepSpeedConfig.zero_init at ZeRO-3), then given the same
    initial weights as the unpartitioned one (rank 0's copy, written under GatheredParameters):
    initialising shards draws different random numbers than initialising whole tensors."""
    from deepspeed_cpp import hf, zero

    keeper = hf.HfDeepSpeedConfig(ds_config)
    assert hf.is_deepspeed_zero3_enabled()
    whole = tiny_gpt2().state_dict()
    with keeper.zero_init():
        model = tiny_gpt2()
    embedding = model.transformer.wte.weight
    assert not embedding.ds_persist and embedding.ds_tensor.numel() < embedding.ds_numel
    assert model.lm_head.weight is embedding, "the output embedding stays tied"
    with zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if int(os.environ.get("RANK", "0")) == 0:
            model.load_state_dict(whole)
    return model


def accelerate_world_without_our_fix() -> int:
    """What accelerate's state says when transformers' own TrainingArguments build it under a
    launcher on a machine without a GPU: the pitfall our arguments and accelerator avoid."""
    import transformers

    args = transformers.TrainingArguments(output_dir="/tmp/unused", report_to=[])
    return args.world_size


def partitioned_from_config_statistics() -> dict:
    """AutoModelForCausalLM.from_config under HfDeepSpeedConfig.zero_init() at ZeRO-3, then
    initialize_weights_zero3: statistics of the gathered weights, as this rank sees them."""
    from transformers import AutoModelForCausalLM

    from deepspeed_cpp import hf, zero

    keeper = hf.HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    )
    config = tiny_gpt2().config
    torch.manual_seed(int(os.environ.get("RANK", "0")))  # different streams: rank 0's must win
    with keeper.zero_init():
        model = AutoModelForCausalLM.from_config(config)
    hf.initialize_weights_zero3(model)
    embedding = model.transformer.wte.weight
    with zero.GatheredParameters(list(model.parameters())):
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return {
        "partitioned": not embedding.ds_persist
        and embedding.ds_tensor.numel() < embedding.ds_numel,
        "embedding_std": float(state["transformer.wte.weight"].std()),
        "projection_std": float(state["transformer.h.0.attn.c_proj.weight"].std()),
        "layer_norm_weight": state["transformer.h.0.ln_1.weight"],
        "attention_bias": state["transformer.h.0.attn.c_attn.bias"],
        "state": state,
        "initializer_range": config.initializer_range,
        "layers": config.n_layer,
    }


def load_pretrained_partitioned(folder: str) -> dict:
    """from_pretrained_zero3 at ZeRO-3 (embeddings partitioned): whether the parameters are
    partitioned and tied, and the gathered state, as this rank sees it; then the errors for a
    missing tensor, a wrong shape and no live stage-3 config, as messages."""
    from transformers import AutoModelForCausalLM

    from deepspeed_cpp import hf, zero

    keeper = hf.HfDeepSpeedConfig(
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}
    )
    model = hf.from_pretrained_zero3(AutoModelForCausalLM, folder)
    partitioned = {
        name: hasattr(p, "ds_id") and not p.ds_persist for name, p in model.named_parameters()
    }
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with zero.GatheredParameters(list(model.parameters())):
        state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    errors = {}
    for case in ("missing", "shape"):
        broken = Path(folder + f"-{case}")
        try:
            hf.from_pretrained_zero3(AutoModelForCausalLM, broken)
        except ValueError as error:
            errors[case] = str(error)
    del keeper
    try:
        hf.from_pretrained_zero3(AutoModelForCausalLM, folder)
    except ValueError as error:
        errors["no_config"] = str(error)
    return {
        "partitioned": partitioned,
        "tied": tied,
        "training": model.training,
        "state": state,
        "errors": errors,
    }
