#!/usr/bin/env bash
# The DeepSpeed CIFAR-10 tutorial's run_ds_moe.sh through deepspeed_cpp's launcher: 2 processes,
# 2 experts split over them (expert parallelism), top-1 gating with RSample noise, DeepSpeed's
# MoE parameter groups. Extra arguments go to the script (e.g. --epochs 1). Top-2 gating:
# TOP_K=2 NOISY= (noisy gating is top-1 only). CONFIG picks the ZeRO stage and dtype.
set -euo pipefail
cd "$(dirname "$0")"
NUM_PROCS=${NUM_PROCS:-2}
EP_SIZE=${EP_SIZE:-2}
EXPERTS=${EXPERTS:-2}
TOP_K=${TOP_K:-1}
NOISY=${NOISY-RSample}
CONFIG=${CONFIG:-ds_config_zero2_fp32.json}
launcher_args=(--num_procs "${NUM_PROCS}")
if [[ -n "${MASTER_PORT:-}" ]]; then
    launcher_args+=(--master_port "${MASTER_PORT}")
fi
moe_args=(--moe --ep-world-size "${EP_SIZE}" --num-experts "${EXPERTS}" --top-k "${TOP_K}"
          --moe-param-group)
if [[ -n "${NOISY}" ]]; then
    moe_args+=(--noisy-gate-policy "${NOISY}")
fi
exec "${PYTHON:-python}" -m deepspeed_cpp.launcher "${launcher_args[@]}" \
    cifar10_deepspeed.py --deepspeed --deepspeed_config "${CONFIG}" "${moe_args[@]}" "$@"
