"""CPU Adam step time: ours vs torch's fused/foreach AdamW (and DeepSpeed's when installed).

Prints, per case, the median of interleaved repetitions after a warm-up, the ratio of each
reference to ours, and the memory limit: a kernel with Adam's exact streams (read param, grad,
exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq in place) but trivial arithmetic, timed in
the same run on the same sizes and threads (see shared/design/measuring.md).

    python benchmarks/bench_cpu_adam.py [--threads 2] [--reps 7] [--numel 67108864]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepspeed_cpp.ops import cpu_adam_step_multi
from deepspeed_cpp.ops.cpu_adam import cpu_adam_isa

BYTES_PER_PARAM = 28  # fp32: 16 read, 12 written

try:
    from deepspeed.ops.adam import DeepSpeedCPUAdam as DEEPSPEED_CPU_ADAM  # type: ignore
except Exception as error:  # noqa: BLE001 - any failure means "not available here"
    DEEPSPEED_CPU_ADAM = None
    DEEPSPEED_MISSING = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (124M): ~150 tensors, many tiny, a few huge."""
    d, vocab, layers = 768, 50257, 12
    shapes = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


class Case:
    def __init__(self, shapes):
        self.params = [torch.randn(s) for s in shapes]
        self.grads = [torch.randn(s) * 1e-2 for s in shapes]
        self.exp_avgs = [torch.zeros(s) for s in shapes]
        self.exp_avg_sqs = [torch.zeros(s) for s in shapes]
        self.numel = sum(p.numel() for p in self.params)
        self.step = 0


def make_runners(case: Case) -> dict:
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch_params = [p.clone().requires_grad_(True) for p in case.params]
    for p, g in zip(torch_params, case.grads):
        p.grad = g
    fused = torch.optim.AdamW(torch_params, fused=True, **hp)
    foreach_params = [p.clone().requires_grad_(True) for p in case.params]
    for p, g in zip(foreach_params, case.grads):
        p.grad = g
    foreach = torch.optim.AdamW(foreach_params, foreach=True, **hp)

    def ours():
        case.step += 1
        cpu_adam_step_multi(case.params, case.grads, case.exp_avgs, case.exp_avg_sqs,
                            step=case.step, lr=1e-3, weight_decay=0.01)  # fmt: skip

    def same_streams():
        # Adam's memory traffic with trivial arithmetic: the physical floor for this step.
        for p, g, m, v in zip(case.params, case.grads, case.exp_avgs, case.exp_avg_sqs):
            torch.ops.deepspeed_cpp_bench.same_streams(p, g, m, v)

    runners = {"ours": ours, "torch AdamW fused": fused.step, "torch AdamW foreach": foreach.step}
    if DEEPSPEED_CPU_ADAM is not None:
        ds_params = [p.clone().requires_grad_(True) for p in case.params]
        for p, g in zip(ds_params, case.grads):
            p.grad = g
        runners["DeepSpeed DeepSpeedCPUAdam"] = DEEPSPEED_CPU_ADAM(ds_params, **hp).step
    if _load_same_streams_kernel():
        runners["memory limit (same streams)"] = same_streams
    return runners


_SAME_STREAMS_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <omp.h>
void same_streams(at::Tensor p, const at::Tensor& g, at::Tensor m, at::Tensor v) {
  float* __restrict__ pp = p.data_ptr<float>();
  const float* __restrict__ gp = g.data_ptr<float>();
  float* __restrict__ mp = m.data_ptr<float>();
  float* __restrict__ vp = v.data_ptr<float>();
  const int64_t n = p.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float x = gp[i];
    mp[i] = mp[i] + x;
    vp[i] = vp[i] + x;
    pp[i] = pp[i] - x;
  }
}
TORCH_LIBRARY(deepspeed_cpp_bench, m) {
  m.def("same_streams(Tensor(a!) p, Tensor g, Tensor(b!) m, Tensor(c!) v) -> ()");
}
TORCH_LIBRARY_IMPL(deepspeed_cpp_bench, CPU, m) { m.impl("same_streams", &same_streams); }
"""


def _load_same_streams_kernel() -> bool:
    from torch.utils.cpp_extension import load_inline

    load_inline(name="deepspeed_cpp_bench_same_streams", cpp_sources=_SAME_STREAMS_SOURCE,
                extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False)  # fmt: skip
    return True


def time_interleaved(runners: dict, reps: int, warmup: int = 2) -> dict[str, float]:
    for _ in range(warmup):
        for run in runners.values():
            run()
    samples = {name: [] for name in runners}
    for _ in range(reps):
        for name, run in runners.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def report(title: str, case: Case, medians: dict[str, float]) -> None:
    ours = medians["ours"]
    limit = medians.get("memory limit (same streams)")
    print(f"\n{title}: {case.numel / 1e6:.1f}M params in {len(case.params)} tensors")
    print(f"  {'implementation':<30} {'ms/step':>9} {'GB/s':>7} {'ours faster by':>15}")
    for name, seconds in medians.items():
        gbps = BYTES_PER_PARAM * case.numel / seconds / 1e9
        ratio = "" if name == "ours" else f"{seconds / ours:.2f}x"
        print(f"  {name:<30} {seconds * 1e3:9.2f} {gbps:7.1f} {ratio:>15}")
    if limit:
        print(f"  ours reaches {limit / ours:.0%} of the memory limit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--numel", type=int, default=64 * 2**20)
    parser.add_argument("--skip-gpt2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"threads={args.threads} reps={args.reps} torch={torch.__version__} "
          f"isa={cpu_adam_isa()}")  # fmt: skip

    if DEEPSPEED_CPU_ADAM is None:
        print(f"note: DeepSpeed's DeepSpeedCPUAdam is not available ({DEEPSPEED_MISSING}); "
              "its rows are omitted")  # fmt: skip
    cases = [("one fp32 tensor", Case([(args.numel,)]))]
    if not args.skip_gpt2:
        cases.append(("GPT-2-small-like list", Case(gpt2_small_shapes())))
    for title, case in cases:
        medians = time_interleaved(make_runners(case), args.reps)
        report(title, case, medians)
        del case


if __name__ == "__main__":
    main()
