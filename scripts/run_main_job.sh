#!/usr/bin/env bash
# Sets everything up (scripts/setup_env.sh) and runs the main job.
# Until the training engine lands, the main job is the CPU Adam benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
"$VENV/bin/python" -m deepspeed_cpp.env_report --load
"$VENV/bin/python" benchmarks/bench_cpu_adam.py "$@"
