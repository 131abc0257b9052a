"""The per-launch part of ``bench_zero3.py``: each implementation in processes of its own, on
two models, reporting what a step costs on the wire and in memory.

- ``transformer``: ``bench_zero.make_model`` (the ~50M-parameter LM, few large parameters);
- ``deep``: ``bench_zero3_collectives.make_model("deep")``, 48 blocks of ``Linear(256, 256)`` +
  ``LayerNorm(256)`` (thousands of small parameters' worth of biases and norms: latency-bound).

Per step, every rank counts:

- collectives: the sum of every live process group's sequence number before and after the step
  (C++ and Python collectives alike, any group, whoever issued them: ours, FSDP2's, DeepSpeed's);
- bytes sent: this process's ``wchar`` in ``/proc/self/io`` before and after the step. Gloo
  sends with ``writev`` on its TCP pairs, so this is what the rank put on the wire (nothing else
  in the step writes to a file descriptor);
- step time (forward + backward + optimizer step, this rank's clock);
- peak RSS over the measured steps (``VmHWM`` reset after the warm-up).

DeepSpeed runs from ``--deepspeed-path`` (prepended to ``sys.path`` in its own rank processes
only, ``DS_ACCELERATOR=cpu``), never imported into the parent or into another implementation's
processes.

Measured 2026-11-27 on the 2-core dev machine shared with other jobs (load average 5-10 during
the run, so the step times are rough; collectives and bytes do not depend on load), main at
0fa470a, ``python benchmarks/bench_zero3.py --parts table --deepspeed-path /work/ds_target``:

    model        implementation         collectives  MiB sent  step ms  RSS peak MiB
    transformer  deepspeed_cpp ZeRO-2            40    305.72   1961.4        1456.8
    transformer  deepspeed_cpp ZeRO-3            97    305.74   1116.1        1674.7
    transformer  FSDP2 fully_shard                26    396.62   1967.8        1962.9
    transformer  DeepSpeed 0.19.8 ZeRO-3         88    305.74   5073.8        2167.5
    deep         deepspeed_cpp ZeRO-2             4     18.23     79.8         748.9
    deep         deepspeed_cpp ZeRO-3           101     18.26    399.4         763.1
    deep         FSDP2 fully_shard               146     24.35    545.2         752.3
    deep         DeepSpeed 0.19.8 ZeRO-3          3     18.23    326.4         895.0

DeepSpeed's 3 collectives on the deep model (not broken down by kind here) fit its buckets: the
prefetch and reduce buckets (5e6 elements each) hold the whole 3.2M-element model, and it fetches
a bucket's parameters with one coalesced all-gather.

Then (issue 27, branch s4-blocks) repeated blocks as units (each encoder layer one unit whole,
not one per large Linear), prefetches sharing one all-gather up to the prefetch bucket and
consecutive units sharing one reduction up to the reduce bucket. Measured 2026-11-27 15:48-15:58,
the branch then main in back-to-back launches of the same command, ~7 other jobs on the 2 cores
(load average 8-10; main's transformer rows ran beside a test job: only same-run ratios and the
counts mean anything):

    model        implementation          collectives (main -> blocks)  step ratios, same run
    transformer  deepspeed_cpp ZeRO-3            97 -> 34               / ZeRO-2: 0.99 -> 1.16
    transformer  FSDP2 fully_shard               26                     / FSDP2:  0.43 -> 1.29
    transformer  DeepSpeed 0.19.8 ZeRO-3         88
    deep         deepspeed_cpp ZeRO-3           101 -> 6                / ZeRO-2: 3.76 -> 1.98
    deep         deepspeed_cpp ZeRO-2             4                     / FSDP2:  0.67 -> 0.34
    deep         FSDP2 fully_shard              146
    deep         DeepSpeed 0.19.8 ZeRO-3          3

The transformer's 34: its 10 units (embedding, 8 layers, head) each gathered once on demand with
a use check each (a layer, 5.95M elements, is larger than the 5e6 prefetch bucket, so nothing is
prefetched and every gather costs its own check), reduced once each, plus the persistent
buckets and the norm; FSDP2's 26 have no checks. Then the window was made to prefetch one unit
larger than the bucket: still 34, and the step no faster. Layers as units made the transformer's
ZeRO-3 step slower (same-minute launches, 16:08-16:11: main 1153 / 1166 ms, whole-layer units
2029 / 2061 / 2159 ms; splitting their reductions at reduce_bucket_size did not help: 2149 ms;
the cause is not found) and its peak RSS ~10% higher (1608-1636 -> 1745-1825 MiB). So a block is
a unit only within the prefetch bucket too: with the table's 5e6 bucket the 5.95M-element layers
fall back to per-module units: 67 collectives, 1241 ms (ZeRO-2 1058 ms, same run). The deep
model (66K-element blocks) keeps 6.

Then the rank agreement folded into the gathers (branch s5-agree, ``pass_agreement.py``): of the
transformer's 67, 25 were the coordinator's use checks (one per launch point and one at the end
of the pass; counted per group: 17 on the engine's group, 25 gathers, 25 checks). From a trace's
second replay on, each gather carries the agreement as a 40-byte header and one check per pass
remains. ``--parts table --impls "deepspeed_cpp ZeRO-3" "FSDP2 fully_shard + AdamW"``, the
branch's base (74a15c7) at 17:20 and the branch at 18:12 on 2026-11-27, load average 18-29:

    model        implementation          collectives (base -> folded)
    transformer  deepspeed_cpp ZeRO-3            67 -> 43
    transformer  FSDP2 fully_shard               26
    deep         deepspeed_cpp ZeRO-3             6 -> 5
    deep         FSDP2 fully_shard              146

Step times under that load are noise (the deep model's step/FSDP2 read 0.16 before and 0.84
after in these two launches; in base/branch launches interleaved twice at 18:17-18:22,
``bench_zero3_collectives.py --models deep encoder --steps 8``, our deep step was 731/695 ms on
the base and 450/246 ms on the branch, the encoder's 165/68 and 98/93 ms: no slowdown seen).
The transformer's remaining 43 (17 reductions and norms, 25 gathers, 1 check) stay above
FSDP2's 26 because its 5.95M-element layers exceed the 5e6 prefetch bucket and so fall back to
per-module units (see above), not because of the agreement.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bench_zero import SEQ, VOCAB, lm_loss, make_model, zero_config
from bench_zero3_collectives import collectives_so_far
from bench_zero3_collectives import make_model as make_small_model
from gloo_ranks import run_on_ranks

MODELS = ("transformer", "deep")


def sent_bytes() -> int:
    """Bytes this process has passed to write()/writev() so far (gloo's TCP sends)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def rss(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def model_and_batches(model_name: str, args, rank: int, count: int):
    """(model, loss function, batches) of one model; the batches differ per rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    if model_name == "transformer":
        model = make_model(args.layers, args.width, VOCAB, 0)
        batches = [torch.randint(0, VOCAB, (args.micro_batch, SEQ), generator=generator)
                   for _ in range(count)]  # fmt: skip
        return model, lm_loss, batches
    model = make_small_model("deep")
    batches = [torch.randn(32, 256, generator=generator) for _ in range(count)]
    return model, lambda out, _: out.square().mean(), batches


def blocks_of(model: torch.nn.Module, model_name: str) -> list[torch.nn.Module]:
    if model_name == "transformer":
        return list(model.blocks.layers)
    return list(model)[:-1]


def stage3_zero_keys(args, model_name: str) -> dict:
    # The deep model's parameters are all under DeepSpeed's default persistence threshold
    # (1e5): with it, neither ZeRO-3 would partition anything there.
    persistence = args.persistence if model_name == "transformer" else args.deep_persistence
    return {
        "stage3_prefetch_bucket_size": int(args.prefetch),
        "stage3_param_persistence_threshold": int(persistence),
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": int(args.max_reuse_distance),
    }


def build_step(impl: str, model_name: str, args, model, loss_fn):
    """A function running one training step of ``impl`` on a batch."""
    if impl.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        for block in blocks_of(model, model_name):
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def fsdp_step(batch):
            loss_fn(model(batch), batch).backward()
            optimizer.step()
            optimizer.zero_grad()

        return fsdp_step
    stage = 2 if impl.endswith("ZeRO-2") else 3
    extra = stage3_zero_keys(args, model_name) if stage == 3 else {}
    config = zero_config(args, stage, **extra)
    if impl.startswith("DeepSpeed"):
        sys.path.insert(0, args.deepspeed_path)
        os.environ["DS_ACCELERATOR"] = "cpu"
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        torch.set_num_threads(args.threads)  # whatever DeepSpeed's CPU accelerator chose
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        args.described = (f"DeepSpeed {deepspeed.__version__} ({deepspeed.__file__}): accelerator "
                          f"{accelerator.device_name()}, torch.distributed {dist.get_backend()}, "
                          f"{type(engine.optimizer).__name__} over "
                          f"{type(engine.optimizer.optimizer).__name__}")  # fmt: skip
    else:
        import deepspeed_cpp

        engine, *_ = deepspeed_cpp.initialize(model=model, config=config)

    def engine_step(batch):
        engine.backward(loss_fn(engine(batch), batch))
        engine.step()

    return engine_step


def table_worker(rank: int, args, model_name: str, impl: str) -> dict:
    torch.set_num_threads(args.threads)
    model, loss_fn, batches = model_and_batches(model_name, args, rank, args.warmup + args.steps)
    step = build_step(impl, model_name, args, model, loss_fn)
    for batch in batches[: args.warmup]:
        step(batch)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    counts, sent, times = [], [], []
    for batch in batches[args.warmup :]:
        dist.barrier()
        collectives, wrote = collectives_so_far(), sent_bytes()
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
        sent.append(sent_bytes() - wrote)
        counts.append(collectives_so_far() - collectives)
    return {"collectives": max(counts), "sent": statistics.median(sent),
            "step": statistics.median(times), "peak_rss": rss("VmHWM"),
            "described": getattr(args, "described", "")}  # fmt: skip


def table_rows(args, impls: list[str]) -> tuple[list, list]:
    """(rows, notes): one row per model and implementation, each run in its own processes."""
    rows, notes = [], []
    for model_name in args.models:
        for impl in impls:
            try:
                ranks = run_on_ranks(args.procs, table_worker, args, model_name, impl)
            except RuntimeError as error:
                notes.append(f"{model_name} {impl} not run: {str(error).splitlines()[-1][:160]}")
                continue
            if ranks[0]["described"] and model_name == args.models[0]:
                notes.append(ranks[0]["described"])
            rows.append((model_name, impl, {
                "collectives": max(r["collectives"] for r in ranks),
                "sent": max(r["sent"] for r in ranks),
                "step": max(r["step"] for r in ranks),  # a step is as slow as its slowest rank
                "peak_rss": max(r["peak_rss"] for r in ranks),
            }))  # fmt: skip
    return rows, notes


def print_table(rows: list, notes: list, args) -> None:
    print(f"\nPer launch ({args.procs} gloo processes each, {args.warmup} warm-up + {args.steps} "
          f"measured steps; max over ranks; ZeRO-3 persistence threshold: transformer "
          f"{int(args.persistence)}, deep {int(args.deep_persistence)})")  # fmt: skip
    for note in notes:
        print(note)
    print(f"{'model':12} {'implementation':30} {'collectives':>11} {'MiB sent':>9} "
          f"{'step ms':>8} {'RSS peak MiB':>12}")  # fmt: skip
    by_key = {(m, i): r for m, i, r in rows}
    for model_name, impl, row in rows:
        print(f"{model_name:12} {impl:30} {row['collectives']:11d} {row['sent'] / 2**20:9.2f} "
              f"{row['step'] * 1e3:8.1f} {row['peak_rss'] / 2**20:12.1f}")  # fmt: skip
    ours3 = next((i for _, i, _ in rows if i.startswith("deepspeed_cpp ZeRO-3")), None)
    targets = {"deepspeed_cpp ZeRO-2": "<= 1.05", "FSDP2": "<= 1.00"}  # issue 27, step time
    print(f"\n{'ratio (same run)':64} {'transformer':>11} {'deep':>8} {'target':>8}")
    for reference in dict.fromkeys(i for _, i, _ in rows):
        if ours3 is None or reference == ours3:
            continue
        for what in ("step", "collectives"):
            cells = []
            for model_name in MODELS:
                a, b = by_key.get((model_name, ours3)), by_key.get((model_name, reference))
                cells.append(f"{a[what] / b[what]:.2f}" if a and b and b[what] else "-")
            target = next((t for k, t in targets.items() if reference.startswith(k)), "")
            if what == "collectives":
                target = "<= 1.00" if reference.startswith("FSDP2") else ""
            label = f"{what}: {ours3} / {reference}"
            print(f"{label:64} {cells[0]:>11} {cells[1]:>8} {target:>8}")
