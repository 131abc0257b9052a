"""Soak: 2 gloo ranks train a model (ZeRO-2) for N steps, saving every S steps, while one rank is
killed with SIGKILL at a random step about every K steps; each time both ranks restart from
``latest``. At the end the fp32 parameters are compared with an uninterrupted run's. The model is
the CIFAR-10 example's network on its generated images (``--model cifar10``, the default) or a
small MLP on random data (``--model mlp``, the quick form the tests run).

    python benchmarks/soak.py                       # 2,000 steps, save every 100, kill ~ every 300
    python benchmarks/soak.py --model mlp --steps 40 --save-every 10 --kill-every 20

Prints steps, kills survived, resumes and the max |difference| (0 means nothing was lost).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

IN, HIDDEN, OUT, BATCH = 16, 32, 4, 8
CIFAR10_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cifar10"
CIFAR10_IMAGES = 4096  # generated once per process; each step draws its batch from them


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlpTask:
    """A small MLP regressing random targets."""

    def model(self) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
        )

    def batch(self, step: int):
        generator = torch.Generator().manual_seed(step)  # the data depends on the step alone
        return (torch.randn(BATCH, IN, generator=generator),
                torch.randn(BATCH, OUT, generator=generator))  # fmt: skip

    def loss(self, output, target):
        return torch.nn.functional.mse_loss(output, target)


class Cifar10Task:
    """The CIFAR-10 example's network (three convolutions, a classifier) on its generated images."""

    def __init__(self) -> None:
        if str(CIFAR10_EXAMPLE) not in sys.path:
            sys.path.insert(0, str(CIFAR10_EXAMPLE))
        from cifar10_data import generated_cifar10

        train, _ = generated_cifar10(train_size=CIFAR10_IMAGES, test_size=1)
        self.images, self.labels = train.tensors

    def model(self) -> torch.nn.Module:
        from cifar10_deepspeed import Net

        return Net()

    def batch(self, step: int):
        generator = torch.Generator().manual_seed(step)  # the data depends on the step alone
        rows = torch.randint(0, len(self.labels), (BATCH,), generator=generator)
        return self.images[rows], self.labels[rows]

    def loss(self, output, target):
        return torch.nn.functional.cross_entropy(output, target)


TASKS = {"cifar10": Cifar10Task, "mlp": MlpTask}


def _engine(task, stage: int = 2):
    import deepspeed_cpp

    torch.manual_seed(1234)
    model = task.model()
    config = {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed_cpp.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def worker(rank, port, task_name, folder, steps, save_every, kill_at, victim, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    task = TASKS[task_name]()
    engine = _engine(task)
    if folder:
        engine.load_checkpoint(folder)
    rows = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    for step in range(engine.global_steps, steps):
        if step == kill_at and rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = task.batch(step)
        loss = task.loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        if folder and engine.global_steps % save_every == 0:
            engine.save_checkpoint(folder)
    if rank == 0:
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, out)
    dist.destroy_process_group()


def run_world(task, folder, steps, save_every, kill_at, victim, out) -> list[int]:
    context = torch.multiprocessing.start_processes(
        worker, args=(_port(), task, folder, steps, save_every, kill_at, victim, out),
        nprocs=2, join=False, start_method="spawn",
    )  # fmt: skip
    processes = context.processes
    while any(p.is_alive() for p in processes):
        if any(p.exitcode not in (None, 0) for p in processes):
            time.sleep(0.2)
            for p in processes:  # as a launcher does: one rank died, end the others
                if p.is_alive():
                    p.kill()
        time.sleep(0.05)
    for p in processes:
        p.join()
    return [p.exitcode for p in processes]


def soak(steps: int, save_every: int, kill_every: int, seed: int, task: str = "cifar10") -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        reference = scratch / "reference.pt"
        assert run_world(task, "", steps, save_every, -1, 0, str(reference)) == [0, 0]
        folder, out = str(scratch / "ckpt"), str(scratch / "soaked.pt")
        kills = resumes = done = 0
        while True:
            kill_at = done + rng.randint(kill_every // 2, 3 * kill_every // 2)
            codes = run_world(task, folder, steps, save_every, kill_at, rng.randint(0, 1), out)
            if codes == [0, 0]:
                break
            kills += 1
            resumes += 1
            latest = Path(folder) / "latest"
            done = int(latest.read_text().removeprefix("global_step")) if latest.exists() else 0
        expected = torch.load(reference, weights_only=True)
        got = torch.load(out, weights_only=True)
        diff = max((got[n] - expected[n]).abs().max().item() for n in expected)
    return {
        "model": task,
        "steps": steps,
        "kills survived": kills,
        "resumes": resumes,
        "max |diff|": diff,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(TASKS), default="cifar10")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--kill-every", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = soak(args.steps, args.save_every, args.kill_every, args.seed, args.model)
    for key, value in result.items():
        print(f"{key:>16}: {value}")
    print(f"{'seconds':>16}: {time.monotonic() - started:.1f}")
    sys.exit(0 if result["max |diff|"] == 0 else 1)


if __name__ == "__main__":
    main()
