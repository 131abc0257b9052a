"""A Hugging Face Trainer script, written as for transformers + DeepSpeed, with one line changed.

    python train_tiny_gpt2.py --deepspeed ds_config.json --output_dir out     # one process
    python -m deepspeed_cpp.launcher --num_procs 2 train_tiny_gpt2.py \
        --deepspeed ds_config.json --output_dir out
    torchrun --nproc_per_node 2 train_tiny_gpt2.py --deepspeed ds_config.json --output_dir out

A tiny GPT-2 built from a config and a seeded token data set (no downloads). The main process
writes ``summary.json`` (losses, world size) into the output folder.
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


def main():
    data_args, training_args = HfArgumentParser(
        (DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    config = GPT2Config(
        vocab_size=data_args.vocab_size,
        n_positions=max(16, data_args.sequence_length),
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(
        0,
        data_args.vocab_size,
        (data_args.samples, data_args.sequence_length),
        generator=torch.Generator().manual_seed(7),
    )
    dataset = [{"input_ids": row, "labels": row} for row in tokens]

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        summary = {
            "world_size": training_args.world_size,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        }
        with open(os.path.join(training_args.output_dir, "summary.json"), "w") as handle:
            json.dump(summary, handle)


if __name__ == "__main__":
    main()
