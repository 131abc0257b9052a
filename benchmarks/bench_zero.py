"""ZeRO stages 0/1/2 against DistributedDataParallel (and FSDP2 where it runs on gloo).

Spawns N processes (gloo, CPU), builds the same ~50M-parameter transformer for every
implementation, and runs their steps interleaved (one step of each per round) so that the
machine's noise hits all of them alike. Prints per implementation: median step time, the ratio to
DDP, and per-rank optimizer memory (Adam moments, and fp32 master shards that ZeRO keeps apart
from the parameters: none for an fp32 model, whose parameters are their own masters).

    python benchmarks/bench_zero.py [--procs 2] [--layers 8] [--rounds 6] [--bucket 5e6]

ZeRO runs with reduce_bucket_size = --bucket elements (5e6 = 20 MB, near DDP's 25 MB buckets; on
CPU, DeepSpeed's 5e8 default leaves nothing to overlap).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks


def make_model(layers: int, width: int, vocab: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            layer = torch.nn.TransformerEncoderLayer(
                width, nhead=8, dim_feedforward=4 * width, batch_first=True, dropout=0.0
            )
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, tokens):
            return self.head(self.blocks(self.embed(tokens)))

    return LM()


VOCAB, SEQ, LR = 4096, 64, 1e-4
DDP = "DDP + torch AdamW(fused)"
FSDP2 = "FSDP2 fully_shard + AdamW"


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def adam_moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                tensor = state[key]
                if hasattr(tensor, "to_local"):  # FSDP2 keeps DTensors: count the local shard
                    tensor = tensor.to_local()
                total += tensor.numel() * tensor.element_size()
    return total


class Phases(NamedTuple):
    """One training step in three timed parts: ``backward(forward(tokens))``, then ``update()``."""

    forward: Callable[[torch.Tensor], torch.Tensor]  # tokens -> loss
    backward: Callable[[torch.Tensor], object]
    update: Callable[[], object]


def module_phases(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Phases:
    def update():
        optimizer.step()
        optimizer.zero_grad()

    return Phases(lambda tokens: lm_loss(model(tokens), tokens), torch.Tensor.backward, update)


def engine_phases(engine) -> Phases:
    """The phases of a (deepspeed_cpp or DeepSpeed) engine."""
    return Phases(lambda tokens: lm_loss(engine(tokens), tokens), engine.backward, engine.step)


def build_ddp(args):
    """(phases, optimizer) of DDP over ``make_model`` with torch's fused AdamW."""
    ddp = torch.nn.parallel.DistributedDataParallel(make_model(args.layers, args.width, VOCAB, 0))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, fused=True)
    return module_phases(ddp, optimizer), optimizer


def zero_config(args, stage: int, **zero) -> dict:
    """The ds_config both deepspeed_cpp and DeepSpeed get (extra ``zero_optimization`` keys)."""
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket, **zero},
        "steps_per_print": 10**9,
    }


def build_zero(args, stage: int, **zero):
    """(phases, engine) of deepspeed_cpp at ``stage`` over ``make_model``."""
    import deepspeed_cpp

    model = make_model(args.layers, args.width, VOCAB, 0)
    engine, _, _, _ = deepspeed_cpp.initialize(model=model, config=zero_config(args, stage, **zero))
    return engine_phases(engine), engine


def build_fsdp2(args):
    """(phases, optimizer) of FSDP2: each transformer block and the root fully_shard."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(args.layers, args.width, VOCAB, 0)
    for block in model.blocks.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return module_phases(model, optimizer), optimizer


def run_step(phases: Phases, tokens: torch.Tensor) -> None:
    phases.backward(phases.forward(tokens))
    phases.update()


def not_run_note(name: str, error: BaseException) -> str:
    return f"{name} not run: {type(error).__name__}: {str(error).splitlines()[0][:120]}"


def interleaved_medians(steppers: dict[str, Phases], args, rank: int) -> dict:
    """Per implementation, the median seconds of (step, forward, backward, update), one step of
    each implementation per round (after ``args.warmup`` rounds) so that the machine's noise hits
    all of them alike. A step runs from barrier to barrier; the phases are this rank's own."""
    generator = torch.Generator().manual_seed(100 + rank)
    times = {name: [] for name in steppers}
    for round_index in range(args.warmup + args.rounds):
        tokens = torch.randint(0, VOCAB, (args.micro_batch, SEQ), generator=generator)
        for name, phases in steppers.items():
            dist.barrier()
            start = time.perf_counter()
            loss = phases.forward(tokens)
            forward_end = time.perf_counter()
            phases.backward(loss)
            backward_end = time.perf_counter()
            phases.update()
            update_end = time.perf_counter()
            dist.barrier()
            if round_index >= args.warmup:
                step_end = time.perf_counter()
                times[name].append(
                    (step_end - start, forward_end - start, backward_end - forward_end,
                     update_end - backward_end)
                )  # fmt: skip
    return {name: tuple(map(statistics.median, zip(*values))) for name, values in times.items()}


def worker(rank: int, args):
    torch.set_num_threads(args.threads)
    steppers, memory = {}, {}
    steppers[DDP], ddp_optimizer = build_ddp(args)
    n_params = sum(p.numel() for p in ddp_optimizer.param_groups[0]["params"])
    for stage in (0, 1, 2):
        name = f"deepspeed_cpp ZeRO-{stage}"
        steppers[name], engine = build_zero(args, stage)
        memory[name] = engine.optimizer
    fsdp_note = ""
    try:
        phases, fsdp_optimizer = build_fsdp2(args)
        run_step(phases, torch.randint(0, VOCAB, (args.micro_batch, SEQ)))
        steppers[FSDP2] = phases
    except Exception as error:  # noqa: BLE001 - a reference that cannot run here is reported
        fsdp_note = not_run_note("FSDP2", error)
    medians = {name: times[0] for name, times in interleaved_medians(steppers, args, rank).items()}
    moments = {DDP: (adam_moment_bytes(ddp_optimizer), 0)}
    reducer_peaks = {}
    for name, zero in memory.items():
        # fp32 masters that are the parameters' own storage (fp32 models) cost nothing extra.
        parameter_storages = {p.untyped_storage().data_ptr() for p in zero.params}
        masters = sum(
            m.numel() * m.element_size()
            for m in zero.masters
            if m.untyped_storage().data_ptr() not in parameter_storages
        )
        moments[name] = (adam_moment_bytes(zero.optimizer), masters)
        reducer_peaks[name] = zero.reducer.peak_held_bytes()
    if FSDP2 in steppers:
        moments[FSDP2] = (adam_moment_bytes(fsdp_optimizer), 0)
    return rank, n_params, medians, moments, fsdp_note, reducer_peaks


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, batch and process options every ZeRO benchmark shares."""
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=704)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bucket", type=float, default=5e6, help="reduce_bucket_size (elements)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    args = parser.parse_args()
    reports = run_on_ranks(args.procs, worker, args)
    _, n_params, _, moments, fsdp_note, _ = reports[0]
    print(f"{n_params / 1e6:.1f}M-parameter transformer, {args.procs} processes (gloo, CPU), "
          f"{args.threads} thread(s) each, median of {args.rounds} interleaved rounds")  # fmt: skip
    if fsdp_note:
        print(fsdp_note)
    reference = max(r[2][DDP] for r in reports)
    print(f"{'implementation':<28} {'step s':>8} {'/ DDP':>7} {'Adam moments/rank':>18} "
          f"{'/ DDP':>7} {'extra fp32 masters':>19}")  # fmt: skip
    ddp_moments = moments[DDP][0]
    for name in reports[0][2]:
        seconds = max(r[2][name] for r in reports)  # a step is as slow as its slowest rank
        moment_bytes = max(r[3][name][0] for r in reports)
        master_bytes = max(r[3][name][1] for r in reports)
        print(f"{name:<28} {seconds:8.3f} {seconds / reference:7.2f} "
              f"{moment_bytes / 2**20:15.1f} MiB {moment_bytes / ddp_moments:7.3f} "
              f"{master_bytes / 2**20:15.1f} MiB")  # fmt: skip
    peaks = ", ".join(
        f"{name.split()[-1]} {max(r[5][name] for r in reports) / 2**20:.1f} MiB"
        for name in reports[0][5]
    )
    print(f"peak gradient-reduction buffers per rank: {peaks} "
          f"(a full fp32 gradient: {4 * n_params / 2**20:.1f} MiB)")  # fmt: skip


if __name__ == "__main__":
    main()
