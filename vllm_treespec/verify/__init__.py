"""Worker-side tree verification: "verify as a tree, commit as a chain".

One :class:`TreeVerifier` lives on each model runner whose drafter is a :class:`~vllm_treespec.api.TreeProposer`.
Per step it
1. asks the proposer for trees and hands vLLM the flattened node lists (the scheduler sees ordinary drafts);
2. when those drafts come back scheduled, re-attaches the topology (only if the scheduled tokens are a prefix of
   the registered tree: truncation and placeholder drafts fall back to chains), rewrites the nodes' RoPE positions to
   ``context + depth`` and publishes the tree batch to the attention backend;
3. after the forward, accepts the longest valid path (greedy or lossless sampling), returns it in vLLM's chain form,
   and moves the accepted nodes' K/V to the chain slots, so that everything downstream sees a chain step.

Modules: :mod:`.verifier` (the orchestration and the list of vLLM runner attributes it relies on), :mod:`.support`
(which requests and models can verify as trees), :mod:`.attach` (trees to drafts and back, positions),
:mod:`.accept` (acceptance, chain form), :mod:`.compact` (which KV slots move), :mod:`.chainize` (hidden states in
chain order), :mod:`.report` (host time and counters).
"""

from vllm_treespec.verify.report import StepTimer, verifier_report
from vllm_treespec.verify.support import tree_attention_impls, tree_unsupported_reason
from vllm_treespec.verify.verifier import RUNNER_ATTRIBUTES, TreeVerifier

__all__ = ["RUNNER_ATTRIBUTES", "StepTimer", "TreeVerifier", "tree_attention_impls", "tree_unsupported_reason",
           "verifier_report"]
