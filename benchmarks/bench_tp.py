"""Tensor parallelism (AutoTP) against ZeRO-2 and DDP on the same model, and against real
DeepSpeed's AutoTP training where it runs (DeepSpeed's CPU accelerator, gloo).

Spawns 2 processes and builds the same Hugging Face Llama (from a config) for every
implementation; their steps run interleaved (one step of each per round) at the same global
batch: DDP and ZeRO-2 split it over the 2 data-parallel ranks, TP 2 (one data-parallel rank)
feeds the whole batch to both ranks, which split every layer. Prints per implementation the
median step time, its ratio to DDP and to DeepSpeed's AutoTP, and per-rank memory of parameters
and of Adam's moments (+ fp32 masters where kept apart from the parameters).

Both keep the embeddings whole on every TP rank and split the vocabulary of the (untied)
lm_head with its logits gathered (DeepSpeed 0.19.8's rule), so their parameters per rank match.

    python benchmarks/bench_tp.py [--hidden 512] [--layers 4] [--rounds 5] [--deepspeed DIR]

DeepSpeed is imported from ``--deepspeed`` (a source tree put on sys.path in the workers only,
with DS_ACCELERATOR=cpu); a DeepSpeed that is missing or fails is reported and the rest runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks

VOCAB, SEQ, LR = 8192, 128, 1e-4
DDP = "DDP + torch AdamW"
ZERO2 = "deepspeed_cpp ZeRO-2 (DP 2)"
OURS_TP = "deepspeed_cpp AutoTP 2 (ZeRO-1, DP 1)"
THEIR_TP = "DeepSpeed 0.19.8 AutoTP 2 (ZeRO-1, DP 1)"


def make_model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=SEQ,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def ds_config(micro: int, stage: int, tp: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e6},
        "steps_per_print": 10**9,
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def moment_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    total = 0
    for state in getattr(inner, "state", {}).values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                total += state[key].numel() * state[key].element_size()
    return total


def parameter_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def build_all(args, rank: int):
    """{name: (step(tokens), batch slice, memory())}: every implementation on this rank."""
    world = dist.get_world_size()
    per_rank = args.batch // world
    built, notes = {}, []

    model = make_model(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)

    def ddp_step(tokens):
        ddp(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    built[DDP] = (ddp_step, rows, lambda: (parameter_bytes(model), moment_bytes(optimizer)))

    import deepspeed_cpp

    def engine_entry(engine, rows):
        def step(tokens):
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
            engine.step()

        def memory():
            masters = 0
            zero = engine.optimizer
            parameter_storages = {p.untyped_storage().data_ptr() for p in zero.params}
            masters = sum(
                m.numel() * m.element_size()
                for m in zero.masters
                if m.untyped_storage().data_ptr() not in parameter_storages
            )
            return parameter_bytes(engine.module), moment_bytes(zero) + masters

        return step, rows, memory

    engine, *_ = deepspeed_cpp.initialize(model=make_model(args), config=ds_config(per_rank, 2, 1))
    built[ZERO2] = engine_entry(engine, rows)
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(args), config=ds_config(args.batch, 1, world)
    )
    built[OURS_TP] = engine_entry(engine, slice(None))

    try:
        if args.deepspeed:
            sys.path.insert(0, args.deepspeed)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        theirs, *_ = deepspeed.initialize(
            model=make_model(args), config=ds_config(args.batch, 1, world)
        )

        def their_step(tokens):
            theirs.backward(theirs(input_ids=tokens, labels=tokens).loss)
            theirs.step()

        built[THEIR_TP] = (
            their_step,
            slice(None),
            lambda: (parameter_bytes(theirs.module), moment_bytes(theirs.optimizer)),
        )
    except Exception as error:  # noqa: BLE001 - a reference that cannot run here is reported
        notes.append(f"DeepSpeed AutoTP not run: {type(error).__name__}: {str(error)[:160]}")
    return built, notes


def worker(rank: int, args):
    torch.set_num_threads(args.threads)
    built, notes = build_all(args, rank)
    generator = torch.Generator().manual_seed(100)  # the same global batch on every rank
    times = {name: [] for name in built}
    for round_index in range(args.warmup + args.rounds):
        tokens = torch.randint(0, VOCAB, (args.batch, SEQ), generator=generator)
        for name, (step, rows, _) in built.items():
            dist.barrier()
            start = time.perf_counter()
            step(tokens[rows])
            dist.barrier()
            if round_index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    memory = {name: entry[2]() for name, entry in built.items()}
    return medians, memory, notes


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--deepspeed", default="/work/ds_target", help="DeepSpeed source tree")
    args = parser.parse_args()
    results = run_on_ranks(2, worker, args)
    medians, memory, notes = results[0]
    rank1_memory = results[1][1]
    print(f"CPU: {cpu_model()}, 2 ranks x {args.threads} thread(s)")
    print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, seq {SEQ}, "
          f"global batch {args.batch}, median of {args.rounds} interleaved rounds")  # fmt: skip
    ddp = medians[DDP]
    theirs = medians.get(THEIR_TP)
    header = f"{'implementation':44s} {'step ms':>9s} {'/DDP':>6s} {'/DS TP':>7s}"
    print(header + f" {'params MB/rank':>15s} {'Adam+masters MB/rank':>21s}")
    for name, seconds in medians.items():
        params, state = memory[name]
        params1, state1 = rank1_memory[name]  # the same on both ranks, said where not
        if (params, state) != (params1, state1):
            print(f"(rank 1 holds {params1 / 2**20:.1f} / {state1 / 2**20:.1f} MB for {name})")
        versus_ds = f"{seconds / theirs:7.2f}" if theirs else f"{'-':>7s}"
        print(
            f"{name:44s} {seconds * 1e3:9.1f} {seconds / ddp:6.2f} {versus_ds} "
            f"{params / 2**20:15.1f} {state / 2**20:21.1f}"
        )
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
