"""A 2-rank training in which rank 1 stops itself (SIGSTOP) in the forward of one step.

Run by test_collective_timeout.py through the deepspeed-cpp launcher. Rank 1 writes the
wall-clock time at which it stops into ``<out>/stopped_at`` first and rank 0 the time at which it
raised into ``<out>/raised_at``, so the test can time rank 0's error from that moment.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # checkpoint_training's model, config and data

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from checkpoint_training import build_engine, global_batches, train  # noqa: E402

import deepspeed_cpp  # noqa: E402

STEPS, STOP_STEP = 4, 2


def main(out: Path, timeout_s: float, stage: int) -> None:
    torch.set_num_threads(1)
    deepspeed_cpp.init_distributed(dist_backend="gloo", timeout=timeout_s)
    engine = build_engine(7, 2, stage)
    if dist.get_rank() == 1:

        def stop(*_):
            if engine.global_steps == STOP_STEP:
                (out / "stopped_pid").write_text(str(os.getpid()))
                (out / "stopped_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)

        engine.module.register_forward_pre_hook(stop)
    try:
        train(engine, global_batches(3, STEPS))
    except Exception:
        (out / "raised_at").write_text(repr(time.time()))
        # Resume the stopped rank, as its operator would once the error is out: torchrun's
        # SIGTERM then ends it at once instead of after torchrun's 30 s grace period.
        if (out / "stopped_pid").exists():
            os.kill(int((out / "stopped_pid").read_text()), signal.SIGCONT)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]))
