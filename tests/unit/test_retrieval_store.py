"""Retrievers: one interface, context sync, merged sources, and enforced memory bounds."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval_reference import check_best_first, followers, stdlib_tokens  # noqa: F401
from vllm_treespec.retrieval import (NgramRetriever, Retriever, SuccessorRetriever, SuccessorTable, SuffixAutomaton,
                                     SuffixRetriever)
from vllm_treespec.retrieval.store import GlobalSuffixStore


def test_all_retrievers_share_the_interface(stdlib_tokens):
    ctx = np.concatenate([stdlib_tokens[:4000], stdlib_tokens[2000:2010]])  # ends with a repeat
    table = SuccessorTable(4096, 4)
    table.update(ctx[:-1], np.stack([ctx[1:], ctx[1:], ctx[1:], ctx[1:]], 1), np.full((len(ctx) - 1, 4), 0.2))
    for r in (SuffixRetriever(), NgramRetriever(), SuccessorRetriever(table)):
        assert isinstance(r, Retriever)
        tree = r.retrieve("req", ctx, 16)
        assert 0 < tree.num_nodes <= 16 and tree.match_len >= 1
        assert tree.parents[0] == -1 and np.all(tree.parents < np.arange(tree.num_nodes))
        r.release(["req"])


def test_suffix_retriever_tracks_a_growing_context(stdlib_tokens):
    r = SuffixRetriever(global_max_tokens=0, min_prob=0.0)
    text = stdlib_tokens[:3000].tolist()
    for n in range(1000, 3000, 250):
        tree = r.retrieve("a", np.array(text[:n]), 12)
        fresh = SuffixAutomaton()
        fresh.extend(text[:n])
        state, length = fresh.self_match()
        assert tree.match_len == length
        if length == 0:  # the last token is new: nothing to continue
            assert tree.num_nodes == 0
            continue
        suffix = tuple(text[n - length:n])
        check_best_first(tree, lambda p: followers(text[:n], suffix + p), 12, r.max_depth)
    # a context that does not extend the indexed one is indexed afresh
    other = np.array(text[1500:2500])
    tree = r.retrieve("a", other, 12)
    assert len(r.requests.get("a", 0, 0).index) == len(other)


def test_global_store_serves_finished_outputs():
    r = SuffixRetriever(global_max_tokens=1000)
    prompt = np.array([100, 101, 102])
    output = np.array([5, 6, 7, 8, 9, 10])
    r.retrieve("done", np.concatenate([prompt, output[:1]]), 8, prompt_len=3)
    r.retrieve("done", np.concatenate([prompt, output]), 8)
    r.release(["done"])
    assert r.global_store.sam.tokens[: len(r.global_store)].tolist() == output.tolist() + [-1]
    tree = r.retrieve("new", np.array([50, 51, 5, 6]), 8)  # per-request automaton has no earlier "5 6"
    assert tree.token_ids.tolist() == [7, 8, 9, 10] and tree.match_len == 2
    r.release(["new"], commit=False)
    assert len(r.global_store) == 7


def test_corpus_and_request_trees_are_merged():
    corpus = SuffixAutomaton()
    corpus.add_document([1, 2, 3, 4])
    r = SuffixRetriever(global_max_tokens=0, corpus=corpus.compact())
    tree = r.retrieve("x", np.array([1, 2, 9, 1, 2]), 8)  # request says 1 2 -> 9, corpus says 1 2 -> 3 4
    assert sorted(tree.paths()) == [[3], [3, 4], [9], [9, 1], [9, 1, 2]]


def test_max_spec_factor_and_min_match_len():
    ctx = np.array([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert SuffixRetriever(max_spec_factor=1.0).retrieve("a", ctx, 16).num_nodes == 2
    assert SuffixRetriever(min_match_len=3).retrieve("a", ctx, 16).num_nodes == 0
    assert SuffixRetriever().retrieve("a", ctx, 16).token_ids.tolist() == [3, 4, 5, 6, 7, 8, 1, 2]


def test_request_count_bound_evicts_least_recently_used(stdlib_tokens):
    r = SuffixRetriever(max_requests=3, global_max_tokens=0)
    for i in range(5):
        r.retrieve(i, stdlib_tokens[i * 100:(i + 1) * 100 + 50], 4)
        r.retrieve(0, stdlib_tokens[:50], 4)  # keep request 0 fresh
    assert len(r.requests) == 3 and 0 in r.requests and 4 in r.requests and 1 not in r.requests


@pytest.mark.parametrize("kind", ["suffix", "ngram"])
def test_memory_stays_inside_the_configured_bound(stdlib_tokens, kind):
    """Soak: many long requests, each past the per-request bound, and finished outputs past the global bound."""
    if kind == "suffix":
        r = SuffixRetriever(max_tokens_per_request=2000, max_requests=4, global_max_tokens=5000)
    else:
        r = NgramRetriever(max_tokens_per_request=2000, max_requests=4)
    rng = np.random.default_rng(0)
    peak = 0
    for req in range(12):
        start = int(rng.integers(0, len(stdlib_tokens) - 7000))
        for n in range(100, 7000, 700):
            tree = r.retrieve(req, stdlib_tokens[start:start + n], 8)
            assert tree.num_nodes <= 8
            peak = max(peak, r.nbytes)
            for item in r.requests.values():
                assert len(item.index) <= 2000
        if req % 2:
            r.release([req])
        if kind == "suffix":
            assert len(r.global_store) <= 5000
    assert len(r.requests) <= 4
    assert peak <= r.max_nbytes()


def test_global_store_evicts_oldest_documents():
    store = GlobalSuffixStore(max_tokens=100)
    for d in range(30):
        store.add(np.full(9, d))
        assert len(store) <= 100
    kept = store.sam.tokens[: len(store)].tolist()
    assert kept[-10:] == [29] * 9 + [-1] and 0 not in kept  # newest kept, oldest gone
    assert store.sam.match([29, 29])[1] == 2 and store.sam.match([0, 0])[1] == 0
    store.add(np.arange(500))  # longer than the bound: its tail is kept
    assert len(store) == 100 and store.sam.tokens[98] == 499
