"""``python -m deepspeed_cpp.checkpoint.convert SRC_DEEPSPEED_DIR DST_DIR [--tag T]``.

Converts a checkpoint written by DeepSpeed (the folder given to its ``save_checkpoint``, or one
tag folder in it) into deepspeed_cpp's layout once, so later loads read it without the DeepSpeed
reader (``deepspeed_cpp.runtime.checkpoint.deepspeed_format.convert``). Loading the DeepSpeed
folder directly works too; converting is for keeping one format on disk.
"""

from __future__ import annotations

import argparse
import sys

from ..runtime.checkpoint.deepspeed_format.convert import convert_deepspeed_checkpoint
from ..runtime.checkpoint.errors import CheckpointMismatchError, IncompleteCheckpointError

__all__ = ["convert_deepspeed_checkpoint", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_cpp.checkpoint.convert",
        description="Convert a DeepSpeed checkpoint folder into deepspeed_cpp's layout.",
    )
    parser.add_argument("source", help="the DeepSpeed checkpoint folder (holding 'latest'), or "
                        "one of its tag folders")  # fmt: skip
    parser.add_argument("destination", help="a new or empty folder for the converted checkpoint")
    parser.add_argument("-t", "--tag", default=None, help="the tag to convert (default: latest)")
    args = parser.parse_args(argv)
    try:
        written = convert_deepspeed_checkpoint(args.source, args.destination, args.tag)
    except (IncompleteCheckpointError, CheckpointMismatchError, OSError) as error:
        # Named refusals (not found, unsafe, incomplete, model parallel, DST not empty).
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"converted {args.source} -> {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
