"""Command line of ``deepspeed_cpp.plot`` (see the package docstring)."""

from __future__ import annotations

import argparse
import sys

from .curves import plot_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deepspeed_cpp.plot",
        description="Draw a run's Train/Samples curves (csv_monitor or tensorboard output).",
    )
    parser.add_argument("run", help="output_path/job_name of csv_monitor or tensorboard")
    parser.add_argument("-o", "--output", default=None, help="PNG to write (default: <run>.png)")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run, args.output)
    except (FileNotFoundError, ImportError, ValueError) as error:
        print(f"deepspeed_cpp.plot: {error}", file=sys.stderr)
        return 1
    print(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
