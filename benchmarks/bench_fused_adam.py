"""GPU Adam step time: ours (deepspeed_cpp FusedAdam) vs torch's fused and foreach AdamW, and
DeepSpeed's and apex's FusedAdam when installed, in GB/s against the device's limits.

Per case it prints the median of interleaved repetitions (CUDA events, after a warm-up), each
reference's time over ours, and two physical limits measured in the same run: the device's copy
bandwidth (a device-to-device copy, bytes read + written) and a kernel with Adam's exact memory
streams (read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq in place) but
trivial arithmetic (see shared/design/measuring.md). Without a CUDA device it says so and exits:
no figure is ever printed that was not measured here.

    python benchmarks/bench_fused_adam.py [--reps 20] [--numel 134217728]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from deepspeed_cpp.optim import FusedAdam


def _optional(import_path: str, name: str):
    """(class, None) or (None, why it is missing)."""
    try:
        module = __import__(import_path, fromlist=[name])
        return getattr(module, name), None
    except Exception as error:  # noqa: BLE001 - any failure means "not available here"
        return None, f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 small (124M): ~150 tensors, many tiny, a few huge."""
    d, vocab, layers = 768, 50257, 12
    shapes = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,)]
        shapes += [(d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return shapes + [(d,), (d,)]


class Case:
    """Parameters with gradients, and one copy of them per implementation."""

    def __init__(self, title: str, shapes, dtype: torch.dtype):
        self.title, self.shapes, self.dtype = title, shapes, dtype
        self.numel = sum(torch.Size(s).numel() for s in shapes)
        element = torch.finfo(dtype).bits // 8
        # param read + written, grad read, exp_avg and exp_avg_sq read + written (param dtype)
        self.bytes_per_step = self.numel * element * 7

    def parameters(self) -> list[torch.nn.Parameter]:
        params = []
        for shape in self.shapes:
            p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=self.dtype))
            p.grad = torch.randn(shape, device="cuda", dtype=self.dtype) * 1e-2
            params.append(p)
        return params


def make_runners(case: Case) -> dict:
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    runners = {
        "ours (deepspeed_cpp FusedAdam)": FusedAdam(case.parameters(), **hp).step,
        "torch AdamW fused": torch.optim.AdamW(case.parameters(), fused=True, **hp).step,
        "torch AdamW foreach": torch.optim.AdamW(case.parameters(), foreach=True, **hp).step,
    }
    deepspeed_fused, _ = _optional("deepspeed.ops.adam", "FusedAdam")
    if deepspeed_fused is not None:
        runners["DeepSpeed FusedAdam"] = deepspeed_fused(case.parameters(), **hp).step
    apex_fused, _ = _optional("apex.optimizers", "FusedAdam")
    if apex_fused is not None:
        runners["apex FusedAdam"] = apex_fused(case.parameters(), adam_w_mode=True, **hp).step
    same_streams = _same_streams_kernel()
    params = case.parameters()
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]

    def memory_limit():
        for p, (m, v) in zip(params, states):
            same_streams(p, p.grad, m, v)

    runners["memory limit (same streams)"] = memory_limit
    return runners


_SAME_STREAMS_SOURCE = r"""
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
template <typename T>
__global__ void same_streams_kernel(T* p, const T* g, T* m, T* v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = float(g[i]);
    m[i] = T(float(m[i]) + x);
    v[i] = T(float(v[i]) + x);
    p[i] = T(float(p[i]) - x);
  }
}
void same_streams(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v) {
  const int64_t n = p.numel();
  const int blocks = int(std::min<int64_t>((n + 511) / 512, 65535 * 8));
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, p.scalar_type(), "same_streams", [&] {
    same_streams_kernel<scalar_t><<<blocks, 512, 0, stream>>>(
        p.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
        v.data_ptr<scalar_t>(), n);
  });
}
"""


def _same_streams_kernel():
    from torch.utils.cpp_extension import load_inline

    from deepspeed_cpp.ops.op_builder import FusedAdamBuilder

    FusedAdamBuilder().prepare_build()  # the CUDA toolkit our op is built with
    module = load_inline(name="deepspeed_cpp_bench_same_streams_cuda", cpp_sources=(
        "void same_streams(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v);"),
        cuda_sources=_SAME_STREAMS_SOURCE, functions=["same_streams"],
        extra_cuda_cflags=["-O3"])  # fmt: skip
    return module.same_streams


def copy_bandwidth(bytes_: int, reps: int) -> float:
    """GB/s of a device-to-device copy of `bytes_` (counting read + written bytes)."""
    source = torch.empty(bytes_ // 2, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return bytes_ / statistics.median(times[2:]) / 1e9


def time_interleaved(runners: dict, reps: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        for run in runners.values():
            run()
    torch.cuda.synchronize()
    samples = {name: [] for name in runners}
    for _ in range(reps):
        for name, run in runners.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def report(case: Case, medians: dict[str, float], copy_gbps: float) -> None:
    ours = medians["ours (deepspeed_cpp FusedAdam)"]
    limit = medians["memory limit (same streams)"]
    print(f"\n{case.title}: {case.numel / 1e6:.1f}M {str(case.dtype).removeprefix('torch.')} "
          f"params in {len(case.shapes)} tensors, {case.bytes_per_step / 1e9:.2f} GB moved "
          f"per step")  # fmt: skip
    print(f"  {'implementation':<32} {'ms/step':>9} {'GB/s':>8} {'time / ours':>12}")
    for name, seconds in medians.items():
        gbps = case.bytes_per_step / seconds / 1e9
        ratio = "" if name.startswith("ours") else f"{seconds / ours:.2f}x"
        print(f"  {name:<32} {seconds * 1e3:9.3f} {gbps:8.1f} {ratio:>12}")
    print(f"  device copy bandwidth (read + write): {copy_gbps:.1f} GB/s")
    print(f"  ours reaches {limit / ours:.0%} of the same-streams limit and "
          f"{case.bytes_per_step / ours / 1e9 / copy_gbps:.0%} of the copy bandwidth")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--numel", type=int, default=2**27)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (this benchmark needs a GPU; the CPU "
              "optimizer's is benchmarks/bench_cpu_adam.py)")  # fmt: skip
        return 0
    torch.manual_seed(0)
    print(f"device={torch.cuda.get_device_name()} torch={torch.__version__} reps={args.reps}")
    for import_path, name in (("deepspeed.ops.adam", "FusedAdam"), ("apex.optimizers",
                                                                    "FusedAdam")):  # fmt: skip
        cls, why = _optional(import_path, name)
        if cls is None:
            print(f"note: {import_path}.{name} is not available ({why}); its row is omitted")
    cases = [
        Case("one tensor", [(args.numel,)], torch.float32),
        Case("GPT-2-small-like list", gpt2_small_shapes(), torch.float32),
        Case("GPT-2-small-like list", gpt2_small_shapes(), torch.bfloat16),
    ]
    for case in cases:
        medians = time_interleaved(make_runners(case), args.reps)
        report(case, medians, copy_bandwidth(case.bytes_per_step, args.reps))
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
