#!/usr/bin/env bash
# The main job: set up, then generate on the embedded SmolLM2 model with a tree method (default: graft).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
exec "${VLLM_TREESPEC_VENV:-$ROOT/.venv}/bin/vllm-treespec" demo "$@"
