#!/usr/bin/env bash
# Issue 5 side-by-side: no speculation, vLLM ngram, vLLM's own eagle3 chain (k = 3, 5, 7) with our trained head,
# and eagle_tree at verify budgets 3 / 5 / 7 (the chains' verified tokens) and 16 / 32 / 64 -- one invocation, one
# baseline, per-position acceptance included.
#   bash scripts/bench_eagle.sh                 # fp32 (exactness), 2 questions per category
#   DTYPE=bfloat16 LIMIT=4 bash scripts/bench_eagle.sh
#   TREE_BUDGETS="3 5 7" CHAINS="3 5 7" FLOORED_BUDGETS="" bash scripts/bench_eagle.sh   # equal verified tokens only
# Needs the trained head (vllm-treespec train-eagle -o "$HEAD"; default: the cache path eagle_tree uses).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
source scripts/_head.sh
DTYPE=${DTYPE:-float32}
LIMIT=${LIMIT:-2}
E="\"model\":\"$HEAD\""
METHODS="none"
METHODS+=";ngram:{\"num_speculative_tokens\":5,\"prompt_lookup_max\":4,\"prompt_lookup_min\":2}"
for k in ${CHAINS:-3 5 7}; do METHODS+=";eagle3_k$k=eagle3:{$E,\"num_speculative_tokens\":$k}"; done
# budget rows fill the budget (floor 0: the chains' verified tokens); floored rows use the device's default
# min_node_confidence (CPU 0.05), which verifies only likely nodes
for n in ${TREE_BUDGETS:-3 5 7 16 32 64}; do METHODS+=";eagle_tree$n=eagle_tree:{\"checkpoint\":\"$HEAD\",\"num_speculative_tokens\":$n,\"min_node_confidence\":0}"; done
for n in ${FLOORED_BUDGETS:-16}; do METHODS+=";eagle_tree${n}_floored=eagle_tree:{\"checkpoint\":\"$HEAD\",\"num_speculative_tokens\":$n}"; done
exec .venv/bin/vllm-treespec bench --prompts mt_bench,humaneval --limit "$LIMIT" --max-tokens "${MAX_TOKENS:-128}" \
  --dtype "$DTYPE" --enforce-eager --methods "$METHODS" --out "${OUT:-bench_out/eagle_$DTYPE}" "$@"
