"""``suffix_tree``: SuffixDecoding-style retrieval trees (arXiv 2411.04975) from suffix automata.

Reads each request's committed tokens (``ctx.committed(i)``). Three sources answer, and their trees are merged
(:class:`vllm_treespec.retrieval.SuffixRetriever`): a per-request automaton over the request's own prompt and output
(longest earlier-occurring suffix), a global automaton over the outputs of finished requests (kept across restarts in
a file with ``global_file``), and optionally a corpus datastore built with ``vllm-treespec datastore build``. Nodes
are chosen best-first by path probability, where each node's confidence is the empirical probability of its token
after the matched suffix and its path (``node_probs``).
Needs no model, hidden states or KV cache.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import numpy as np

from vllm_treespec.api import ProposeContext
from vllm_treespec.proposers._retrieval_base import (RetrievalTreeProposer, check_datastore_option,
                                                     check_positive, check_store_file_option, check_unit,
                                                     open_store_file, save_store_file)
from vllm_treespec.retrieval import SuffixRetriever, load_datastore


class SuffixTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: nodes per tree; None = the verify budget (num_speculative_tokens)
    max_nodes: int | None = None
    #: deepest level of the tree
    max_depth: int = 24
    #: drop a node whose confidence (empirical next-token probability) is below this
    min_token_prob: float = 0.1
    #: drop a node whose path confidence (product of confidences from the root) is below this
    min_confidence: float = 0.0
    #: shortest context suffix a source must match to propose
    min_match_len: int = 1
    #: a source proposes at most max_spec_factor * match_len nodes (SuffixDecoding's adaptive length); None = off
    max_spec_factor: float | None = None
    #: context tokens matched against the global store and the corpus
    match_window: int = 32
    #: index finished outputs and retrieve from them
    use_global: bool = True
    #: also index the prompt of finished requests in the global store
    global_include_prompt: bool = False
    #: tokens the global store of finished outputs holds; when full, the oldest outputs are dropped
    global_max_tokens: int = 1 << 20
    #: datastore file that keeps the global store across restarts: loaded at start (if it exists), saved every
    #: ``global_save_every`` finished requests and at shutdown. None = kept in memory only
    global_file: str | None = None
    #: finished requests between two saves of ``global_file``
    global_save_every: int = 256
    #: a request's automaton covers at most this many of its latest tokens
    max_tokens_per_request: int = 32768
    #: requests whose automaton is kept (least recently used ones are dropped first)
    max_cached_requests: int = 256
    #: corpus datastore file (``vllm-treespec datastore build``); None = no corpus
    datastore: str | None = None

    def __post_init__(self) -> None:
        check_positive("suffix_tree", self, "max_depth", "min_match_len", "match_window", "global_max_tokens",
                        "max_tokens_per_request", "max_cached_requests", "global_save_every")
        if self.max_nodes is not None:
            check_positive("suffix_tree", self, "max_nodes")
        check_unit("suffix_tree", self, "min_token_prob", "min_confidence")
        if self.max_spec_factor is not None and not self.max_spec_factor > 0:
            raise ValueError(f"suffix_tree option 'max_spec_factor' must be > 0 or null, got {self.max_spec_factor}")
        if self.global_max_tokens < 2 or self.max_tokens_per_request < 2:
            raise ValueError("suffix_tree options 'global_max_tokens' and 'max_tokens_per_request' must be >= 2")
        if self.datastore is not None:
            check_datastore_option("suffix_tree option 'datastore'", self.datastore)
        if self.global_file is not None:
            if not self.use_global:
                raise ValueError("suffix_tree option 'global_file' keeps the global store of finished outputs: it "
                                 "needs 'use_global': true")
            self.global_file = os.path.expanduser(self.global_file)
            check_store_file_option("suffix_tree option 'global_file'", self.global_file)


class SuffixTreeProposer(RetrievalTreeProposer):
    options_type = SuffixTreeOptions

    def __init__(self, vllm_config: Any = None, options: SuffixTreeOptions | None = None) -> None:
        super().__init__(vllm_config, options)
        opts: SuffixTreeOptions = self.options
        corpus = None
        if opts.datastore is not None:
            model_config = getattr(vllm_config, "model_config", None)
            vocab = model_config.get_vocab_size() if model_config is not None else None
            tokenizer = getattr(model_config, "tokenizer", None) if model_config is not None else None
            corpus = load_datastore(opts.datastore, model_vocab_size=vocab, expected_tokenizer=tokenizer).automaton
        self.retriever = SuffixRetriever(
            max_depth=opts.max_depth, min_prob=opts.min_token_prob, min_score=opts.min_confidence,
            min_match_len=opts.min_match_len, max_spec_factor=opts.max_spec_factor, match_window=opts.match_window,
            max_tokens_per_request=opts.max_tokens_per_request, max_requests=opts.max_cached_requests,
            global_max_tokens=opts.global_max_tokens if opts.use_global else 0, corpus=corpus)
        self.store_file = open_store_file("suffix_tree option 'global_file'", opts.global_file, self.retriever,
                                          vllm_config, opts.global_save_every) if opts.global_file else None
        # finished outputs go whole into the global store (with their prompt when global_include_prompt: the
        # request's own automaton holds it, so those are indexed from there as before)
        self.wants_finished_outputs = opts.use_global and not opts.global_include_prompt

    def on_outputs_finished(self, outputs: dict[str, np.ndarray]) -> None:
        self.retriever.release(outputs, outputs=outputs)

    def on_requests_finished(self, req_ids: set[str]) -> None:
        super().on_requests_finished(req_ids)  # those on_outputs_finished did not index whole, as far as read
        save_store_file(self.store_file)

    def on_shutdown(self) -> None:
        save_store_file(self.store_file, now=True)

    def query(self, ctx: ProposeContext, i: int, budget: int):
        # the prompt length matters only when the request is first seen: the output starts after it
        prompt_len = 0 if self.options.global_include_prompt else ctx.prompt_len(i)
        return self.retriever.retrieve(ctx.req_ids[i], ctx.committed(i), budget, prompt_len=prompt_len)
