"""The communication logger (issue 30): one ZeRO-2 and one ZeRO-3 step on 2 gloo ranks record
exactly the collectives that step must issue (op, count, message size), the C++ reducer's
included; off, nothing is wrapped; the table is DeepSpeed's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepspeed_cpp.comm import collective_tap, comms_logger, configure
from deepspeed_cpp.comm.comms_logger import CommsLogger, bandwidths, convert_size

MICRO = 4


def _one_step(stage: int, extra: dict):
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.comm import comms_logger, log_summary

    rank = dist.get_rank()
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **extra},
        "comms_logger": {"enabled": True},
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 20))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    x = torch.randn(MICRO, 40, generator=torch.Generator().manual_seed(rank))
    loss = engine(x).pow(2).mean()  # warm-up step: ZeRO-3 records its module order in it
    engine.backward(loss)
    engine.step()
    comms_logger.reset()
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
    summary = {
        op: {size: row["count"] for size, row in by_size.items()}
        for op, by_size in comms_logger.summary().items()
    }
    latencies_positive = all(
        row["avg_latency_ms"] > 0
        for by_size in comms_logger.summary().values()
        for row in by_size.values()
    )
    log_summary()
    engine.destroy()
    configure(enabled=False)
    wrapped = collective_tap.installed()
    return summary, latencies_positive, wrapped


def test_zero2_step(pool2):
    # One bucket of 40*30+30+30*20+20 = 1850 elements, padded to 1856 (a multiple of 2*16).
    results = pool2.run(_one_step, 2, {"reduce_bucket_size": 10**6})
    for summary, latencies_positive, wrapped in results:
        assert summary == {
            # the C++ reducer: the bucket, fp32, all-reduced (gloo's faster way, "auto")
            # and the global gradient norm (one float64)
            "all_reduce": {1856 * 4: 1, 8: 1},
            # the updated halves gathered back: on gloo 2 ranks exchange them with one
            # all-to-all (logged at one rank's part, its input)
            "all_to_all_single": {928 * 4: 1},
        }
        assert latencies_positive
        assert not wrapped  # turned off again: torch's own functions are back


def test_zero3_step(pool2):
    # Every parameter partitioned (threshold 0), no prefetch, each Linear one fetch unit (not
    # merged into the root's for being small).
    extra = {
        "stage3_param_persistence_threshold": 0,
        "stage3_unit_min_numel": 0,
        "stage3_prefetch_bucket_size": 0,
        "reduce_bucket_size": 10**6,
    }
    results = pool2.run(_one_step, 3, extra)
    # Padded to multiples of 2*16 elements: W1 1200 -> 1216, b1 30 -> 32, W2 600 -> 608,
    # b2 20 -> 32; each rank's shard is half of that.
    for summary, latencies_positive, wrapped in results:
        assert summary == {
            # Each fetch unit gathered once (kept from forward through backward: the default
            # max_reuse_distance never releases early), on gloo between 2 ranks by one
            # all-to-all of each rank's shards of the unit's parameters (logged at one rank's
            # part): half of Linear 1 (1216 + 32) and of Linear 2 (608 + 32) elements of fp32.
            # Then the coordinator's agreement:
            # three int64 (unit, uses, digest) from each rank where a use launched gathers (the
            # two units in forward) and once at the end of the pass.
            "all_to_all_single": {624 * 4: 1, 320 * 4: 1},
            "all_gather_into_tensor": {3 * 8: 3},
            # The C++ reducer: both fetch units' gradients (the same elements as their gathers,
            # fp32, whole) in one all-reduce, consecutive units sharing a reduction up to
            # reduce_bucket_size; then the global gradient norm (one float64).
            "all_reduce": {(1248 + 640) * 4: 1, 8: 1},
        }
        assert latencies_positive
        assert not wrapped


def test_off_wraps_nothing():
    configure(enabled=False)
    assert not collective_tap.installed()
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"
    configure(enabled=True, prof_all=False, prof_ops=["broadcast"])
    try:
        assert collective_tap.installed()
        assert comms_logger.wants("broadcast") and not comms_logger.wants("all_reduce")
    finally:
        configure(enabled=False, prof_all=True, prof_ops=[])
    assert dist.all_reduce.__module__ == "torch.distributed.distributed_c10d"


def test_table_and_bandwidths():
    # DeepSpeed's calc_bw_log: all_reduce algbw = 2*size/t, busbw = size/t * 2(n-1)/n.
    algbw, busbw = bandwidths("all_reduce", 10**6, 1.0, 4)
    assert algbw == pytest.approx(16.0) and busbw == pytest.approx(12.0)
    # All-gather: the size is one rank's part, the bandwidths count the gathered whole
    # (DeepSpeed: size *= n); a reduce-scatter of that whole moves the same bytes.
    algbw, busbw = bandwidths("all_gather_into_tensor", 10**6, 2.0, 2)
    assert algbw == pytest.approx(8.0) and busbw == pytest.approx(4.0)
    assert bandwidths("all_gather", 10**6, 2.0, 2) == (algbw, busbw)
    assert bandwidths("reduce_scatter_tensor", 2 * 10**6, 2.0, 2) == (algbw, busbw)
    assert convert_size(0) == "0B" and convert_size(1536) == "1.5 KB"
    logger = CommsLogger()
    logger.enabled = True
    for latency in (1.0, 2.0, 3.0):
        logger.append("all_reduce", "all_reduce", latency, 1024, 2)
    table = logger.log_all(print_log=False).splitlines()
    assert table[0].split() == [
        "Comm.", "Op", "Message", "Size", "Count", "Total", "Latency(ms)", "Avg",
        "Latency(ms)", "tput_avg", "(Gbps)", "busbw_avg", "(Gbps)",
    ]  # fmt: skip
    assert table[1] == "all_reduce"
    assert table[2].split()[:5] == ["1.0", "KB", "3", "6.00", "2.00"]
