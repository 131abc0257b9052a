"""A Hugging Face Trainer script, written as for transformers + DeepSpeed, with one line changed.

    python train_tiny_gpt2.py --deepspeed ds_config.json --output_dir out     # one process
    python -m deepspeed_cpp.launcher --num_procs 2 train_tiny_gpt2.py \
        --deepspeed ds_config.json --output_dir out
    torchrun --nproc_per_node 2 train_tiny_gpt2.py --deepspeed ds_config.json --output_dir out

With transformers' import (the commented line) instead of ours, the script as Hugging Face users
have it, the ``import deepspeed`` alias runs it on transformers' own DeepSpeed path:

    python -m deepspeed_cpp.launcher --num_gpus 2 --alias-deepspeed train_tiny_gpt2.py \
        --deepspeed ds_config.json --output_dir out

A tiny GPT-2 built from a config and a seeded token data set (no downloads). The main process
writes ``summary.json`` (losses, learning rates, world size) into the output folder. The tests
import ``tiny_gpt2`` and ``token_dataset`` from here, so the script and the tests train the same
thing.
"""

import json
import os
from dataclasses import dataclass

import torch
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser

# from transformers import Trainer, TrainingArguments
from deepspeed_cpp.hf import Trainer, TrainingArguments


@dataclass
class DataArguments:
    samples: int = 64
    sequence_length: int = 12
    vocab_size: int = 64


def tiny_gpt2(vocab_size: int = 64, sequence_length: int = 12) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 with tied input/output embeddings and no dropout (so that runs compare
    exactly); the same weights every call."""
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=max(16, sequence_length),
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


def token_dataset(
    samples: int = 64, sequence_length: int = 12, vocab_size: int = 64, seed: int = 7
) -> list[dict]:
    """Random token rows (a language-model batch: labels are the inputs), fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (samples, sequence_length), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]


def main():
    data_args, training_args = HfArgumentParser(
        (DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    model = tiny_gpt2(data_args.vocab_size, data_args.sequence_length)
    dataset = token_dataset(data_args.samples, data_args.sequence_length, data_args.vocab_size)

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        summary = {
            "world_size": training_args.world_size,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "learning_rates": [
                e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e
            ],
        }
        with open(os.path.join(training_args.output_dir, "summary.json"), "w") as handle:
            json.dump(summary, handle)


if __name__ == "__main__":
    main()
