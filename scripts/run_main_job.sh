#!/usr/bin/env bash
# Sets everything up (scripts/setup_env.sh) and runs the main job.
# The main job: the CIFAR-10 example (examples/cifar10) on 2 CPU processes with ZeRO stage 2,
# started through our launcher (torchrun underneath). Extra arguments go to the training script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
# The report compiles nothing (ops build on first use, only those the job uses).
"$VENV/bin/python" -m deepspeed_cpp.env_report
"$VENV/bin/python" -m deepspeed_cpp.launcher --num_procs 2 examples/cifar10/cifar10_deepspeed.py \
  --deepspeed --deepspeed_config examples/cifar10/ds_config_zero2_fp32.json "$@"
