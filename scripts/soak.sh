#!/usr/bin/env bash
# Long soak of the OpenAI server with a tree method: 500 mixed requests at concurrency 16 against SmolLM2 (fp32),
# greedy replies compared with a no-speculation server, RSS of the server tree sampled throughout.
# Loopback only. Extra arguments go to `python -m vllm_treespec.tools.soak` (e.g. --speculative-config '{...}').
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VLLM_TREESPEC_VENV:-$ROOT/.venv}/bin/python"
mkdir -p "$ROOT/bench_out"
exec "$PY" -m vllm_treespec.tools.soak --requests 500 --concurrency 16 --json "$ROOT/bench_out/soak.json" "$@"
