"""A 2-rank job in which rank 1 never calls init_distributed (it sleeps until it is ended).

Run by test_rendezvous_errors.py through the deepspeed-cpp launcher: rank 0 must fail within
the timeout given on the command line, naming the rendezvous and rank 1, and torchrun then ends
rank 1. Rank 0 writes the wall-clock times it called init_distributed and raised into
``<out>/called_at`` and ``<out>/raised_at``.
"""

import os
import sys
import time
from pathlib import Path


def main(out: Path, timeout_s: float) -> None:
    if os.environ["RANK"] == "1":
        time.sleep(300)  # never arrives; torchrun's SIGTERM ends it once rank 0 has failed
        return
    import deepspeed_cpp

    (out / "called_at").write_text(repr(time.time()))
    try:
        deepspeed_cpp.init_distributed(dist_backend="gloo", timeout=timeout_s)
    finally:
        (out / "raised_at").write_text(repr(time.time()))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
