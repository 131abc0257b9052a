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


def worker(rank: int, args):
    torch.set_num_threads(args.threads)
    import deepspeed_cpp as deepspeed

    vocab, seq, batch = 4096, 64, args.micro_batch
    lr = 1e-4
    steppers, memory = {}, {}

    model = make_model(args.layers, args.width, vocab, 0)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp_optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, fused=True)

    def ddp_step(tokens):
        loss = torch.nn.functional.cross_entropy(ddp(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()

    steppers["DDP + torch AdamW(fused)"] = ddp_step
    for stage in (0, 1, 2):
        config = {
            "train_micro_batch_size_per_gpu": batch,
            "optimizer": {"type": "AdamW", "params": {"lr": lr}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=make_model(args.layers, args.width, vocab, 0), config=config
        )

        def zero_step(tokens, engine=engine):
            logits = engine(tokens)
            engine.backward(
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            )
            engine.step()

        steppers[f"deepspeed_cpp ZeRO-{stage}"] = zero_step
        memory[f"deepspeed_cpp ZeRO-{stage}"] = engine.optimizer
    fsdp_note = ""
    try:
        from torch.distributed.fsdp import fully_shard

        fsdp_model = make_model(args.layers, args.width, vocab, 0)
        for block in fsdp_model.blocks.layers:
            fully_shard(block)
        fully_shard(fsdp_model)
        fsdp_optimizer = torch.optim.AdamW(fsdp_model.parameters(), lr=lr)

        def fsdp_step(tokens):
            loss = torch.nn.functional.cross_entropy(
                fsdp_model(tokens).flatten(0, 1), tokens.flatten()
            )
            loss.backward()
            fsdp_optimizer.step()
            fsdp_optimizer.zero_grad()

        fsdp_step(torch.randint(0, vocab, (batch, seq)))
        steppers["FSDP2 fully_shard + AdamW"] = fsdp_step
    except Exception as error:  # noqa: BLE001 - a reference that cannot run here is reported
        fsdp_note = f"FSDP2 not run: {type(error).__name__}: {str(error).splitlines()[0][:120]}"

    generator = torch.Generator().manual_seed(100 + rank)
    times = {name: [] for name in steppers}
    for round_index in range(args.warmup + args.rounds):
        tokens = torch.randint(0, vocab, (batch, seq), generator=generator)
        for name, step in steppers.items():
            dist.barrier()
            start = time.perf_counter()
            step(tokens)
            dist.barrier()
            if round_index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    moments = {"DDP + torch AdamW(fused)": (adam_moment_bytes(ddp_optimizer), 0)}
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
    if "FSDP2 fully_shard + AdamW" in steppers:
        moments["FSDP2 fully_shard + AdamW"] = (adam_moment_bytes(fsdp_optimizer), 0)
    return (rank, n_params, {k: statistics.median(v) for k, v in times.items()}, moments,
            fsdp_note, reducer_peaks)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=704)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--bucket", type=float, default=5e6, help="reduce_bucket_size (elements)")
    args = parser.parse_args()
    reports = run_on_ranks(args.procs, worker, args)
    _, n_params, _, moments, fsdp_note, _ = reports[0]
    print(f"{n_params / 1e6:.1f}M-parameter transformer, {args.procs} processes (gloo, CPU), "
          f"{args.threads} thread(s) each, median of {args.rounds} interleaved rounds")  # fmt: skip
    if fsdp_note:
        print(fsdp_note)
    reference = max(r[2]["DDP + torch AdamW(fused)"] for r in reports)
    print(f"{'implementation':<28} {'step s':>8} {'/ DDP':>7} {'Adam moments/rank':>18} "
          f"{'/ DDP':>7} {'extra fp32 masters':>19}")  # fmt: skip
    ddp_moments = moments["DDP + torch AdamW(fused)"][0]
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
