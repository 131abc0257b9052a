#!/usr/bin/env bash
# Everything that needs an NVIDIA GPU, in one run with a time limit per step (issue 31): the
# environment, the op builds for this GPU, the CUDA tests, the engine on CUDA against the CPU,
# the CIFAR-10 example on the GPU, and the GPU benchmarks. Each step's output goes to
# RESULTS/<step>.log (default runs/gpu_check; $OUT on the lent device machine), with a one-line
# summary per step in RESULTS/summary.txt. A failing step does not stop the later ones. The build
# runs first; tests, engine and cifar then run side by side (the GPU and 16 cores have room);
# the benchmarks run last, alone, one after the other.
#
#   bash scripts/gpu_check.sh [STEP ...]   # env build tests engine cifar bench (= bench-fused-adam
#                                          # bench-moe bench-zero3); none: all of them
#
# Runs from the source tree (PYTHONPATH), with the python3 on PATH and its torch (a CUDA build);
# wheels in .whl/ (the package's pure-Python needs the machine lacks) are installed to a private
# folder first. GPU_CHECK_FAST=1 shortens the benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-${RESULTS:-runs/gpu_check}}
mkdir -p "$RESULTS"
SUMMARY="$RESULTS/summary.txt"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PYTHON" -c \
  'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)}
# The system's C++ compiler, the one Python and torch's libraries were built with, where the
# environment names another: on the lent H200 image CXX is /opt/gcc/bin/g++, whose libraries
# failed to link aio (no GLIBCXX symbol versions) and crashed on the first C++ exception thrown
# from an op (a segfault in test_reducer_device.py); /usr/bin/g++ built all of them cleanly.
if [ -n "${CXX:-}" ] && [ "$CXX" != /usr/bin/g++ ] && [ -x /usr/bin/g++ ] && [ -z "${GPU_CHECK_KEEP_CXX:-}" ]; then
  echo "gpu_check: CXX=$CXX replaced by /usr/bin/g++ (GPU_CHECK_KEEP_CXX=1 keeps it)"
  export CXX=/usr/bin/g++
fi
export DS_CPP_EXTENSIONS_DIR=${DS_CPP_EXTENSIONS_DIR:-/tmp/ds_cpp_gpu_check_ext}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/ds_cpp_site .whl/*.whl >/tmp/ds_cpp_pip.log 2>&1
  export PYTHONPATH="/tmp/ds_cpp_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step LOG NAME SECONDS COMMAND...: runs it under a time limit, logs, summarises
  local log="$RESULTS/$1.log" name=$2 limit=$3 start rc
  shift 3
  start=$(date +%s)
  echo "===== $name (limit ${limit}s): $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  rc=$?
  echo "===== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$log" "$SUMMARY"
}

wanted() { [ -z "$SELECTED" ] || [[ " $SELECTED " == *" $1 "* ]]; }
SELECTED="$*"
PYTEST=("$PYTHON" -m pytest -q -ra -p no:cacheprovider)

if wanted env; then
  step env env 60 bash -c "nvidia-smi; nvcc --version; which -a g++ c++; \${CXX:-c++} --version; \
echo 'int main() {}' | \${CXX:-c++} -x c++ - -o /tmp/ds_cpp_hello && ldd /tmp/ds_cpp_hello; \
$PYTHON -c 'import sys, torch; \
print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), \
torch.cuda.get_device_capability()); import pydantic; print(\"pydantic\", pydantic.__version__)'"
fi
if wanted build; then
  step build build 300 "$PYTHON" -m deepspeed_cpp.env_report --load
fi
if wanted tests; then
  # test_gpu_new_paths.py: the chunked optimizer step on device tensors, in-place gradients at
  # ZeRO 0 and ZeRO-3 block units with coalesced prefetch gathers, on CUDA (NCCL, one process).
  # Several workers (pytest-xdist, where installed): a test that crashes its process is reported
  # as such and the others still run and report.
  workers=()
  "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n 4)
  step tests tests 300 "${PYTEST[@]}" "${workers[@]}" --tb=short tests/test_fused_adam_cuda.py \
    tests/test_moe_gating_cuda.py tests/test_reducer_device.py tests/test_accelerator.py \
    tests/test_fused_adam_optimizer.py tests/test_gpu_new_paths.py &
fi
if wanted engine; then
  (
    runs=/tmp/ds_cpp_gpu_engine_runs
    mkdir -p $runs
    for device in cuda cpu; do
      step engine "engine-job-$device" 200 "$PYTHON" tests/gpu_engine_job.py --device $device \
        --out $runs/$device.pt --nvme-folder $runs/nvme-$device &
    done
    wait
    DS_GPU_ENGINE_RUNS=$runs step engine engine-compare 60 "${PYTEST[@]}" tests/test_gpu_engine.py
  ) &
fi
if wanted cifar; then
  step cifar cifar 300 "$PYTHON" -m deepspeed_cpp.launcher --num_procs 1 \
    examples/cifar10/cifar10_deepspeed.py --deepspeed \
    --deepspeed_config examples/cifar10/ds_config_zero2_bf16.json --epochs "${GPU_CHECK_EPOCHS:-2}" &
fi
wait
reps=20
[ "${GPU_CHECK_FAST:-0}" = 1 ] && reps=5
if wanted bench || wanted bench-fused-adam; then
  step bench bench-fused-adam 150 "$PYTHON" benchmarks/bench_fused_adam.py --reps "$reps"
fi
if wanted bench || wanted bench-moe; then
  step bench bench-moe 90 "$PYTHON" benchmarks/bench_moe.py --device cuda
fi
if wanted bench || wanted bench-zero3; then
  step bench bench-zero3 240 "$PYTHON" benchmarks/bench_gpu_zero3.py
fi
cat "$SUMMARY"
