"""DeepSpeed's ``deepspeed.checkpoint.ds_to_universal`` (``main(args)``, ``python -m
deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...``).

DeepSpeed converts a ZeRO checkpoint to its "universal" layout (one folder per parameter) to
resume at another world size or ZeRO stage. deepspeed_cpp needs no conversion for that: its
checkpoints carry each parameter's name, shape, owner and offset and reshard at load
(``engine.load_checkpoint`` at any world size and stage), and its ``load_checkpoint`` reads
DeepSpeed's own checkpoint folders too. No universal folder is written: ``main`` raises
``UniversalCheckpointNotNeeded`` (a NotImplementedError) naming the input folder and what to
do instead, rather than writing a folder nothing here would read.
"""

from __future__ import annotations

import argparse
import os


class UniversalCheckpointNotNeeded(NotImplementedError):
    """``ds_to_universal`` was asked to convert a checkpoint; deepspeed_cpp loads it as it is."""


def parse_arguments(argv=None) -> argparse.Namespace:
    """DeepSpeed's command line: ``--input_folder``, ``--output_folder`` and its options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_folder", type=str, required=True)
    parser.add_argument("--output_folder", type=str, required=True)
    parser.add_argument("--num_extract_workers", type=int, default=4)
    parser.add_argument("--num_merge_workers", type=int, default=2)
    parser.add_argument("--keep_temp_folder", action="store_true")
    parser.add_argument("--no_strict", dest="strict", action="store_false")
    parser.add_argument("--inject_missing_state", action="store_true")
    return parser.parse_args(argv)


def main(args) -> None:
    """Refuses with the way to resume at another world size or stage (see the module text)."""
    folder = getattr(args, "input_folder", None)
    if not folder or not os.path.isdir(folder):
        raise FileNotFoundError(
            f"ds_to_universal: input_folder={folder!r} is not a checkpoint folder (a tag folder "
            "written by engine.save_checkpoint)"
        )
    raise UniversalCheckpointNotNeeded(
        f"ds_to_universal: {folder!r} is not converted: deepspeed_cpp resumes a checkpoint at any "
        "world size and ZeRO stage as it is. Call engine.load_checkpoint(<save folder>, "
        f"tag={os.path.basename(os.path.normpath(folder))!r}) with the new configuration (leave "
        "checkpoint.load_universal unset); zero_to_fp32 gives a plain fp32 state_dict"
    )


if __name__ == "__main__":
    main(parse_arguments())
