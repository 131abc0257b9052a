#!/usr/bin/env bash
# Creates .venv (once) with torch and the tools, and installs deepspeed_cpp into it (editable).
# torch 2.14.1 is the CUDA build so that CUDA ops can be compiled (no GPU needed); it runs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
"$VENV/bin/python" -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
"$VENV/bin/python" -m pip install -q ninja numpy "pydantic>=2" matplotlib safetensors \
  pytest pytest-timeout ruff clang-format
MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" -m pip install -q --no-build-isolation -e .
