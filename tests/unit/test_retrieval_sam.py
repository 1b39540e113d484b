"""Suffix automaton, n-gram index, successor table and tree merging against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retrieval_reference import check_best_first, followers, longest_match, occurrences, stdlib_tokens  # noqa: F401
from vllm_treespec.retrieval import NgramIndex, SuccessorTable, SuffixAutomaton, merge_trees, union_trees
from vllm_treespec.retrieval.tree import RetrievedTree

streams = st.lists(st.integers(0, 3), min_size=1, max_size=120)
tree_limits = st.tuples(st.integers(1, 24), st.integers(1, 8), st.sampled_from([0.0, 0.2, 0.5]),
                        st.sampled_from([0.0, 0.05, 0.3]))
SETTINGS = settings(max_examples=60, deadline=None)


def build(text: list[int], chunks: list[int] | None = None) -> SuffixAutomaton:
    sam = SuffixAutomaton(capacity=4)  # starts tiny so appends cross several growths
    i = 0
    for k in chunks or [len(text)]:
        sam.extend(text[i:i + k])
        i += k
    sam.extend(text[i:])
    return sam


@SETTINGS
@given(streams, st.lists(st.integers(1, 30), max_size=6))
def test_automaton_counts_match_brute_force(text, chunks):
    sam = build(text, chunks)
    assert len(sam) == len(text) and sam.num_states <= 2 * len(text) + 1 and sam.num_edges <= 3 * len(text) + 4
    for m in range(1, 6):
        for start in range(len(text) - m + 1):
            pattern = tuple(text[start:start + m])
            state, length = sam.match(pattern)
            assert length == m
            assert sam.count(state) == len(occurrences(text, pattern))
    for absent in ([4], [0, 4], text + [0, 1, 2, 3] * 3):
        assert sam.match(absent)[1] == longest_match(text, absent)


@SETTINGS
@given(streams)
def test_self_match_is_longest_earlier_suffix(text):
    state, length = build(text).self_match()
    expected = max([m for m in range(1, len(text)) if len(occurrences(text, tuple(text[len(text) - m:]))) >= 2],
                   default=0)
    assert length == expected


@SETTINGS
@given(streams, tree_limits)
def test_self_tree_is_best_first_over_earlier_continuations(text, limits):
    budget, max_depth, min_prob, min_score = limits
    sam = build(text)
    state, length = sam.self_match()
    suffix = tuple(text[len(text) - length:])
    tree = sam.tree(state, budget, max_depth, min_prob, min_score)
    if length == 0:
        return
    check_best_first(tree, lambda path: followers(text, suffix + path), budget, max_depth, min_prob, min_score)


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4),
       st.lists(st.integers(0, 3), min_size=1, max_size=12), tree_limits)
def test_documents_match_and_trees_never_cross_separators(docs, context, limits):
    budget, max_depth, min_prob, min_score = limits
    sam = SuffixAutomaton(capacity=4)
    stream: list[int] = []
    for d in docs:
        sam.add_document(d)
        stream += d + [-1]
    for automaton in (sam, sam.compact()):
        state, length = automaton.match(context)
        assert length == longest_match(stream, context)
        if length == 0:
            continue
        suffix = tuple(context[len(context) - length:])
        assert automaton.count(state) == len(occurrences(stream, suffix))
        tree = automaton.tree(state, budget, max_depth, min_prob, min_score)
        assert -1 not in tree[0].tolist()
        check_best_first(tree, lambda path: followers(stream, suffix + path), budget, max_depth, min_prob, min_score)


def test_real_token_stream_counts(stdlib_tokens):
    text = stdlib_tokens[:3000]
    sam = build(text.tolist(), [1000, 7, 993])
    rng = np.random.default_rng(0)
    lst = text.tolist()
    for start in rng.integers(0, len(lst) - 8, 40):
        for m in (1, 3, 8):
            pattern = tuple(lst[start:start + m])
            state, length = sam.match(pattern)
            assert length == m and sam.count(state) == len(occurrences(lst, pattern))
    state, length = sam.self_match()
    suffix = tuple(lst[len(lst) - length:])
    check_best_first(sam.tree(state, 32, 12), lambda p: followers(lst, suffix + p), 32, 12)


def test_compact_equals_dynamic(stdlib_tokens):
    sam = build(stdlib_tokens[:5000].tolist())
    static = sam.compact()
    assert static.num_states == sam.num_states and static.num_edges == sam.num_edges
    assert static.nbytes < sam.nbytes
    for start in range(100, 5000, 97):
        ctx = stdlib_tokens[start - 20:start]
        assert sam.match(ctx) == static.match(ctx)
        state, _ = sam.match(ctx)
        a, b = sam.tree(state, 24, 10), static.tree(state, 24, 10)
        # the same scores; which of several equally scored nodes fill the last slots may differ
        np.testing.assert_allclose(RetrievedTree(*a).path_scores(), RetrievedTree(*b).path_scores(), rtol=1e-6)


def test_repeated_token_run_stays_exact():
    sam = build([7] * 300)
    for m in (1, 150, 299):
        state, length = sam.match([7] * m)
        assert length == m and sam.count(state) == 300 - m + 1
    state, length = sam.self_match()
    assert length == 299
    tok, par, prob = sam.tree(state, 5, 5)
    # the earlier occurrence of 7*299 is followed by the final 7, and 7*300 has no earlier occurrence
    assert tok.tolist() == [7] and par.tolist() == [-1] and prob.tolist() == [1.0]


def test_capacity_bound_is_enforced():
    sam = SuffixAutomaton(capacity=8)
    sam.extend(np.arange(50) % 5, max_capacity=64)
    assert sam.cap_tokens <= 64 and sam.nbytes <= SuffixAutomaton.nbytes_for(64)
    try:
        sam.extend(np.zeros(20, np.int32), max_capacity=64)
    except ValueError as e:
        assert "capacity bound" in str(e)
    else:
        raise AssertionError("exceeding max_capacity must fail")


# --- n-gram index ---------------------------------------------------------------------------------------------------
def ngram_reference(text, min_n, max_n, max_occ):
    last = len(text) - 1
    for n in range(max_n, min_n - 1, -1):
        if last < n:
            continue
        gram = text[last - n + 1:]
        occ = [j for j in range(last - 1, n - 2, -1) if text[j - n + 1:j + 1] == gram][:max_occ]
        if occ:
            return n, occ
    return 0, []


@SETTINGS
@given(streams, st.integers(1, 3), st.integers(0, 2), st.integers(1, 6), tree_limits)
def test_ngram_tree_is_best_first_over_recent_occurrences(text, min_n, extra, max_occ, limits):
    budget, max_depth, min_prob, min_score = limits
    index = NgramIndex(min_n, min_n + extra, capacity=4)
    index.extend(text[: len(text) // 2])
    index.extend(text[len(text) // 2:])
    tok, par, prob, n = index.tree(budget, max_depth, max_occ, min_prob, min_score)
    n_ref, occ = ngram_reference(text, min_n, min_n + extra, max_occ)
    assert n == n_ref
    if not occ:
        assert tok.shape[0] == 0
        return

    def dist(path):
        d = len(path)
        agree = [j for j in occ if j + d + 1 < len(text) and tuple(text[j + 1:j + 1 + d]) == path]
        counts: dict[int, int] = {}
        for j in agree:
            counts[text[j + d + 1]] = counts.get(text[j + d + 1], 0) + 1
        return {t: c / len(agree) for t, c in counts.items()}

    check_best_first((tok, par, prob), dist, budget, max_depth, min_prob, min_score)


# --- successor table ------------------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(1, 4), st.integers(0, 2**31 - 1), tree_limits)
def test_successor_tree_is_best_first_over_rows(k, seed, limits):
    budget, max_depth, min_prob, min_score = limits
    rng = np.random.default_rng(seed)
    vocab = 6
    table = SuccessorTable(vocab, k)
    rows = rng.permutation(vocab)[: rng.integers(1, vocab + 1)]
    ids = np.stack([rng.choice(vocab, k, replace=False) for _ in rows])
    probs = rng.dirichlet(np.ones(k + 1), len(rows))[:, :k].astype(np.float32)
    table.update(rows, ids, probs)
    got_ids, got_probs = table.row(int(rows[0]))
    assert np.all(np.diff(got_probs) <= 0) and set(got_ids.tolist()) == set(ids[0].tolist())
    rowmap = {int(r): {int(t): float(np.float32(p)) for t, p in zip(ids[i], probs[i]) if p > 0}
              for i, r in enumerate(rows)}
    root = int(rows[0])
    tree = table.tree(root, budget, max_depth, min_prob, min_score)
    check_best_first(tree, lambda path: rowmap.get(path[-1] if path else root, {}), budget, max_depth, min_prob,
                     min_score)


@SETTINGS
@given(st.lists(st.integers(-1, 7), min_size=0, max_size=60), st.integers(1, 4), st.sets(st.integers(0, 5)))
def test_successor_seed_fills_empty_rows_with_their_most_frequent_followers(text, k, learned):
    vocab = 6  # tokens 6 and 7 lie outside the table, -1 is no token
    table = SuccessorTable(vocab, k)
    for t in learned:  # rows the target filled stay as they are
        table.update([t], [[(t + 1) % vocab]], [[0.9]])
    before_ids, before_probs = table.ids.copy(), table.probs.copy()
    table.seed(np.array(text, np.int64), 0.5)
    followers_of: dict[int, dict[int, int]] = {}
    for first, second in zip(text, text[1:]):
        if 0 <= first < vocab and second >= 0 and first not in learned:
            counts = followers_of.setdefault(first, {})
            counts[second] = counts.get(second, 0) + 1
    for t in range(vocab):
        if t not in followers_of:
            assert table.ids[t].tolist() == before_ids[t].tolist()
            assert table.probs[t].tolist() == before_probs[t].tolist()
            continue
        counts = followers_of[t]
        ranked = sorted(counts, key=lambda s: (-counts[s], s))[:k]
        total = sum(counts.values())
        assert table.ids[t].tolist() == ranked + [-1] * (k - len(ranked))
        assert table.probs[t].tolist() == [float(np.float32(0.5 * counts[s] / total)) for s in ranked] + \
            [0.0] * (k - len(ranked))


def test_successor_tree_runs_rank0_chain_deep():
    table = SuccessorTable(10, 3)
    for t in range(10):  # rank 0 continues t -> t+1 confidently, ranks 1-2 are weak alternatives
        table.update([t], [[(t + 1) % 10, (t + 5) % 10, (t + 7) % 10]], [[0.9, 0.06, 0.04]])
    tok, par, prob = table.tree(0, 12, max_depth=8)
    depths = RetrievedTree(tok, par, prob).depths()
    assert depths.max() == 8 and [1, 2, 3, 4, 5, 6, 7, 8] in RetrievedTree(tok, par, prob).paths()
    # the other 4 slots go to rank-1 branches near the root (0.06, 0.9 * 0.06, ...), which stay shallow
    assert RetrievedTree(tok, par, prob).paths()[8:] == [[5], [1, 6], [5, 6], [1, 2, 7]]


# --- merging --------------------------------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.integers(0, 3), min_size=2, max_size=80), st.lists(st.integers(0, 3), min_size=2, max_size=80),
       st.integers(1, 16))
def test_merge_is_best_first_over_union_with_max_scores(a, b, budget):
    trees = []
    for text in (a, b):
        sam = build(text)
        state, length = sam.self_match()
        trees.append(RetrievedTree(*sam.tree(state, 16, 6), match_len=length))
    merged = merge_trees(trees, budget)
    best: dict[tuple, float] = {}
    for t in trees:
        for path, score in zip(t.paths(), t.path_scores()):
            best[tuple(path)] = max(best.get(tuple(path), 0.0), float(score))
    # as a distribution: P(t | path) = best(path + t) / best(path)
    def dist(path):
        base = best[path] if path else 1.0
        return {p[-1]: best[p] / base for p in best if len(p) == len(path) + 1 and p[:-1] == path}

    check_best_first(merged, dist, budget, 6)
    assert merged.match_len == max(t.match_len for t in trees if t.num_nodes) if merged.num_nodes else True


def test_union_shares_paths_scales_attached_trees_and_names_each_score_s_origin():
    """union_trees (graft's merge): identical paths share a node that keeps the best score and the input node that
    gave it; a tree attached under an earlier tree's node is scaled by that node's score when it is added."""
    draft = (np.array([1, 2, 3]), np.array([-1, -1, 0]), np.array([0.5, 0.4, 0.5]))  # 1, 2 and 1 -> 3
    root = (np.array([1, 3]), np.array([-1, 0]), np.array([0.9, 0.5]))  # 1 -> 3 again, more confident
    under = (np.array([7]), np.array([-1]), np.array([0.5]))  # under input node 2 (the draft's 1 -> 3)
    u = union_trees([draft, root, under], [-1, -1, 2])
    assert u.token_ids.tolist() == [1, 2, 3, 7] and u.parents.tolist() == [-1, -1, 0, 2]
    assert np.allclose(u.scores, [0.9, 0.4, 0.45, 0.5 * 0.45])
    assert u.origin.tolist() == [3, 1, 4, 5] and u.node_of.tolist() == [0, 1, 2, 0, 2, 3]
    with pytest.raises(ValueError, match="earlier tree"):
        union_trees([draft, under], [-1, 3])
