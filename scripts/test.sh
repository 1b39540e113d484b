#!/usr/bin/env bash
# The test suite: set up, then run pytest (slow sweeps are opt-in: `bash scripts/test.sh -m slow`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
# --durations: the slowest tests in the log, to keep the suite inside its time budget
exec "${VLLM_TREESPEC_VENV:-$ROOT/.venv}/bin/python" -m pytest -m "not slow" --timeout=900 --durations=15 "$@" tests
