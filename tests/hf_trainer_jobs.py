"""Training jobs for the Hugging Face Trainer tests: a tiny GPT-2 from a config, a seeded token
data set, and one function that trains it with deepspeed_cpp's Trainer (in the pool's ranks) or
with transformers' own Trainer (the one-process reference)."""

from __future__ import annotations

import os

import torch

VOCAB, SEQUENCE, SAMPLES = 64, 12, 64


def tiny_gpt2():
    """A 2-layer GPT-2 with tied input/output embeddings, the same weights for a given seed."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1234)
    return GPT2LMHeadModel(config)


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


def token_dataset(seed: int = 7) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def run_trainer(spec: dict) -> dict:
    """Trains per ``spec`` and returns the logged losses, learning rates and gradient norms, the
    world size the arguments saw, what the engine held, and (rank 0) the final weights.

    spec: output_dir, deepspeed (a ds_config dict, or None for transformers' own Trainer),
    micro (per-device batch), accumulation, max_steps, save_steps (0: no checkpoints),
    resume (None, True or a path), optim_args (extra TrainingArguments).
    """
    import transformers

    from deepspeed_cpp import hf

    use_engine = spec.get("deepspeed") is not None
    seq2seq = spec.get("model") == "t5"
    if seq2seq:
        arguments_class = (
            hf.Seq2SeqTrainingArguments if use_engine else transformers.Seq2SeqTrainingArguments
        )
        trainer_class = hf.Seq2SeqTrainer if use_engine else transformers.Seq2SeqTrainer
    else:
        arguments_class = hf.TrainingArguments if use_engine else transformers.TrainingArguments
        trainer_class = hf.Trainer if use_engine else transformers.Trainer
    save_steps = spec.get("save_steps", 0)
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
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=42,
        **extra,
    )
    if spec.get("zero_init"):
        model = _partitioned_tiny_gpt2(spec["deepspeed"])
    else:
        model = tiny_t5() if seq2seq else tiny_gpt2()
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
        train_dataset=token_dataset(),
        eval_dataset=token_dataset(seed=3)[:16] if evaluate else None,
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
