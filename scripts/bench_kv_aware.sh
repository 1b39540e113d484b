#!/usr/bin/env bash
# Issue 9 side-by-side, one invocation, one baseline: no speculation, eagle_tree (EAGLE-3 head) and kv_aware with the
# hybrid and KV-only heads, all at the same verify budget, then graft on each model drafter; per-position acceptance
# included. Per-depth alpha (depth 1..8, MT-Bench and >=2k-token prompts): python scripts/eval_kv_alpha.py
#   bash scripts/bench_kv_aware.sh                 # fp32 (exactness), 2 questions per category, budget 16
#   BUDGET=32 LIMIT=1 bash scripts/bench_kv_aware.sh
#   CHAINS=0 ...   skip the depth-5 chain rows (vLLM eagle3 k=5, eagle_tree top_k=1, kv_aware hybrid top_k=1)
# Needs the trained heads: vllm-treespec train-eagle -o <cache>/eagle3-smollm2-135m and, with --mode kv / --mode
# hybrid, -o <cache>/kv-aware-smollm2-135m-{kv,hybrid} (the paths the proposers look in by default).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
PY=.venv/bin/python
path() { $PY -c "from vllm_treespec.proposers.eagle_tree import default_kv_head_path; print(default_kv_head_path('$1'))"; }
EAGLE=$(path hidden); KV=$(path kv); HYBRID=$(path hybrid)
for h in "$EAGLE" "$KV" "$HYBRID"; do
  [ -f "$h/config.json" ] || { echo "no head at $h: train it first (see the header of $0)" >&2; exit 2; }
done
DTYPE=${DTYPE:-float32}
LIMIT=${LIMIT:-2}
N=${BUDGET:-16}
D=${DEPTH:-6}
T=${TOP_K:-8}
# floor 0: every head fills the same budget (the CPU default floor would verify only likely nodes)
opts() { echo "\"checkpoint\":\"$1\",\"num_speculative_tokens\":$N,\"depth\":$D,\"top_k\":$T,\"min_node_confidence\":0"; }
METHODS="none"
METHODS+=";eagle_tree=eagle_tree:{$(opts "$EAGLE")}"
METHODS+=";kv_aware_hybrid=kv_aware:{$(opts "$HYBRID")}"
METHODS+=";kv_aware_kv=kv_aware:{$(opts "$KV")}"
if [ "${CHAINS:-1}" = 1 ]; then  # the same head as a depth-5 chain: ours (top_k=1) vs vLLM's own eagle3
  METHODS+=";eagle3_k5=eagle3:{\"model\":\"$EAGLE\",\"num_speculative_tokens\":5}"
  METHODS+=";eagle_chain5=eagle_tree:{\"checkpoint\":\"$EAGLE\",\"num_speculative_tokens\":5,\"depth\":5,\"top_k\":1,\"min_node_confidence\":0}"
  METHODS+=";kv_hybrid_chain5=kv_aware:{\"checkpoint\":\"$HYBRID\",\"num_speculative_tokens\":5,\"depth\":5,\"top_k\":1,\"min_node_confidence\":0}"
fi
METHODS+=";graft_eagle=graft:{\"eagle_checkpoint\":\"$EAGLE\",\"num_speculative_tokens\":$N}"
METHODS+=";graft_hybrid=graft:{\"eagle_checkpoint\":\"$HYBRID\",\"num_speculative_tokens\":$N}"
exec .venv/bin/vllm-treespec bench --prompts mt_bench,humaneval --limit "$LIMIT" --max-tokens "${MAX_TOKENS:-128}" \
  --dtype "$DTYPE" --enforce-eager --methods "$METHODS" --out "${OUT:-bench_out/kv_aware_$DTYPE}" "$@"
