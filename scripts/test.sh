#!/usr/bin/env bash
# Sets everything up (scripts/setup_env.sh) and runs the linters and the whole test suite.
#   bash scripts/test.sh [PYTEST ARGS]   # everything (what CI runs), the 25 slowest tests listed
#   bash scripts/test.sh --quick         # the edit loop: ops, config, one engine test per stage,
#                                        # one checkpoint round trip (no linters, no HF lowest)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
if [ "${1:-}" = --quick ]; then
  shift
  exec "$VENV/bin/python" -m pytest -q -ra "$@" tests/test_cpu_adam_op.py tests/test_zero_ops.py \
    tests/test_config.py tests/test_config_refusals.py tests/test_config_sources.py \
    tests/test_layering.py \
    "tests/test_engine_zero.py::test_matches_single_process_adamw_2_ranks" \
    "tests/test_engine_zero3.py::test_matches_single_process_adamw_2_ranks" \
    "tests/test_checkpoint.py::test_round_trip_restores_everything"
fi
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' |
  xargs "$VENV/bin/clang-format" --dry-run --Werror
"$VENV/bin/python" -m pytest -q -ra --durations=25 "$@"
# The lowest supported transformers/accelerate (scripts/hf_lowest.txt, installed by setup_env.sh):
# the config rules and one 2-rank ZeRO-2 training against transformers' own Trainer.
DS_CPP_HF_EXPECT_VERSIONS="$(grep -E '^(transformers|accelerate)==' scripts/hf_lowest.txt | xargs)" \
  PYTHONPATH="$VENV/hf-lowest${PYTHONPATH:+:$PYTHONPATH}" \
  "$VENV/bin/python" -m pytest -q -ra -p no:cacheprovider tests/test_hf_config_filling.py \
  "tests/test_hf_trainer.py::test_zero_stage_losses_equal_one_process_reference[2-False]"
