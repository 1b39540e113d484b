"""``ngram_tree``: prompt lookup decoding (PLD; vLLM ``ngram``) generalised to trees.

Reads each request's committed tokens (``ctx.committed(i)``). The longest n-gram (``min_n..max_n``) ending the context
that occurred earlier selects up to ``max_occurrences`` of its most recent earlier occurrences; what followed each is
merged into a counted trie, and the tree takes its nodes best-first by the fraction of occurrences that agree
(:class:`vllm_treespec.retrieval.NgramRetriever`). Needs no model, hidden states or KV cache.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_treespec.proposers._retrieval_base import RetrievalTreeProposer, check_positive, check_unit
from vllm_treespec.retrieval import NgramRetriever


class NgramTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: nodes per tree; None = the verify budget (num_speculative_tokens)
    max_nodes: int | None = None
    #: shortest n-gram ending the context that is looked up
    min_n: int = 2
    #: longest n-gram looked up; the longest one that occurred earlier selects the continuations
    max_n: int = 4
    #: most recent earlier occurrences of the matched n-gram that vote
    max_occurrences: int = 32
    #: deepest level of the tree
    max_depth: int = 8
    #: drop a node whose confidence (fraction of agreeing occurrences) is below this
    min_token_prob: float = 0.0
    #: drop a node whose path confidence is below this
    min_confidence: float = 0.0
    #: a request's index covers at most this many of its latest tokens
    max_tokens_per_request: int = 32768
    #: requests whose index is kept (least recently used ones are dropped first)
    max_cached_requests: int = 256

    def __post_init__(self) -> None:
        check_positive("ngram_tree", self, "min_n", "max_n", "max_occurrences", "max_depth", "max_tokens_per_request",
                        "max_cached_requests")
        if self.max_nodes is not None:
            check_positive("ngram_tree", self, "max_nodes")
        if self.max_n < self.min_n:
            raise ValueError(f"ngram_tree option 'max_n' ({self.max_n}) must be >= 'min_n' ({self.min_n})")
        if self.max_tokens_per_request < 2:
            raise ValueError("ngram_tree option 'max_tokens_per_request' must be >= 2")
        check_unit("ngram_tree", self, "min_token_prob", "min_confidence")


class NgramTreeProposer(RetrievalTreeProposer):
    options_type = NgramTreeOptions

    def __init__(self, vllm_config: Any = None, options: NgramTreeOptions | None = None) -> None:
        super().__init__(vllm_config, options)
        opts: NgramTreeOptions = self.options
        self.retriever = NgramRetriever(
            min_n=opts.min_n, max_n=opts.max_n, max_occurrences=opts.max_occurrences, max_depth=opts.max_depth,
            min_prob=opts.min_token_prob, min_score=opts.min_confidence,
            max_tokens_per_request=opts.max_tokens_per_request, max_requests=opts.max_cached_requests)
