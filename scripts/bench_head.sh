#!/usr/bin/env bash
# The EAGLE-3 head against everything else, batch 1, one invocation (round-robin repeats, one baseline):
# no speculation, vLLM ngram (k=5), vLLM's own eagle3 chain (k=3, 5) on the head, eagle_tree 16 on the same head,
# graft on the head, graft retrieval-only, suffix_tree, ngram_tree -- on prompts no default was chosen on and the
# head was not trained on (ShareGPT positions 600+ of the benchmark shuffle, training draws from 1000+; HumanEval
# 150+; the graft defaults were chosen on the first MT-Bench question per category and HumanEval's first).
#   bash scripts/bench_head.sh                     # fp32 (exactness checked), 3 repeats
#   DTYPE=bfloat16 bash scripts/bench_head.sh
#   PROMPTS="sharegpt[640:650]" REPEATS=1 MAX_TOKENS=128 bash scripts/bench_head.sh
#   CHAINS=" " bash scripts/bench_head.sh          # without vLLM's eagle3 chains
# HEAD defaults to the head eagle_tree uses without a checkpoint (a trained one in the cache, else the shipped one).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_head.sh
DTYPE=${DTYPE:-float32}
E="\"model\":\"$HEAD\""
METHODS="none"
METHODS+=";ngram:{\"num_speculative_tokens\":5,\"prompt_lookup_max\":4,\"prompt_lookup_min\":2}"
for k in ${CHAINS:-3 5}; do METHODS+=";eagle3_k$k=eagle3:{$E,\"num_speculative_tokens\":$k}"; done
METHODS+=";eagle_tree16=eagle_tree:{\"checkpoint\":\"$HEAD\",\"num_speculative_tokens\":16}"
METHODS+=";graft=graft:{\"eagle_checkpoint\":\"$HEAD\",\"num_speculative_tokens\":32}"
METHODS+=";graft_retrieval=graft:{\"eagle_checkpoint\":\"none\",\"num_speculative_tokens\":32}"
METHODS+=";suffix_tree:{\"num_speculative_tokens\":32}"
METHODS+=";ngram_tree:{\"num_speculative_tokens\":32}"
exec .venv/bin/vllm-treespec bench --prompts "${PROMPTS:-sharegpt[600:604],humaneval[150:152]}" \
  --max-tokens "${MAX_TOKENS:-96}" --repeats "${REPEATS:-3}" --dtype "$DTYPE" --enforce-eager --methods "$METHODS" \
  --out "${OUT:-bench_out/head_$DTYPE}" "$@"
