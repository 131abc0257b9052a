"""Training jobs for the Hugging Face Trainer tests: tiny models built from configs (the GPT-2
and its token data set are the example script's own, examples/hf_trainer/train_tiny_gpt2.py), and
one function that trains with deepspeed_cpp's Trainer (in the pool's ranks) or with
transformers' own Trainer (the one-process reference); the tests' world and micro-batch, and the
guide's "auto" config (``auto_config``)."""

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
WORLD = 2  # the tests' ranks (the pool's)
MICRO = 4  # per-rank micro-batch of the tests' Trainer runs


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


class RegressionOutOfMemoryAbove(ScalarRegression):
    """ScalarRegression whose forward fails as a GPU does when a batch of more than ``LIMIT``
    samples does not fit: torch.OutOfMemoryError with CUDA's message, which is what
    accelerate's batch-size finder recognises. Records the batch sizes it was given."""

    LIMIT = 4

    def __init__(self):
        super().__init__()
        self.batch_sizes_tried = []

    def forward(self, input_x, labels=None):
        size = input_x.shape[0]
        if not self.batch_sizes_tried or self.batch_sizes_tried[-1] != size:
            self.batch_sizes_tried.append(size)
        if size > self.LIMIT:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {size * 512} MiB. GPU 0 has a total "
                "capacity of 79.19 GiB of which 20.00 MiB is free."
            )
        return super().forward(input_x, labels)


MODELS = {
    "gpt2": (tiny_gpt2, token_dataset),
    "t5": (tiny_t5, token_dataset),
    "llama": (tiny_llama, token_dataset),
    "regression": (ScalarRegression, regression_dataset),
    "regression_oom": (RegressionOutOfMemoryAbove, regression_dataset),
}


def run_trainer(spec: dict) -> dict:
    """Trains per ``spec`` and returns the logged losses, learning rates and gradient norms, the
    world size the arguments saw, what the engine held, and (rank 0) the final weights.

    spec: output_dir, deepspeed (a ds_config dict, or None for transformers' own Trainer),
    model (a key of MODELS; "gpt2" by default), micro (per-device batch), accumulation,
    max_steps, save_steps (0: no checkpoints), save_at (steps to save at besides save_steps),
    resume (None, True or a path), optim_args (extra TrainingArguments), trains (how many
    train() calls, 1 by default; "calls" then holds each call's log), new_trainer_each_train
    (each call after the first on a new Trainer holding the trained model), save_model
    (``trainer.save_model()`` into output_dir after training).
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

    def new_trainer():
        return trainer_class(
            model=model,
            args=args,
            optimizers=optimizers,
            train_dataset=build_dataset(),
            eval_dataset=build_dataset(seed=3)[:16] if evaluate else None,
            callbacks=[_SaveAt(save_at)] if save_at else None,
        )

    trainer = new_trainer()
    calls = []
    for call in range(spec.get("trains", 1)):
        if call and spec.get("new_trainer_each_train"):
            trainer = new_trainer()
        trainer.train(resume_from_checkpoint=spec.get("resume"))
        calls.append([entry for entry in trainer.state.log_history if "loss" in entry])
    history = calls[-1]
    if spec.get("save_model"):
        trainer.save_model()  # into output_dir, as a script ends
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
        "calls": calls,
        "train_batch_size": trainer.state.train_batch_size,
        "batch_sizes_tried": list(getattr(model, "batch_sizes_tried", [])),
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
        result["engine_micro_batch"] = engine.train_micro_batch_size_per_gpu()
        state = engine.whole_model_state_dict(rank0_only=True)  # AutoTP slices gathered
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


# The two trials of the hyper-parameter search: a learning rate and a per-device batch each.
SEARCH_CHOICES = {0: (2e-3, 2), 1: (5e-4, 4)}


def hyperparameter_search_trials(spec: dict) -> dict:
    """``trainer.hyperparameter_search`` (optuna, a grid over SEARCH_CHOICES, so every run tries
    the same two trials in the same order) with tiny_gpt2 from a model_init; per trial: the
    values it set, its logged losses and learning rates, its objective (the eval loss) and, with
    our engine, what the trial's engine was built with.

    spec: output_dir, deepspeed (or None for transformers' own Trainer), batch_scale (the
    per-device batch is the trial's times this: 2 for the one-process reference of 2 ranks).
    """
    import optuna
    import transformers

    from deepspeed_cpp import hf

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    use_engine = spec.get("deepspeed") is not None
    if use_engine:
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    scale = spec.get("batch_scale", 1)
    arguments_class = hf.TrainingArguments if use_engine else transformers.TrainingArguments
    args = arguments_class(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=8,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=42,
        **({"deepspeed": spec["deepspeed"]} if use_engine else {}),
    )
    trainer_class = hf.Trainer if use_engine else transformers.Trainer
    trials = []

    def hp_space(trial):
        learning_rate, batch = SEARCH_CHOICES[trial.suggest_categorical("choice", [0, 1])]
        return {"learning_rate": learning_rate, "per_device_train_batch_size": batch * scale}

    def record_objective(metrics: dict) -> float:
        # Called once a trial has trained and been evaluated, its engine still alive.
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
        record = {
            "learning_rate": trainer.args.learning_rate,
            "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
            "losses": [entry["loss"] for entry in history],
            "learning_rates": [entry["learning_rate"] for entry in history],
            "eval_loss": metrics["eval_loss"],
        }
        engine = getattr(trainer.accelerator, "engine", None)
        if engine is not None:
            record["engine_micro_batch"] = engine.train_micro_batch_size_per_gpu()
            record["engine_optimizer"] = type(engine.optimizer.optimizer).__name__
            record["engine_config_lr"] = trainer.args.deepspeed_cpp_config["optimizer"]["params"][
                "lr"
            ]
        trials.append(record)
        return metrics["eval_loss"]

    trainer = trainer_class(
        model_init=lambda: tiny_gpt2(),  # model_init takes no argument or the trial
        args=args,
        train_dataset=token_dataset(),
        eval_dataset=token_dataset(seed=3)[:16],
    )
    best = trainer.hyperparameter_search(
        hp_space=hp_space,
        compute_objective=record_objective,
        n_trials=2,
        direction="minimize",
        backend="optuna",
        sampler=optuna.samplers.GridSampler({"choice": [0, 1]}, seed=0),
    )
    # Only rank 0 runs the study (the others follow its trials): they get no best run.
    return {
        "trials": trials,
        "best_objective": best.objective if best is not None else None,
        "best_params": best.hyperparameters if best is not None else None,
    }


def auto_config(stage: int, **sections) -> dict:
    """The Hugging Face guide's config with "auto" values, at ZeRO ``stage``, plus ``sections``."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
        **sections,
    }
