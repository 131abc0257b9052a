"""CPU Adam step time: ours vs torch's fused/foreach AdamW (and DeepSpeed's when installed).

Prints, per case, the median of interleaved repetitions after a warm-up, each reference's time
over ours, and the two limits the kernel is bounded by, measured in the same run:

- memory: our own multi-tensor loop (same work split, same prefetching, same plain stores, same
  storage types) with the Adam arithmetic replaced by three additions, on the same tensors;
- arithmetic: our op on data that fits in the L2 caches, scaled to the case's size (it includes
  the per-call overhead, so it is an upper bound on the arithmetic time).

    python benchmarks/bench_cpu_adam.py [--threads 2] [--reps 9] [--numel 67108864]

DeepSpeed's rows need ``pip install deepspeed`` (its op JIT-builds on first use); without it the
benchmark says so and carries on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from deepspeed_cpp.ops import cpu_adam_step_multi
from deepspeed_cpp.ops.cpu_adam import cpu_adam_isa, load_cpu_adam

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
MEMORY_LIMIT = "memory limit (same streams)"
ARITHMETIC_LIMIT = "arithmetic limit (in cache)"

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
    """fp32 master params and state; grads in `grad_dtype`; optional low-precision copies."""

    def __init__(self, title, shapes, grad_dtype=torch.float32, lowp_dtype=None):
        self.title = title
        self.params = [torch.randn(s) for s in shapes]
        self.grads = [(torch.randn(s) * 1e-2).to(grad_dtype) for s in shapes]
        self.exp_avgs = [torch.zeros(s) for s in shapes]
        self.exp_avg_sqs = [torch.zeros(s) for s in shapes]
        self.params_lowp = None if lowp_dtype is None else [torch.empty(s, dtype=lowp_dtype)
                                                            for s in shapes]  # fmt: skip
        self.numel = sum(p.numel() for p in self.params)
        grad_bytes = torch.empty((), dtype=grad_dtype).element_size()
        lowp_bytes = 0 if lowp_dtype is None else torch.empty((), dtype=lowp_dtype).element_size()
        # Read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq (+ the copy).
        self.bytes_per_param = 24 + grad_bytes + lowp_bytes
        self.step = 0

    def ours(self):
        self.step += 1
        cpu_adam_step_multi(
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, step=self.step,
            lr=HP["lr"], eps=HP["eps"], weight_decay=HP["weight_decay"],
            params_lowp=self.params_lowp,
        )  # fmt: skip


def torch_runners(case: Case) -> dict:
    """torch's fused and foreach AdamW doing the same job: for low-precision grads, upcast them
    into preallocated float32 buffers first; for a copy-out, copy the params after the step."""
    runners = {}
    for label, kwargs in (("fused", dict(fused=True)), ("foreach", dict(foreach=True))):
        params = [p.clone().requires_grad_(True) for p in case.params]
        grads32 = [g if g.dtype == torch.float32 else g.float() for g in case.grads]
        for p, g in zip(params, grads32):
            p.grad = g
        optimizer = torch.optim.AdamW(params, **HP, **kwargs)
        upcast = case.grads[0].dtype != torch.float32
        lowp = case.params_lowp

        def run(optimizer=optimizer, params=params, grads32=grads32, upcast=upcast, lowp=lowp):
            if upcast:
                torch._foreach_copy_(grads32, case.grads)
            optimizer.step()
            if lowp is not None:
                torch._foreach_copy_(lowp, [p.detach() for p in params])

        name = f"torch AdamW {label}"
        if upcast or lowp is not None:
            name += " + casts"
        runners[name] = run
    return runners


def deepspeed_runner(case: Case) -> dict:
    if DEEPSPEED_CPU_ADAM is None or case.grads[0].dtype != torch.float32 or case.params_lowp:
        return {}
    params = [p.clone().requires_grad_(True) for p in case.params]
    for p, g in zip(params, case.grads):
        p.grad = g
    return {"DeepSpeed DeepSpeedCPUAdam": DEEPSPEED_CPU_ADAM(params, **HP).step}


# The loop must be compiled inside the target region of the level it runs at (as csrc does, one
# level per translation unit), so the source is built for the level cpu_adam runs at.
_LEVEL_REGIONS = {
    "avx512": ('#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")',
               "common/cpu_simd_avx512.h", "Avx512Lanes"),
    "avx2": ('#pragma GCC target("avx2,fma,f16c")', "common/cpu_simd_avx2.h", "Avx2Lanes"),
    "scalar": ("", "common/cpu_simd_scalar.h", "ScalarLanes"),
}  # fmt: skip

_LIMITS_SOURCE = r"""
// The memory limit: csrc/common's multi-tensor loop with Adam's streams and trivial arithmetic.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>
#include <cmath>
#include <type_traits>
#include <vector>
#include "common/cpu_low_precision.h"
#include "common/cpu_multi_tensor.h"
#include "common/cpu_optimizer_streams.h"

namespace bench { struct NoCoefficients {}; }

#pragma GCC push_options
TARGET_PRAGMA
#include "LANES_HEADER"
#include "common/cpu_stream_loop.h"
namespace deepspeed_cpp::cpu_optim { namespace {
struct SameStreams {
  static constexpr int kStates = 2;
  using Coefficients = bench::NoCoefficients;
  template <class L> struct Lanes { explicit Lanes(const Coefficients&) {} };
  template <class L> static void update(typename L::F& p, typename L::F g, typename L::F* s,
                                        const Lanes<L>&) {
    s[0] = L::add(s[0], g); s[1] = L::add(s[1], g); p = L::add(p, g);
  }
};
} }
namespace bench {
deepspeed_cpp::cpu_optim::RangeKernels<NoCoefficients> kernels(
    const deepspeed_cpp::cpu_optim::StreamTypes& types) {
  using namespace deepspeed_cpp::cpu_optim;
  return pick_kernels<LANES_TYPE, SameStreams>(types);
}
}  // namespace bench
#pragma GCC pop_options

namespace {
deepspeed_cpp::cpu_optim::ElementType type_of(const at::Tensor& t) {
  using deepspeed_cpp::cpu_optim::ElementType;
  return t.scalar_type() == at::kFloat ? ElementType::kFloat32
         : t.scalar_type() == at::kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat16;
}

void same_streams(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                  at::TensorList exp_avg_sqs, at::TensorList params_lowp) {
  using namespace deepspeed_cpp;
  cpu_optim::StreamTypes types;
  types.grad = type_of(grads[0]);
  if (!params_lowp.empty()) types.param_lowp = type_of(params_lowp[0]);
  std::vector<cpu_optim::OptimizerTensor> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    tensors.push_back({params[i].data_ptr(), grads[i].data_ptr(),
                       {exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr()},
                       params_lowp.empty() ? nullptr : params_lowp[i].data_ptr(),
                       params[i].numel()});
  }
  cpu_optim::run_multi_tensor_step(tensors, bench::kernels(types), bench::NoCoefficients{}, 1.0f,
                                   nullptr);
}
}  // namespace

TORCH_LIBRARY(deepspeed_cpp_bench, m) {
  m.def("same_streams(Tensor(a!)[] p, Tensor[] g, Tensor(b!)[] m, Tensor(c!)[] v, "
        "Tensor(d!)[] lowp) -> ()");
}
TORCH_LIBRARY_IMPL(deepspeed_cpp_bench, CPU, m) { m.impl("same_streams", &same_streams); }
"""


def _load_limits_kernel() -> None:
    from torch.utils.cpp_extension import load_inline

    from deepspeed_cpp.ops.op_builder.builder import BASE_CXX_FLAGS, csrc_dir

    level = cpu_adam_isa()
    pragma, header, lanes = _LEVEL_REGIONS[level]
    source = (_LIMITS_SOURCE.replace("TARGET_PRAGMA", pragma).replace("LANES_HEADER", header)
              .replace("LANES_TYPE", lanes))  # fmt: skip
    load_inline(name=f"deepspeed_cpp_bench_limits_{level}", cpp_sources=source,
                extra_cflags=BASE_CXX_FLAGS + ["-fopenmp", f"-I{csrc_dir()}"],
                extra_ldflags=["-fopenmp"], is_python_module=False)  # fmt: skip


def memory_limit_runner(case: Case):
    lowp = case.params_lowp or []
    return lambda: torch.ops.deepspeed_cpp_bench.same_streams(
        case.params, case.grads, case.exp_avgs, case.exp_avg_sqs, lowp
    )


def arithmetic_limit(case: Case, reps: int) -> float:
    """Seconds our op would take on the case's elements if every stream were in L2."""
    numel = 4 * 32768  # 2 MiB of float32 streams: in the two cores' L2 caches
    small = Case("in cache", [(numel,)], case.grads[0].dtype,
                 None if case.params_lowp is None else case.params_lowp[0].dtype)  # fmt: skip
    for _ in range(20):
        small.ours()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(50):
            small.ours()
        samples.append((time.perf_counter() - start) / 50)
    return statistics.median(samples) * case.numel / numel


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


def report(case: Case, medians: dict[str, float]) -> None:
    ours = medians["ours"]
    print(f"\n{case.title}: {case.numel / 1e6:.1f}M params in {len(case.params)} tensors, "
          f"{case.bytes_per_param} bytes/param")  # fmt: skip
    print(f"  {'implementation':<32} {'ms/step':>9} {'GB/s':>7} {'time / ours':>12}")
    for name, seconds in medians.items():
        gbps = case.bytes_per_param * case.numel / seconds / 1e9
        ratio = "" if name == "ours" else f"{seconds / ours:.2f}x"
        print(f"  {name:<32} {seconds * 1e3:9.2f} {gbps:7.1f} {ratio:>12}")
    binding = max(medians[MEMORY_LIMIT], medians[ARITHMETIC_LIMIT])
    print(f"  ours reaches {binding / ours:.0%} of the binding limit "
          f"({'memory' if binding == medians[MEMORY_LIMIT] else 'arithmetic'})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--numel", type=int, default=64 * 2**20)
    parser.add_argument("--skip-gpt2", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_cpu_adam()
    _load_limits_kernel()
    print(f"threads={args.threads} reps={args.reps} torch={torch.__version__} "
          f"isa={cpu_adam_isa()}")  # fmt: skip
    if DEEPSPEED_CPU_ADAM is None:
        print(f"note: DeepSpeed's DeepSpeedCPUAdam is not available ({DEEPSPEED_MISSING}); "
              "its rows are omitted")  # fmt: skip
    else:
        print("note: DeepSpeed has no fused bf16-grad + copy-out step; that case has no row of it")
    cases = [lambda: Case("one fp32 tensor", [(args.numel,)])]
    if not args.skip_gpt2:
        cases.append(lambda: Case("GPT-2-small-like list", gpt2_small_shapes()))
    cases.append(lambda: Case("fp32 master + bf16 grads + bf16 copy-out", [(args.numel,)],
                              torch.bfloat16, torch.bfloat16))  # fmt: skip
    for make_case in cases:
        case = make_case()
        runners = {"ours": case.ours}
        runners.update(torch_runners(case))
        runners.update(deepspeed_runner(case))
        runners[MEMORY_LIMIT] = memory_limit_runner(case)
        medians = time_interleaved(runners, args.reps)
        medians[ARITHMETIC_LIMIT] = arithmetic_limit(case, args.reps)
        report(case, medians)
        del case, runners


if __name__ == "__main__":
    main()
