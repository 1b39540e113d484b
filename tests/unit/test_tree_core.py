"""Tree values, layout, greedy acceptance and the CPU tree attention golden test (no engine)."""

import numpy as np
import pytest
import torch

from vllm_treespec.api import DraftTree, DraftTreeError
from vllm_treespec.tree import TreeBatch, greedy_accept, tree_layout
from proposers_helpers import random_tree


def test_draft_tree_validation_names_the_problem():
    with pytest.raises(DraftTreeError, match="parents"):
        DraftTree([1, 2], [0, -1])
    with pytest.raises(DraftTreeError, match="nodes"):
        DraftTree([1, 2, 3], [-1, 0])
    for parents in ([0], [-1, 1], [-1, -2], [-1, 0, 3]):  # a parent at or after its node, or below the root
        with pytest.raises(DraftTreeError, match="parents"):
            DraftTree(list(range(len(parents))), parents)
    with pytest.raises(DraftTreeError, match="non-negative"):
        DraftTree([1, -5], [-1, 0])
    with pytest.raises(DraftTreeError, match="parents"):  # the parents' problem is named first
        DraftTree([-1, 2], [-1, 1])
    t = DraftTree([5, 6, 7, 8], [-1, -1, 0, 1])
    assert t.depths().tolist() == [1, 1, 2, 2]
    assert t.first_child_chain().token_ids.tolist() == [5, 7]
    assert t.truncate(3).parents.tolist() == [-1, -1, 0]
    assert DraftTree.chain([1, 2, 3]).is_chain() and not t.is_chain()
    assert t.path_to(3) == [1, 3]


def test_a_tree_built_from_valid_arrays_skips_the_checks_but_not_the_dtypes():
    """``of_valid`` (re-priced and trimmed trees) stores what the checked constructor stores, in the same dtypes."""
    token_ids, parents = np.array([5, 6, 7], np.int32), np.array([-1, -1, 0], np.int64)
    probs, sources = np.array([0.5, 0.25, 0.125]), np.array([0, 1, 0], np.int64)
    checked, trusted = DraftTree(token_ids, parents, probs, sources), DraftTree.of_valid(token_ids, parents, probs,
                                                                                          sources)
    for name in ("token_ids", "parents", "node_probs", "node_sources"):
        a, b = getattr(checked, name), getattr(trusted, name)
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert DraftTree.of_valid(token_ids, parents).node_probs is None
    assert checked.truncate(2).parents.dtype == np.int32 and checked.truncate(2).num_nodes == 2


def test_layout_matches_ancestor_walk():
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, n) for n in (1, 5, 17, 64)]
    batch = TreeBatch.build(np.arange(4), list("abcd"), trees, np.zeros(4), np.zeros(4))
    for r, t in enumerate(trees):
        assert np.array_equal(batch.depth[batch.node_offsets[r]: batch.node_offsets[r + 1]], t.depths())
        for i in range(t.num_nodes):
            expect = {0, i + 1} | {a + 1 for a in t.path_to(i)}
            assert set(np.nonzero(batch.mask[r, i + 1])[0].tolist()) == expect
        assert batch.mask[r, 0].tolist() == [True] + [False] * (batch.width - 1)


def brute_force_greedy(tree: DraftTree, argmax_rows: np.ndarray) -> tuple[list[int], int]:
    best: list[int] = []
    for i in range(tree.num_nodes):
        path = tree.path_to(i)
        rows = [0] + [n + 1 for n in path[:-1]]
        if all(tree.token_ids[n] == argmax_rows[r] for n, r in zip(path, rows)) and len(path) > len(best):
            best = path
    return best, int(argmax_rows[best[-1] + 1] if best else argmax_rows[0])


def test_greedy_accept_equals_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(200):
        trees = [random_tree(rng, int(rng.integers(1, 30)), vocab=3) for _ in range(4)]
        batch = TreeBatch.build(np.arange(4), list("abcd"), trees, np.zeros(4), np.zeros(4))
        widths = np.diff(batch.node_offsets) + 1
        row_offsets = np.cumsum(widths) - widths
        argmax = rng.integers(0, 3, widths.sum())
        out_tokens, out_nodes, out_len = greedy_accept(batch.tokens, batch.parents, batch.depth, batch.node_offsets,
                                                       row_offsets, argmax, 40)
        for r, t in enumerate(trees):
            path, bonus = brute_force_greedy(t, argmax[row_offsets[r]: row_offsets[r] + widths[r]])
            assert out_len[r] == len(path)
            assert out_nodes[r, : len(path)].tolist() == path
            assert out_tokens[r, : len(path) + 1].tolist() == [int(t.token_ids[n]) for n in path] + [bonus]
            assert (out_tokens[r, len(path) + 1:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tree_attention_matches_reference(dtype):
    pytest.importorskip("vllm")
    from vllm_treespec.attn import layout
    from vllm_treespec.attn.cpu import tree_attention_cpu
    from vllm_treespec.attn.plan import build_plan
    from vllm_treespec.attn.reference import reference_tree_attention

    torch.manual_seed(0)
    rng = np.random.default_rng(2)
    num_blocks, hkv, hq, d, bs = 40, 3, 9, 64, 32
    assert layout.self_check("vec", dtype, bs, d, hkv)
    kv_cache = torch.zeros(num_blocks, hkv, bs, 2 * d, dtype=dtype)
    contexts = [0, 5, 31, 70, 200]
    trees = [random_tree(rng, n) for n in (3, 1, 12, 33, 64)]
    block_table = torch.zeros(len(trees), 10, dtype=torch.int32)
    free = list(rng.permutation(num_blocks))
    raw, query_rows, q_start, total = [], [], [], 0
    for r, (c, t) in enumerate(zip(contexts, trees)):
        length = c + t.num_nodes + 1
        nb = -(-length // bs)
        block_table[r, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        k = torch.randn(length, hkv, d).to(dtype)
        v = torch.randn(length, hkv, d).to(dtype)
        pos = torch.arange(length)
        slots = block_table[r, pos // bs].long() * bs + pos % bs
        layout.write_slots(kv_cache, slots, k, v, "vec")
        raw.append((k, v))
        query_rows.append(torch.randn(t.num_nodes + 1, hq, d).to(dtype))
        q_start.append(total)
        total += t.num_nodes + 1
    batch = TreeBatch.build(np.arange(len(trees)), [str(i) for i in range(len(trees))], trees, np.array(q_start),
                            np.array(contexts))
    query = torch.cat(query_rows)
    output = torch.full((total, hq * d), float("nan"), dtype=dtype)
    plan = build_plan(batch, block_table, bs)
    tree_attention_cpu(plan, query, kv_cache, output, 0.125, hq, d)
    out = output.view(total, hq, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r, (c, t) in enumerate(zip(contexts, trees)):
        k, v = raw[r]
        ref = reference_tree_attention(query_rows[r], k[:c], v[:c], k[c:], v[c:], t.parents, 0.125)
        got = out[q_start[r]: q_start[r] + t.num_nodes + 1].double()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
