"""A Hugging Face Trainer script as ``run_clm.py`` is written: transformers' own ``Trainer`` and
``TrainingArguments`` parsed first (so the ``--deepspeed`` config is alive), then the model loaded
with ``AutoModelForCausalLM.from_pretrained``, which at ZeRO-3 builds it under
``deepspeed.zero.Init`` and loads the weights one module at a time. Run under the alias:

    MODEL_DIR=saved_gpt2 python -m deepspeed_cpp.launcher --num_gpus 2 --alias-deepspeed \
        tests/hf_zero3_trainer_job.py --deepspeed ds_config.json --output_dir out ...

The main process writes ``summary.json`` (losses, world size, and whether every parameter was
partitioned when ``from_pretrained`` returned, before the Trainer saw the model).
"""

import json
import os
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "hf_trainer"))
from train_tiny_gpt2 import DataArguments, token_dataset  # noqa: E402


def main():
    data_args, training_args = HfArgumentParser(
        (DataArguments, TrainingArguments)
    ).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(os.environ["MODEL_DIR"])
    partitioned = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    dataset = token_dataset(data_args.samples, data_args.sequence_length, data_args.vocab_size)
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    if trainer.is_world_process_zero():
        summary = {
            "world_size": training_args.world_size,
            "partitioned_at_construction": partitioned,
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        }
        Path(training_args.output_dir, "summary.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
