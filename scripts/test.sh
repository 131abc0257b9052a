#!/usr/bin/env bash
# Sets everything up (scripts/setup_env.sh) and runs the linters and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
find csrc -name '*.h' -o -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' |
  xargs "$VENV/bin/clang-format" --dry-run --Werror
"$VENV/bin/python" -m pytest -q -ra "$@"
