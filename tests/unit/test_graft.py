"""graft: prune-then-graft trees through the public API with a fake ProposeContext, its options, calibration and
online successor learning; one end-to-end run on the embedded SmolLM2 model (fp32 greedy identical to no spec)."""

from __future__ import annotations

import json
import logging
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from vllm_treespec.api import DraftTree, ProposeContext, VerificationResult, load_proposer_class
from vllm_treespec.config import TreeSpecConfigError, parse_options
from vllm_treespec.proposers.graft import GraftOptions, GraftProposer
from vllm_treespec.verify.calibration import AcceptanceCalibration
from vllm_treespec.proposers.graft.assemble import assemble, assemble_tree
from vllm_treespec.proposers.graft.budget import BudgetCurve
from vllm_treespec.proposers.graft.calibration import load_calibration
from vllm_treespec.proposers.graft.drafter import MODEL_SOURCE, ModelDrafter
from vllm_treespec.proposers.graft.growth import DraftGrowth, DraftLevel, grow_draft
from vllm_treespec.proposers.graft.sources import MATCH_CLASSES, match_class, match_class_sources
from vllm_treespec.pruning import below_checkpoint
from vllm_treespec.tools.graft_calibrate import (CostModel, Episode, accepted_path, budget_table,
                                                     calibrate_from, replay)
from vllm_treespec.retrieval import RetrievedTree

VOCAB = 64


def make_ctx(contexts, sampled=None, req_ids=None, max_nodes=16) -> ProposeContext:
    width = max(len(c) for c in contexts) + 4
    token_ids = np.zeros((len(contexts), width), np.int64)
    for i, c in enumerate(contexts):
        token_ids[i, : len(c)] = c
    sampled = sampled if sampled is not None else [[int(c[-1])] for c in contexts]
    req_ids = req_ids or [f"r{i}" for i in range(len(contexts))]
    return ProposeContext(req_ids=list(req_ids), sampled_token_ids=sampled,
                          num_tokens=np.array([len(c) for c in contexts]), token_ids=token_ids, max_nodes=max_nodes)


def proposer(**options) -> GraftProposer:
    # these tests check tree shapes built from small made-up probabilities: no confidence floor unless asked
    options.setdefault("min_node_confidence", 0.0)
    return GraftProposer(None, GraftOptions(**options), vocab_size=VOCAB)


def test_confidence_floor_defaults_by_device_and_trims_unlikely_nodes():
    assert GraftProposer(None, GraftOptions(), vocab_size=VOCAB).min_node_confidence == 0.05  # no config: CPU
    gpu = SimpleNamespace(device_config=SimpleNamespace(device_type="cuda"))
    assert GraftProposer(gpu, GraftOptions(), vocab_size=VOCAB).min_node_confidence == 0.0
    with pytest.raises(ValueError, match="min_node_confidence"):
        GraftOptions(min_node_confidence=1.0)
    # successor chain 1 -> 10 -> 11 -> ... with probability 0.5 each: path confidence halves per level
    chain = [1] + list(range(10, 20))
    learn = (np.array(chain[:-1]), np.array(chain[1:])[:, None], np.full((len(chain) - 1, 1), 0.5))
    trees = {}
    for floor in (0.0, 0.1):
        p = proposer(budget=8, sources=("successor",), prune=False, adaptive_budget=False, min_node_confidence=floor)
        p.learn_successors(*learn)
        trees[floor] = p.propose_trees(make_ctx([[5, 1]]))[0]
    assert trees[0.0].token_ids.tolist() == chain[1:9]
    assert trees[0.1].token_ids.tolist() == chain[1:4]  # 0.5, 0.25, 0.125; 0.0625 < 0.1


def edges(tree: DraftTree) -> list[tuple[int, int]]:
    """(parent's path as a tuple, token) of every node: identical paths share an entry."""
    paths: list[tuple[int, ...]] = []
    out = []
    for t, p in zip(tree.token_ids.tolist(), tree.parents.tolist()):
        prefix = paths[p] if p >= 0 else ()
        out.append((prefix, t))
        paths.append(prefix + (t,))
    return out


def repetitive(rng, n=60) -> list[int]:
    motif = rng.integers(1, VOCAB, 7).tolist()
    return [int(x) for x in (motif * (n // 7 + 1))[:n]]


def test_builtin_name_resolves():
    assert load_proposer_class("graft") is GraftProposer
    assert GraftProposer.options_type is GraftOptions and not GraftProposer.wants_target_logits


def test_graft_asks_for_the_targets_top_k_of_its_successor_table():
    assert proposer(budget=4, successor_k=5).wants_target_topk == 5
    assert proposer(budget=4, sources=("suffix",)).wants_target_topk == 0  # no successor table: nothing to learn


@pytest.mark.parametrize("position", ["root", "deepest", "both"])
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_trees_are_valid_deduplicated_and_within_budget(position, budget):
    rng = np.random.default_rng(budget)
    p = proposer(budget=budget, graft_position=position, adaptive_budget=False)
    # teach the successor table a little so that every source has something to say
    p.learn_successors(np.arange(VOCAB), rng.integers(0, VOCAB, (VOCAB, 4)), np.full((VOCAB, 4), 0.3))
    contexts = [repetitive(rng), rng.integers(0, VOCAB, 40).tolist(), [5, 6, 5, 6, 5], [9]]
    for step in range(3):
        ctx = make_ctx([c + [step] for c in contexts], max_nodes=16)
        for tree in p.propose_trees(ctx):
            assert tree is not None and 0 < tree.num_nodes <= budget
            pairs = edges(tree)
            assert len(set(pairs)) == len(pairs)  # no two nodes share a path
            assert np.all((tree.node_probs > 0) & (tree.node_probs <= 1 + 1e-6))
            assert tree.token_ids.max() < VOCAB
    assert p.stats.trees == 12


def test_with_nothing_retrieved_a_tree_is_what_assembling_empty_trees_makes():
    """The shortcut for a step where no source retrieved anything hands over what growing and grafting empty trees
    would, and counts the tree alike."""
    p = proposer(budget=16, adaptive_budget=False)
    ctx = make_ctx([[7]])  # one token never seen before: no successor row, no match
    found = p.sources.at_root("r0", np.array([7]), 16, 1)
    assert not any(t.num_nodes for t in found.values())
    [tree] = p.propose_trees(ctx)
    source, draft = p._retrieval_draft(found, 16)
    assembled = p._assemble("r0", np.array([7]), draft, source, found, 16, 0.0)
    expected = DraftTree(assembled.tree.token_ids, assembled.tree.parents, assembled.raw_probs.astype(np.float32),
                         assembled.sources)
    for got, want in ((tree.token_ids, expected.token_ids), (tree.parents, expected.parents),
                      (tree.node_probs, expected.node_probs), (tree.node_sources, expected.node_sources)):
        assert got.dtype == want.dtype and got.shape == want.shape == (0,)
    assert p.stats.trees == 1 and p.stats.pruned == int(draft.pruned_at is not None) and not p.stats.draft_source


@pytest.mark.parametrize("learnt", [False, True])
def test_the_root_children_shortcut_ranks_sources_as_path_confidence_does(learnt):
    """At a first checkpoint of depth 1, calibrating every source's root children in one call gives each source the
    confidence the path-confidence rule gives it (so the same draft source), learnt calibration or raw numbers."""
    rng = np.random.default_rng(5)
    p = proposer(checkpoints=(1, 2, 6), thresholds=(0.0, 0.4, 0.9), calibrate_acceptance=learnt)
    if learnt:
        n = len(p.acceptance_sources)
        p.calibration.observe(rng.integers(0, n, 500), rng.random(500), rng.random(500) < 0.4,
                              rng.integers(1, 6, 500))
    for _ in range(20):
        found = {}
        for name in p.sources.names:
            size = int(rng.integers(0, 6))
            parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, size)], np.int32)[:size]
            found[name] = RetrievedTree(rng.integers(0, VOCAB, size), parents,
                                        rng.random(size).astype(np.float32), int(rng.integers(1, 9)))
        assert p._root_confidences(found) == pytest.approx(p._checkpoint_confidences(found), abs=0, rel=0)


def test_partial_prefill_rows_get_no_tree_and_verify_budget_caps():
    p = proposer(budget=32, adaptive_budget=False)
    ctx = make_ctx([[1, 2, 3, 1, 2], [4, 5]], sampled=[[2], []], max_nodes=3)
    trees = p.propose_trees(ctx)
    assert trees[1] is None
    assert trees[0].num_nodes <= 3 and trees[0].token_ids.tolist()[0] == 3


def test_assemble_merges_identical_paths_and_keeps_the_draft():
    draft = DraftGrowth(budget=6, checkpoints={}, max_depth=8)
    draft.add_level(DraftLevel(np.array([10, 11]), np.array([-1, -1]), np.log([0.6, 0.3])))
    draft.add_level(DraftLevel(np.array([12]), np.array([0]), np.log([0.5])))
    # a graft repeating the draft's path 10 -> 12 and adding 10 -> 12 -> 13 and 14
    graft = RetrievedTree(np.array([10, 14, 12, 13]), np.array([-1, -1, 0, 2]),
                          np.array([0.9, 0.05, 0.9, 0.9], np.float32))
    tree = assemble(draft, [(-1, graft)], budget=5)
    assert tree.num_nodes == 5
    paths = {tuple(tree.token_ids[tree.path_to(i)].tolist()) for i in range(tree.num_nodes)}
    assert paths == {(10,), (11,), (10, 12), (10, 12, 13), (14,)}
    # the merged node keeps the better confidence (0.9 from the graft rather than 0.6 from the draft)
    first = int(np.nonzero(tree.token_ids == 10)[0][0])
    assert first == 0 and tree.node_probs[0] == pytest.approx(0.9)
    # a tight budget drops grafted nodes, never the draft
    small = assemble(draft, [(-1, graft)], budget=3)
    assert sorted(small.token_ids.tolist()) == [10, 11, 12]
    # a confidence floor drops unlikely nodes of every source (11: 0.3, 14: 0.05) and keeps the tree closed
    sure = assemble(draft, [(-1, graft)], budget=5, min_score=0.5)
    paths = {tuple(sure.token_ids[sure.path_to(i)].tolist()) for i in range(sure.num_nodes)}
    assert paths == {(10,), (10, 12), (10, 12, 13)}
    assert assemble(draft, [(-1, graft)], budget=5, min_score=0.95).num_nodes == 0


def test_assemble_counts_the_nodes_grafts_added_whatever_it_dropped_of_the_draft():
    """The grafted count is the final tree's nodes off the draft (13 and 14 here), not its size less the draft's,
    which undercounted, and went negative, once the floor or the budget dropped draft nodes (11 at 0.3 here)."""
    draft = DraftGrowth(budget=6, checkpoints={}, max_depth=8)
    draft.add_level(DraftLevel(np.array([10, 11]), np.array([-1, -1]), np.log([0.6, 0.3])))
    draft.add_level(DraftLevel(np.array([12]), np.array([0]), np.log([0.5])))
    graft = RetrievedTree(np.array([10, 14, 12, 13]), np.array([-1, -1, 0, 2]),
                          np.array([0.9, 0.05, 0.9, 0.9], np.float32))
    assert assemble_tree(draft, [(-1, graft)], budget=5).grafted == 2  # 13 and 14
    floored = assemble_tree(draft, [(-1, graft)], budget=5, min_score=0.5)
    assert floored.tree.num_nodes == 3 and floored.grafted == 1  # 13 kept, 11 and 14 below the floor
    assert assemble_tree(draft, [], budget=5, min_score=0.5).grafted == 0


def test_acceptance_calibration_starts_at_the_raw_confidence_and_learns_the_observed_rate():
    cal = AcceptanceCalibration(["suffix", "successor"])
    raw = np.array([0.05, 0.55, 0.95])
    assert np.allclose(cal(0, raw), raw)  # no data: the source's own number
    # suffix nodes at raw ~0.95 were accepted 1 time in 40; successor nodes at raw ~0.55 every time
    cal.observe(np.zeros(40, np.int64), np.full(40, 0.97), np.arange(40) == 0)
    cal.observe(np.ones(40, np.int64), np.full(40, 0.52), np.ones(40, bool))
    suffix_rate, successor_rate = (1 + 8 * 0.95) / 48, (40 + 8 * 0.55) / 48  # each bin's prior
    assert cal(0, np.array([0.95]))[0] == pytest.approx((1 + 8 * suffix_rate) / 48)
    assert cal(1, np.array([0.55]))[0] == pytest.approx((40 + 8 * successor_rate) / 48)
    # a bin without data: the source's rate so far (its prior pulled to this node's raw number)
    assert cal(1, np.array([0.95]))[0] == pytest.approx((40 + 8 * 0.95) / 48)
    assert cal.table()["successor"][5] == (1.0, 40)


def test_assemble_ranks_and_floors_nodes_by_calibrated_acceptance():
    """A source whose raw confidences run high but whose nodes are rarely accepted loses the budget to one that is
    right more often than it claims; the floor cuts by the calibrated score."""
    cal = AcceptanceCalibration(["suffix", "successor"])
    cal.observe(np.zeros(200, np.int64), np.full(200, 0.95), np.arange(200) < 10)  # suffix: 5% at raw 0.9-1
    cal.observe(np.ones(200, np.int64), np.full(200, 0.45), np.arange(200) < 180)  # successor: 90% at raw 0.4-0.5
    draft = DraftGrowth(budget=2, checkpoints={}, max_depth=8)
    suffix = RetrievedTree(np.array([10, 11]), np.array([-1, 0]), np.array([0.95, 0.95], np.float32))
    successor = RetrievedTree(np.array([20, 21]), np.array([-1, 0]), np.array([0.45, 0.45], np.float32))
    grafts = [(-1, suffix, 0), (-1, successor, 1)]
    assert assemble(draft, grafts, budget=2).token_ids.tolist() == [10, 11]  # raw: suffix first
    built = assemble_tree(draft, grafts, budget=2, calibration=cal)
    assert built.tree.token_ids.tolist() == [20, 21] and built.sources.tolist() == [1, 1]
    assert np.allclose(built.raw_probs, 0.45)
    assert built.tree.node_probs[0] == pytest.approx((180 + 8 * (180 + 8 * 0.45) / 208) / 208, rel=1e-6)
    floored = assemble(draft, grafts, budget=4, min_score=0.1, calibration=cal)
    assert floored.token_ids.tolist() == [20, 21]  # suffix nodes: ~0.08 calibrated, below the floor


def test_graft_learns_acceptance_from_verified_trees():
    """Only nodes the target reached (root children, children of accepted nodes) count; a replaced tree is ignored."""
    p = proposer(budget=6, sources=("successor",), prune=False, adaptive_budget=False)
    p.learn_successors(np.array([3, 20]), np.array([[20, 21], [22, 23]]), np.array([[0.65, 0.35], [0.75, 0.15]]))
    tree = p.propose_trees(make_ctx([[1, 2, 3]], req_ids=["a"]))[0]
    assert tree.token_ids.tolist()[:4] == [20, 22, 21, 23]  # path 0.65, 0.49, 0.35, 0.10
    p.on_verified([VerificationResult("a", tree, accepted_nodes=[0], bonus_token=5)])
    succ = p.calibration.source_id("successor")
    # reached: 20 (accepted, bin 6), 21 (rejected, bin 3), and 20's children 22 (bin 7) and 23 (bin 1): rejected
    assert p.calibration.trials[succ].sum() == 4 and p.calibration.accepts[succ].sum() == 1
    assert p.calibration.accepts[succ, 6] == 1 and p.calibration.trials[succ, 7] == 1
    p.propose_trees(make_ctx([[1, 2, 3]], req_ids=["a"]))
    other = DraftTree(np.array([9]), np.array([-1]))
    p.on_verified([VerificationResult("a", other, accepted_nodes=[0], bonus_token=5)])
    assert p.calibration.trials[succ].sum() == 4
    assert proposer(calibrate_acceptance=False).calibration is None


def test_grafting_at_the_deepest_draft_node():
    draft = DraftGrowth(budget=5, checkpoints={}, max_depth=8)
    draft.add_level(DraftLevel(np.array([1, 2]), np.array([-1, -1]), np.log([0.5, 0.4])))
    draft.add_level(DraftLevel(np.array([3]), np.array([1]), np.log([0.5])))
    assert draft.deepest() == 2 and draft.path_tokens(2) == [2, 3]
    tree = assemble(draft, [(2, RetrievedTree(np.array([7, 8]), np.array([-1, 0]), np.array([1.0, 1.0], np.float32)))],
                    budget=5)
    paths = {tuple(tree.token_ids[tree.path_to(i)].tolist()) for i in range(tree.num_nodes)}
    assert paths == {(1,), (2,), (2, 3), (2, 3, 7), (2, 3, 7, 8)}


def test_pruning_stops_the_draft_and_frees_budget_for_grafting():
    # suffix: a long repeated chain of single occurrences (confidence 1); successor table: a chain of 0.2s
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    chain = [1] + list(range(10, 20))  # successor table: 1 -> 10 -> 11 -> ... -> 19, each with probability 0.2
    learn = (np.array(chain[:-1]), np.array(chain[1:])[:, None], np.full((len(chain) - 1, 1), 0.2))
    p = proposer(budget=8, sources=("successor", "suffix"), checkpoints=(1,), thresholds=(0.5,),
                 adaptive_budget=False)
    p.learn_successors(np.array([1]), np.array([[40, 41]]), np.array([[0.2, 0.1]]))
    tree = p.propose_trees(make_ctx([context]))[0]
    # the suffix source is more confident (1.0 > 0.2), drafts 2 3 4 ... and fills the budget: nothing pruned
    assert p.stats.draft_source == {"suffix": 1} and p.stats.pruned == 0
    assert tree.token_ids.tolist()[:7] == [2, 3, 4, 5, 6, 7, 8] and tree.num_nodes == 8

    q = proposer(budget=8, sources=("successor",), checkpoints=(1,), thresholds=(0.5,), adaptive_budget=False)
    q.learn_successors(*learn)
    tree = q.propose_trees(make_ctx([context]))[0]
    assert q.stats.pruned == 1 and tree.num_nodes == 1  # pruned at depth 1, nothing else to graft

    r = proposer(budget=8, sources=("successor", "suffix"), checkpoints=(1,), thresholds=(0.5,),
                 adaptive_budget=False)
    r.learn_successors(*learn)
    tree = r.propose_trees(make_ctx([[9, 9, 1]]))[0]  # suffix has no match: successor drafts, is pruned
    assert r.stats.draft_source == {"successor": 1} and r.stats.pruned == 1 and tree.token_ids.tolist() == [10]
    # without pruning the successor chain runs to the budget
    s = proposer(budget=8, sources=("successor",), prune=False, adaptive_budget=False)
    s.learn_successors(*learn)
    assert s.propose_trees(make_ctx([context]))[0].token_ids.tolist() == list(range(10, 18))


class ScriptedDrafter(ModelDrafter):
    """Drafts a binary tree whose level confidences follow a script per row, each row stopping at the first checkpoint
    of ``stop_below`` (graft's, set by the proposer) its best path falls below; records the rows drafted per level."""

    def __init__(self, level_probs: dict[int, list[float]]) -> None:
        self.level_probs = level_probs
        self.calls: list[list[int]] = []

    def draft(self, ctx, rows):
        nodes = {i: ([], [], [], []) for i in rows}  # tokens, parents, probs, path log-probs
        active, d = list(rows), 0
        while active:
            self.calls.append(list(active))
            growing = []
            for i in active:
                probs, (tokens, parents, node_probs, scores) = self.level_probs[i], nodes[i]
                if d >= len(probs):
                    continue
                width = 1 if d == 0 else 2
                parent = len(tokens) - 1 if d else -1
                level = [probs[d], probs[d] / 2][:width]
                tokens += (np.arange(width) + 50 + 2 * d).tolist()
                parents += [parent] * width
                node_probs += level
                scores += [(scores[parent] if d else 0.0) + np.log(p) for p in level]
                if not below_checkpoint(self.stop_below, d + 1, max(scores[-width:])):
                    growing.append(i)
            active, d = growing, d + 1
        return {i: DraftTree(np.array(t), np.array(p), np.array(q)) for i, (t, p, q, _) in nodes.items() if t}


class IngestCountingDrafter(ScriptedDrafter):
    """A scripted head that counts its ingests: one per step it drafted on."""

    ingested = 0

    def ingest(self, ctx):
        self.ingested += 1


def test_model_drafter_is_pruned_at_checkpoints_and_grafted():
    drafter = ScriptedDrafter({0: [0.9, 0.9, 0.9, 0.9], 1: [0.9, 0.1, 0.9, 0.9]})
    p = GraftProposer(None, GraftOptions(budget=10, checkpoints=(1, 2), thresholds=(0.5, 0.5), adaptive_budget=False,
                                         sources=("suffix",), min_node_confidence=0.0), drafter=drafter,
                      vocab_size=VOCAB)
    ctx = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
    t0, t1 = p.propose_trees(ctx)
    assert drafter.calls[0] == [0, 1] and drafter.calls[2] == [0]  # row 1 stopped after its second level
    assert p.stats.pruned == 1
    # row 0: 1 + 2 + 2 + ... draft nodes; row 1: 3 draft nodes (c = 0.9 * 0.1 < 0.5 at depth 2) + grafted 3 1 2 ...
    assert set(t1.token_ids.tolist()) >= {50, 52, 53, 9}
    assert 50 in t0.token_ids.tolist() and 9 not in t0.token_ids.tolist()
    assert t0.num_nodes <= 10 and t1.num_nodes <= 10


def test_zero_budget_skips_the_model_drafter_entirely():
    """Under load the budget table gives 0 nodes: no drafting, and the head only observes the step (writes its K/V,
    computes nothing); so does a step the verifier's budget does not draft at all."""
    class CountingDrafter(ScriptedDrafter):
        ingested = observed = 0

        def ingest(self, ctx):
            self.ingested += 1

        def observe(self, ctx):
            self.observed += 1

    drafter = CountingDrafter({i: [0.9] for i in range(4)})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("suffix",)), drafter=drafter, vocab_size=VOCAB)
    p.budget_curve = BudgetCurve(8, table={1: 8, 4: 0})
    assert p.propose_trees(make_ctx([[1, 2, 3]] * 4)) == [None] * 4
    assert drafter.ingested == 0 and drafter.calls == [] and drafter.observed == 1
    assert p.propose_trees(make_ctx([[1, 2, 3]]))[0] is not None and drafter.ingested == 1 and drafter.observed == 1
    levels_drafted = len(drafter.calls)
    p.observe(make_ctx([[1, 2, 3]]))
    assert drafter.observed == 2 and drafter.ingested == 1 and len(drafter.calls) == levels_drafted


def test_model_drafter_sits_out_batches_above_its_limit():
    """On CPU the head drafts for one request at a time by default; a larger batch gets retrieval-only trees and the
    head skips its rows. GPUs, an explicit limit, or adaptive_budget off let it draft for any batch."""
    def graft(device="cpu", **options):
        config = SimpleNamespace(device_config=SimpleNamespace(device_type=device))
        drafter = IngestCountingDrafter({i: [0.9, 0.9] for i in range(2)})
        opts = GraftOptions(budget=8, sources=("suffix",), min_node_confidence=0.0, **options)
        p = GraftProposer(config, opts, drafter=drafter, vocab_size=VOCAB)
        p.budget_curve = BudgetCurve(8, table={1: 8})  # budget 8 at any batch: only the drafter limit differs
        return p, drafter

    pair = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
    p, drafter = graft()
    assert p.model_draft_max_batch == 1
    trees = p.propose_trees(pair)
    assert drafter.ingested == 0 and drafter.calls == [] and p.stats.retrieval_only_steps == 1
    assert [t.token_ids.tolist()[:2] for t in trees] == [[3, 1], [9, 7]]  # the suffix source drafted both
    tree = p.propose_trees(make_ctx([[1, 2, 3, 1, 2]]))[0]
    assert drafter.ingested == 1 and drafter.calls and 50 in tree.token_ids.tolist()
    for kwargs in ({"device": "cuda"}, {"model_draft_max_batch": 2}, {"adaptive_budget": False}):
        p, drafter = graft(**kwargs)
        p.propose_trees(pair)
        assert drafter.ingested == 1 and drafter.calls[0] == [0, 1] and p.stats.retrieval_only_steps == 0, kwargs
    with pytest.raises(ValueError, match="model_draft_max_batch"):
        GraftOptions(model_draft_max_batch=0)


def test_eagle_checkpoint_that_is_not_a_head_is_refused(tmp_path):
    ckpt = tmp_path / "eagle"
    ckpt.mkdir()
    with pytest.raises(ValueError, match="eagle_checkpoint.*config.json"):
        GraftOptions(eagle_checkpoint=str(ckpt))


def test_retrieval_only_is_logged_once():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("vllm.treespec")
    log.addHandler(handler)
    try:
        p = proposer(budget=4)
        for _ in range(3):
            p.propose_trees(make_ctx([[1, 2, 1]]))
    finally:
        log.removeHandler(handler)
    assert sum("retrieval-only" in r.getMessage() for r in records) == 1


def peaked_logits(best: list[int], prob_hint: float = 4.0):
    import torch

    logits = torch.zeros(len(best), VOCAB)
    logits[torch.arange(len(best)), torch.tensor(best)] = prob_hint
    return logits


def test_successor_table_refreshes_from_every_verified_row():
    import torch

    p = proposer(budget=6, sources=("successor",), prune=False, adaptive_budget=False)
    p.learn_successors(np.array([3]), np.array([[20, 21]]), np.array([[0.6, 0.3]]))
    tree = p.propose_trees(make_ctx([[1, 2, 3]], req_ids=["a"]))[0]
    assert tree.token_ids.tolist()[:2] == [20, 21]
    # the target's rows: root (after 3) -> 30, after node 0 (20) -> 31, after node 1 (21, rejected) -> 32, ...
    best = [30] + [31 + j for j in range(tree.num_nodes)]
    logits = peaked_logits(best)
    p.on_verified([VerificationResult("a", tree, accepted_nodes=[0], bonus_token=31, target_logits=logits)])
    expected_p = float(torch.softmax(logits[0], -1)[30])
    table = p.sources.successors
    assert table.ids[3, 0] == 30 and table.probs[3, 0] == pytest.approx(expected_p, rel=1e-5)
    assert table.ids[20, 0] == 31 and table.ids[21, 0] == 32  # the rejected node's row is learned too
    # the next tree from root 3 follows the target's distribution
    nxt = p.propose_trees(make_ctx([[1, 2, 3, 20, 3]], req_ids=["a"]))[0]
    assert nxt.token_ids[0] == 30
    # results without logits and for unknown requests are ignored
    p.on_verified([VerificationResult("zzz", tree, [], 1, logits), VerificationResult("a", tree, [], 1, None)])


def test_successor_table_learns_the_verifiers_top_k():
    """In an engine the verifier hands each verified row's top k (``target_topk``), not whole logits rows."""
    p = proposer(budget=6, sources=("successor",), prune=False, adaptive_budget=False, successor_k=2)
    p.learn_successors(np.array([3]), np.array([[20, 21]]), np.array([[0.6, 0.3]]))
    tree = p.propose_trees(make_ctx([[1, 2, 3]], req_ids=["a"]))[0]
    rows = tree.num_nodes + 1
    ids = np.stack([np.array([40 + j, 60 + j]) for j in range(rows)])
    probs = np.tile(np.array([0.7, 0.2], np.float32), (rows, 1))
    p.on_verified([VerificationResult("a", tree, accepted_nodes=[0], bonus_token=40, target_topk=(ids, probs))])
    table = p.sources.successors
    assert table.ids[3, :2].tolist() == [40, 60] and table.probs[3, 0] == pytest.approx(0.7)
    assert table.ids[20, :2].tolist() == [41, 61] and table.ids[21, 0] == 42


def test_successor_rows_are_seeded_from_committed_tokens_without_overriding_the_target():
    p = proposer(budget=4, sources=("successor",), prune=False, adaptive_budget=False)
    p.learn_successors(np.array([7]), np.array([[9]]), np.array([[0.8]]))
    p.propose_trees(make_ctx([[5, 6, 5, 6, 5, 8, 7, 1]], req_ids=["s"]))
    table = p.sources.successors
    assert table.ids[5, :2].tolist() == [6, 8] and table.probs[5, 0] == pytest.approx(0.5 * 2 / 3)
    assert table.ids[7, 0] == 9 and table.probs[7, 0] == pytest.approx(0.8)  # the target's row stays
    # later steps feed only the new tokens: 1 -> 2 is learned when committed
    p.propose_trees(make_ctx([[5, 6, 5, 6, 5, 8, 7, 1, 2]], req_ids=["s"]))
    assert table.ids[1, 0] == 2


def test_adaptive_budget_shrinks_monotonically_with_batch_size():
    default = BudgetCurve(32, knee_tokens=64)
    values = [default(n) for n in range(1, 130)]
    assert values[0] == 32 and all(a >= b for a, b in zip(values, values[1:])) and values[-1] == 0
    table = BudgetCurve(32, table={1: 24, 4: 30, 8: 8, 32: 2})  # a noisy, non-monotone measured table
    got = [table(n) for n in range(1, 64)]
    assert got[0] == 24 and got[3] == 24 and got[7] == 8 and got[40] == 2
    assert all(a >= b for a, b in zip(got, got[1:]))
    assert BudgetCurve(32, knee_tokens=64, min_budget=3)(1000) == 3
    assert BudgetCurve(32, adaptive=False)(1000) == 32
    # through the proposer: larger batches get smaller trees
    p = proposer(budget=16, knee_tokens=32)
    rng = np.random.default_rng(0)
    sizes = []
    for n in (1, 2, 4, 8, 16):
        trees = p.propose_trees(make_ctx([repetitive(rng) for _ in range(n)], max_nodes=16))
        sizes.append(max(t.num_nodes for t in trees))
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 16 and sizes[-1] == 1


def test_cpu_default_budget_is_the_measured_table():
    """Uncalibrated on CPU: the full budget alone, 3 nodes for two requests, no speculation from four (a hinge at
    16 tokens lost 15% to no speculation at concurrency 4 on this machine); an explicit knee brings the hinge back."""
    curve = proposer(budget=16).budget_curve
    assert [curve(n) for n in (1, 2, 3, 4, 8, 64)] == [16, 3, 3, 0, 0, 0]
    assert proposer(budget=16, knee_tokens=32).budget_curve(4) == 7


@pytest.mark.parametrize("raw, field", [
    ({"budget": 0}, "budget"),
    ({"thresholds": [0.5, 1.5], "checkpoints": [1, 2]}, "thresholds"),
    ({"checkpoints": [2, 1], "thresholds": [0.1, 0.1]}, "checkpoints"),
    ({"checkpoints": [1, 2], "thresholds": [0.1]}, "thresholds"),
    ({"checkpoints": [1, 2]}, "thresholds"),
    ({"sources": ["suffix", "bm25"]}, "sources"),
    ({"sources": []}, "sources"),
    ({"graft_position": "leaf"}, "graft_position"),
    ({"datastore": "/nonexistent.ds"}, "datastore"),
    ({"eagle_checkpoint": "/nonexistent/eagle"}, "eagle_checkpoint"),
    ({"calibration_path": "/nonexistent.json"}, "calibration_path"),
    ({"min_budget": -1}, "min_budget"),
    ({"ngram_min_n": 3, "ngram_max_n": 2}, "ngram_max_n"),
    ({"knee_tokens": "many"}, "knee_tokens"),
    ({"prune_at": [1]}, "prune_at"),
])
def test_options_errors_name_the_field(raw, field):
    with pytest.raises(TreeSpecConfigError, match=field):
        parse_options("graft", GraftOptions, raw)


def test_bad_calibration_file_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "checkpoints": [1], "thresholds": [2.0]}))
    with pytest.raises(TreeSpecConfigError, match="calibration_path"):
        parse_options("graft", GraftOptions, {"calibration_path": str(bad)})
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(bad)


def test_accepted_path_is_the_longest_matching_root_path():
    tree = DraftTree(np.array([1, 2, 3, 4, 5]), np.array([-1, -1, 0, 1, 3]))
    assert accepted_path(tree, np.array([2, 4, 5, 9])) == [1, 3, 4]
    assert accepted_path(tree, np.array([1, 3])) == [0, 2]
    assert accepted_path(tree, np.array([7])) == []


def synthetic_episodes(rng, n=6) -> list[Episode]:
    """Outputs that repeat a motif (retrievable) with a slowly drifting successor distribution."""
    episodes = []
    for _ in range(n):
        prompt = rng.integers(1, VOCAB, 12)
        output = np.array(repetitive(rng, 50))
        ids = np.stack([np.r_[output[1:], output[:1]], rng.integers(0, VOCAB, 50)], 1).astype(np.int32)
        probs = np.tile(np.array([0.7, 0.2], np.float32), (50, 1))
        episodes.append(Episode(prompt, output, ids, probs))
    return episodes


def test_replay_measures_coverage_and_learns():
    eps = synthetic_episodes(np.random.default_rng(1))
    p = proposer(budget=8, adaptive_budget=False)
    r = replay(p, eps, 8)
    assert r.steps > 0 and r.mean_nodes <= 8
    # the acceptance calibration learned from every replayed tree, as online: each step reached its root children
    assert p.calibration.trials.sum() >= r.steps and p.calibration.accepts.sum() == r.accepted
    # every output token is committed once (+1 per episode whose last tree covered the rest: no bonus token there)
    assert 0 <= r.steps + r.accepted - sum(len(e.output) - 1 for e in eps) <= len(eps)
    assert r.coverage > 2  # motifs repeat: long accepted paths
    none = replay(proposer(budget=8, sources=("ngram",), ngram_min_n=4, ngram_max_n=4, adaptive_budget=False),
                  [Episode(np.array([1]), np.arange(2, 30), np.zeros((28, 1), np.int32),
                           np.zeros((28, 1), np.float32))], 8)
    assert none.accepted == 0 and none.steps == 27


def test_calibration_round_trip(tmp_path):
    eps = synthetic_episodes(np.random.default_rng(2))
    step_ms = {1: 40.0, 4: 42.0, 16: 50.0, 32: 90.0, 64: 200.0}
    cal = calibrate_from(eps, budget=16, vocab_size=VOCAB, step_ms=step_ms, batch_sizes=(1, 2, 4, 8, 16, 32))
    sizes = sorted(cal.budget_by_batch)
    budgets = [cal.budget_by_batch[s] for s in sizes]
    assert budgets == sorted(budgets, reverse=True) and 0 < budgets[0] <= 16
    assert cal.knee_tokens == 16
    assert set(cal.report["variants"]) == {"position_root", "position_deepest", "position_both", "no_pruning",
                                           "no_grafting"}
    path = tmp_path / "cal.json"
    path.write_bytes(msgspec.json.encode(cal))
    p = GraftProposer(None, GraftOptions(calibration_path=str(path), budget=16), vocab_size=VOCAB)
    assert p.checkpoints == dict(zip(cal.checkpoints, cal.thresholds))
    assert [p.budget_curve(s) for s in sizes] == [min(b, 16) for b in budgets]


def test_cost_model_and_budget_table():
    cost = CostModel({1: 10.0, 8: 11.0, 16: 9.0, 32: 40.0})  # noise: 16 tokens measured cheaper than 8
    assert cost(16) == pytest.approx(11.0) and cost(64) > cost(32) > cost(16)
    assert cost.knee_tokens() == 16
    from vllm_treespec.tools.graft_calibrate import ReplayResult

    by_budget = {4: ReplayResult(steps=10, accepted=10, nodes=40), 16: ReplayResult(steps=10, accepted=12, nodes=160)}
    table = budget_table(by_budget, cost, (1, 2, 4, 16))
    assert table[1] == 4 and table[16] == 0  # more nodes do not pay; at batch 16 any speculation costs more


def test_draft_tree_levels_renumber_parents_first():
    from vllm_treespec.proposers.graft.growth import draft_tree_levels

    tree = DraftTree(np.array([5, 6, 7, 8, 9]), np.array([-1, -1, 0, 1, 2]),
                     np.array([0.5, 0.25, 1.0, 0.5, 0.125], np.float32))
    levels = draft_tree_levels(tree)
    assert [lv.token_ids.tolist() for lv in levels] == [[5, 6], [7, 8], [9]]
    assert [lv.parents.tolist() for lv in levels] == [[-1, -1], [0, 1], [2]]
    assert np.allclose(np.exp(np.concatenate([lv.log_probs for lv in levels])), [0.5, 0.25, 1.0, 0.5, 0.125])


def test_the_compiled_growth_grows_every_tree_as_the_level_by_level_one():
    """DraftGrowth.grown (one Numba pass, what graft runs) keeps the same nodes, numbering, scores, depth and pruning
    as grow_draft over the tree's levels, on random trees: partial levels, ties between equal scores (few distinct
    probabilities), checkpoints that prune and max_depth."""
    from vllm_treespec.proposers.graft.growth import draft_tree_levels, grow_draft_tree

    rng = np.random.default_rng(11)
    fields = ("tokens", "parents", "log_scores", "depths", "depth", "pruned_at")
    pruned = partial = 0
    for case in range(400):
        n = int(rng.integers(0, 40))
        parents = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(n)], np.int64)
        probs = rng.choice([0.05, 0.25, 0.5, 0.9, 1.0], size=n).astype(np.float32)
        tree = DraftTree(rng.integers(0, VOCAB, size=n), parents, probs)
        budget, max_depth = int(rng.integers(0, 24)), int(rng.integers(1, 8))
        checkpoints = {int(d): float(t) for d, t in zip(rng.choice(6, size=2, replace=False) + 1,
                                                        rng.choice([0.0, 0.1, 0.3, 0.6], size=2))}
        expected = grow_draft(draft_tree_levels(tree), budget, checkpoints, max_depth)
        got = grow_draft_tree(tree, budget, checkpoints, max_depth)
        for name in fields:
            assert getattr(got, name) == getattr(expected, name), (case, name)
        pruned += expected.pruned_at is not None
        partial += 0 < len(expected) == budget
    assert pruned > 20 and partial > 20  # the cases cover pruning and budget-cut levels


def test_checkpoints_reach_the_eagle_head_so_pruned_levels_are_never_drafted(tmp_path):
    """With a head, graft's checkpoints stop the head's expansion (not only the tree after drafting); the ablation
    option and prune=False hand it no checkpoints."""
    from test_eagle import small_head

    _, head = small_head(tmp_path)
    opts = dict(eagle_checkpoint=head, checkpoints=(1, 3), thresholds=(0.0, 0.5), budget=16)
    assert GraftProposer(None, GraftOptions(**opts), vocab_size=VOCAB).drafter.stop_below == {1: 0.0, 3: 0.5}
    full = GraftProposer(None, GraftOptions(**opts, stop_drafting_at_checkpoints=False), vocab_size=VOCAB)
    assert full.drafter.stop_below is None
    assert GraftProposer(None, GraftOptions(**opts, prune=False), vocab_size=VOCAB).drafter.stop_below == {}


class Linear:
    """A step-cost stand-in: ``base + per_token * tokens`` seconds."""

    def __init__(self, base, per_token):
        self.base, self.per_token = base, per_token

    def predict_many(self, num_tokens, num_reqs=1, plain_tokens=None):
        return self.base + self.per_token * np.asarray(num_tokens, np.float64)


class LinearWithContext(Linear):
    """``Linear`` plus ``per_position`` seconds per row and position of context beyond the curve's."""

    def __init__(self, base, per_token, per_position):
        super().__init__(base, per_token)
        self.per_position = per_position

    def predict_many(self, num_tokens, num_reqs=1, excess=0.0, plain_tokens=None, request_excess=None):
        return super().predict_many(num_tokens, num_reqs) + self.per_position * np.asarray(excess, np.float64)


def test_grafts_head_gate_prices_the_rows_of_long_requests_higher():
    """A head whose trees pay at a short context sits out at a long one, where each verified row attends to
    thousands of positions more (``ctx.row_excess``, set by the verifier): a node expected to add half a token no
    longer pays for a row that costs as much as the plain step's. (A near-certain node still pays at any length.)"""
    drafter = ScriptedDrafter({0: [0.5] * 4})
    calls = []
    drafter.ingest = lambda ctx: calls.append(len(ctx.req_ids))
    p = GraftProposer(None, GraftOptions(budget=8, sources=("successor",), prune=False), drafter=drafter,
                      vocab_size=VOCAB)
    cost = LinearWithContext(0.05, 0.004, 2e-6)  # 2 ms per row and 1,000 positions: a CPU's order

    def step(excess):
        p.head_cost.buckets = {0: 0.005}  # 5 ms a call, whatever the scripted drafter takes: not free at any length
        ctx = make_ctx([[1, 2, 3]])
        ctx.step_cost, ctx.row_excess = cost, np.array([excess], np.float64)
        p.propose_trees(ctx)

    step(0.0)  # no history: the head drafts, and its trees are priced
    drafted = len(calls)
    for _ in range(3):
        step(0.0)
    assert len(calls) == drafted + 3  # at the curve's context its trees pay
    step(30000.0)  # each row now costs 60 ms more, the plain row too
    assert len(calls) == drafted + 3 and p.head_gate.last_rates[0] < p.head_gate.last_rates[1]


def test_under_a_step_budget_graft_drafts_its_full_budget_without_a_floor():
    """The tables (CPU budget by batch, the device confidence floor) are the fallback without a cost model; under the
    engine's step budget the verifier keeps what pays. Explicit options still win."""
    p = GraftProposer(None, GraftOptions(budget=8), vocab_size=VOCAB)
    ctx = make_ctx([[1, 2, 3]] * 4)
    assert p.budget(ctx) == 0 and p.floor(ctx) == 0.05  # no cost model: the CPU table gives 4 requests nothing
    ctx.step_cost = Linear(0.05, 0.002)
    assert p.budget(ctx) == 8 and p.floor(ctx) == 0.0
    explicit = GraftProposer(None, GraftOptions(budget=8, knee_tokens=16, min_node_confidence=0.2), vocab_size=VOCAB)
    assert explicit.budget(ctx) == 3 and explicit.floor(ctx) == 0.2
    # graft hands the verifier raw numbers with their sources, to calibrate and weigh
    p.learn_successors(np.array([3]), np.array([[20, 21]]), np.array([[0.6, 0.3]]))
    tree = p.propose_trees(make_ctx([[1, 2, 3]]))[0]
    assert tree.node_sources is not None and set(tree.node_sources.tolist()) <= set(range(len(p.acceptance_sources)))
    assert p.acceptance_sources[tree.node_sources[0]] == "successor" and tree.node_probs[0] == pytest.approx(0.6)


def test_a_heads_catch_up_on_rows_of_steps_without_drafts_is_priced_by_neither_gate():
    """The head writes the rows that steps without drafts left when it next drafts for their requests: that time is
    the earlier steps' work, so graft's head gate times the call without it and the verifier is told to leave it out
    too (``ctx.deferred_seconds``)."""

    class CatchingUpDrafter(ScriptedDrafter):
        catch_up = 0.0

        def ingest(self, ctx):
            time.sleep(self.catch_up)

        @property
        def catch_up_seconds(self):
            return self.catch_up

    drafter = CatchingUpDrafter({i: [0.9, 0.9] for i in range(2)})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("suffix",)), drafter=drafter, vocab_size=VOCAB)
    p.head_cost.warmup, p.head_cost.min_calls = 0, 1
    ctx = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
    ctx.step_cost = Linear(0.05, 0.001)
    ctx.probing = True  # the head drafts
    drafter.catch_up = 0.05
    p.propose_trees(ctx)
    assert ctx.deferred_seconds == 0.05
    assert 0 < ctx.self_gated_seconds < 0.04 and p.head_cost.predict(2) == pytest.approx(ctx.self_gated_seconds)


def test_the_heads_catch_up_is_priced_before_it_drafts_and_a_probe_drafts_with_it_only_if_its_allowance_covers_it():
    """The head's writes of the rows steps without drafts left it (``backlog_seconds``) are priced with its call by
    its gate, and on the verifier's probe it drafts only if the probe's allowance (``ctx.probe_seconds``) covers them
    and its measured call: the probe then measures the retrieval-only trees instead of costing many times what was
    set aside for it."""

    class BackloggedDrafter(ScriptedDrafter):
        backlog = 0.0
        ingested = 0

        def ingest(self, ctx):
            self.ingested += 1

        def backlog_seconds(self, req_ids):
            return self.backlog * len(req_ids)

    drafter = BackloggedDrafter({i: [0.9, 0.9] for i in range(2)})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("suffix",)), drafter=drafter, vocab_size=VOCAB)

    def step(probe_seconds=None, probing=False):
        ctx = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
        ctx.step_cost = Linear(0.05, 0.001)  # cheap tokens
        ctx.probing, ctx.probe_seconds = probing, probe_seconds
        p.propose_trees(ctx)
        return drafter.ingested

    step()
    step()  # the head's first calls: it drafts, and is timed
    p.head_cost.buckets = {1: 0.001}
    assert step() == 3  # a millisecond for ~0.9 tokens a request: it pays
    drafter.backlog = 0.5  # half a second a request of rows to write first: it does not
    assert step() == 3 and p.stats.retrieval_only_steps == 1
    assert step(probe_seconds=0.2, probing=True) == 3 and p.stats.retrieval_only_steps == 2
    assert step(probe_seconds=1.5, probing=True) == 4  # the allowance pays for both requests' rows
    p.head_cost.buckets = {1: 0.6}  # a call as dear as the rows: 1.6 s in all
    assert step(probe_seconds=1.5, probing=True) == 4 and p.stats.retrieval_only_steps == 3
    assert step(probe_seconds=1.7, probing=True) == 5
    assert step(probe_seconds=None, probing=True) == 6  # an uncapped probe (nothing known yet) drafts in full


def test_the_head_drafts_only_while_its_gain_beats_its_measured_cost():
    drafter = IngestCountingDrafter({i: [0.9, 0.9] for i in range(2)})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("suffix",)), drafter=drafter, vocab_size=VOCAB)
    p.head_cost.min_calls = 1  # priced from its first counted call (MIN_TIMED_CALLS: the test of CallCost)
    pair = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
    pair.step_cost = Linear(0.05, 0.001)  # cheap tokens
    p.propose_trees(pair)  # no history: it drafts (the CPU table would not, at batch 2) and learns its worth
    assert drafter.ingested == 1 and p.head_cost.predict(2) is None  # a first call (compiles) is not timed
    # ...and what the trees graft drafts without the head are worth, from trees assembled but not proposed
    assert p.stats.retrieval_only_steps == 0 and p.retrieval_gate.marginal is not None
    p.propose_trees(pair)  # not timed yet, so free: it drafts, and is timed
    assert drafter.ingested == 2 and p.head_cost.predict(2) is not None
    p.head_cost.observe(2, 0.001)
    p.propose_trees(pair)
    assert drafter.ingested == 3  # a few ms of head for ~0.9 tokens a request: it pays
    assert pair.self_gated_seconds > 0  # the head's time, which graft's gate prices and the verifier's does not
    p.head_cost.buckets = {1: 10.0}  # a head that takes 10 s a step never pays
    retrieval_only = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
    retrieval_only.step_cost = pair.step_cost
    p.propose_trees(retrieval_only)
    assert drafter.ingested == 3 and p.stats.retrieval_only_steps == 1 and retrieval_only.self_gated_seconds == 0
    pair.probing = True  # ...but the verifier's probe measures the trees graft drafts when drafting pays
    p.propose_trees(pair)
    assert drafter.ingested == 4 and p.stats.retrieval_only_steps == 1


def test_the_heads_gate_prices_the_rest_of_the_drafting_step_too():
    """The verifier's gate charges graft's call without the head (``self_gated_seconds``); the head's gate weighs
    its head with the rest of the drafting step (``ctx.shared_draft_seconds``) against plain decoding: a head whose
    trees pay for its own call but not for the whole step's price sits out."""

    drafter = IngestCountingDrafter({i: [0.9, 0.9] for i in range(2)})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("suffix",)), drafter=drafter, vocab_size=VOCAB)
    p.head_cost.min_calls = 1

    def step(shared):
        ctx = make_ctx([[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]])
        ctx.step_cost, ctx.shared_draft_seconds = Linear(0.05, 0.01), shared
        before = drafter.ingested
        p.propose_trees(ctx)
        return drafter.ingested > before

    assert step(0.0) and step(0.0)  # no history, then not timed: it drafts, and is timed
    p.head_cost.buckets = {1: 0.005}  # 5 ms a call for ~0.9 tokens a request at 10 ms a token: it pays...
    assert step(0.0)
    assert not step(0.200)  # ...but not with 200 ms more of graft's call and tree work
    best, plain = p.head_gate.last_rates
    assert best < plain  # lost to plain decoding, with the rest priced


def test_the_head_sits_out_while_retrieval_only_trees_beat_its_trees_with_its_cost():
    """The head's gate weighs its trees, with its measured cost, against the retrieval-only trees graft drafts
    without it, not only against plain decoding: a head that adds little to a confident retrieval match sits out."""

    def graft_with(head_probs, successor_prob):
        drafter = IngestCountingDrafter({0: head_probs})
        p = GraftProposer(None, GraftOptions(budget=8, sources=("successor",), prune=False), drafter=drafter,
                          vocab_size=VOCAB)
        p.learn_successors(np.arange(1, 20), (np.arange(1, 20) + 1)[:, None], np.full((19, 1), successor_prob))
        p.head_cost.min_calls = 1
        return p, drafter

    def step(p, cost, factor=1.0):
        ctx = make_ctx([[1, 2, 3]])
        ctx.step_cost, ctx.expectation_factor = cost, factor
        p.propose_trees(ctx)

    cheap_tokens = Linear(0.05, 0.004)
    # a weak head against a 0.95-a-token successor chain; a confident head against a 0.3-a-token one
    for head_probs, successor_prob, head_drafts in (([0.3, 0.3], 0.95, False), ([0.99] * 4, 0.3, True)):
        p, drafter = graft_with(head_probs, successor_prob)
        step(p, cheap_tokens)  # no history: the head drafts, and its trees are priced
        p.head_cost.observe(1, 0.01)
        p.head_cost.observe(1, 0.01)  # 10 ms a call
        expensive = p.head_cost.buckets
        p.head_cost.buckets = {0: 10.0}  # a moment where the head cannot pay: graft drafts retrieval-only
        step(p, cheap_tokens)
        assert p.stats.retrieval_only_steps == 1 and p.retrieval_gate.marginal is not None
        p.head_cost.buckets = expensive
        before = drafter.ingested
        for _ in range(3):
            step(p, cheap_tokens)
        assert p.head_gate.should_draft(1, 8)  # the head alone would pay against plain decoding either way...
        assert (drafter.ingested > before) == head_drafts, head_probs  # ...but must beat the retrieval-only trees
    # the confident head again, where the verifier has found drafts accepted at a tenth of their calibrated odds:
    # priced as the verifier will price them, its trees no longer pay for its 10 ms
    p, drafter = graft_with([0.99] * 4, 0.3)
    step(p, cheap_tokens, factor=0.1)
    p.head_cost.observe(1, 0.01)
    p.head_cost.observe(1, 0.01)
    before = drafter.ingested
    for _ in range(3):
        step(p, cheap_tokens, factor=0.1)
    assert drafter.ingested == before and p.stats.retrieval_only_steps == 3


def test_a_head_that_retrieval_only_trees_beat_still_probes_its_worth():
    """A step the retrieval-only trees win is a skipped step of the head's gate, so the gate's probes (after
    ``probe_every`` skipped steps, then backing off) let the head draft now and then and keep what its trees are worth
    current; a veto after the gate left it priced as its first steps had, so a head sitting out one request never
    drafted again."""

    drafter = IngestCountingDrafter({0: [0.3, 0.3]})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("successor",), prune=False), drafter=drafter,
                      vocab_size=VOCAB)
    p.learn_successors(np.arange(1, 20), (np.arange(1, 20) + 1)[:, None], np.full((19, 1), 0.95))
    drafted = []
    for _ in range(120):
        p.head_cost.buckets = {0: 0.01}  # 10 ms a call (the scripted head's own time would make it free)
        ctx = make_ctx([[1, 2, 3]])
        ctx.step_cost = Linear(0.05, 0.004)
        before = drafter.ingested
        p.propose_trees(ctx)
        drafted.append(drafter.ingested > before)
        if len(drafted) == 3:
            assert p.head_gate.last_rates[0] > p.head_gate.last_rates[1]  # the head alone would beat plain decoding
    steps = [i for i, d in enumerate(drafted) if d]
    # the first step, then probes, each wait doubling while drafting still does not pay (before: [0] alone)
    assert steps[0] == 0 and 3 <= len(steps) <= 4, steps
    gaps = np.diff(steps)
    assert gaps[0] > p.head_gate.probe_every and all(b >= 2 * a - 1 for a, b in zip(gaps, gaps[1:])), steps


def test_grafts_gates_price_trees_as_the_verifier_does():
    """What graft's gates learn a tree is worth uses the verifier's price of each node, the calibrated rate under
    its source's record (``AcceptanceCalibration.capped``), not the uncapped rate graft ranks by: a successor
    continuation scoring 0.95 raw from a source whose last 40 root children were all rejected is worth ~0.02, not
    the ~0.16 its raw number lifts the uncapped rate to."""

    class CountingDrafter(ScriptedDrafter):
        def ingest(self, ctx):
            pass

    p = GraftProposer(None, GraftOptions(budget=8, sources=("successor",), prune=False),
                      drafter=CountingDrafter({0: [0.3, 0.3]}), vocab_size=VOCAB)
    p.learn_successors(np.arange(1, 20), (np.arange(1, 20) + 1)[:, None], np.full((19, 1), 0.95))
    source = p.acceptance_sources.index("successor")
    p.calibration.observe(np.full(40, source), np.full(40, 0.4), np.zeros(40), np.ones(40, np.int64))
    p.head_cost.buckets = {0: 10.0}  # the head cannot pay: graft drafts retrieval-only trees, and prices them
    ctx = make_ctx([[1, 2, 3]])
    ctx.step_cost = Linear(0.05, 0.004)
    ctx.probing, ctx.probe_seconds = False, None
    p.head_gate, p.retrieval_gate = None, None
    p.propose_trees(ctx)  # creates the gates (no history: the head's gate probes, the head drafts and is priced)
    p.head_cost.buckets = {0: 10.0}
    p.propose_trees(ctx)
    assert p.stats.retrieval_only_steps == 1
    raw = np.array([0.95])
    capped = p.calibration.capped(np.array([source]), raw, np.ones(1, np.int64))[0]
    uncapped = p.calibration(np.array([source]), raw, np.ones(1, np.int64))[0]
    assert capped < 0.05 < 0.1 < uncapped
    assert p.retrieval_gate.marginal[0] == pytest.approx(capped, rel=0.25)


def test_the_retrieval_only_trees_are_priced_on_the_heads_own_steps_only():
    """Every step the head drafts also assembles the retrieval-only trees (never proposed), so that the head's trees
    and their rival are priced on the same text; a step the head sits out teaches the rival nothing (priced on that
    text as well, the rival read lower than the head's trees at batch 1 in bf16, and the head drafted on up to half
    the steps for no more tokens a step). No step drafts without the head only to measure them (the verifier's gate,
    which prices whatever graft proposes, would learn from such steps that graft's trees are worth less than they
    are)."""

    drafter = IngestCountingDrafter({0: [0.99] * 4})
    p = GraftProposer(None, GraftOptions(budget=8, sources=("successor",), prune=False), drafter=drafter,
                      vocab_size=VOCAB)
    p.learn_successors(np.arange(1, 20), (np.arange(1, 20) + 1)[:, None], np.full((19, 1), 0.3))
    p.head_cost.observe(1, 0.01)
    p.head_cost.observe(1, 0.01)

    def step():
        ctx = make_ctx([[1, 2, 3]])
        ctx.step_cost = Linear(0.05, 0.004)
        gains = None if p.retrieval_gate is None else p.retrieval_gate.gains
        proposed = p.propose_trees(ctx)[0]
        return proposed, p.retrieval_gate.gains is not gains

    steps = [step() for _ in range(20)]
    assert drafter.ingested == 20 and p.stats.retrieval_only_steps == 0
    assert all(measured for _, measured in steps)
    # what was measured is the successor chain's trees (0.3 a token), while every proposal is the head's tree
    assert p.retrieval_gate.marginal[0] == pytest.approx(0.3, rel=0.05)
    assert all(p.acceptance_sources[t.node_sources[0]] == MODEL_SOURCE for t, _ in steps)
    # a head too dear to pay sits out, and the successor chain it leaves turns sure: those steps do not move the rival
    p.head_cost.buckets = {0: 10.0}
    p.learn_successors(np.arange(1, 20), (np.arange(1, 20) + 1)[:, None], np.full((19, 1), 0.95))
    steps = [step() for _ in range(5)]
    assert drafter.ingested == 20 and p.stats.retrieval_only_steps == 5
    assert not any(measured for _, measured in steps)
    assert all(p.acceptance_sources[t.node_sources[0]] == "successor" for t, _ in steps)
    assert p.retrieval_gate.marginal[0] == pytest.approx(0.3, rel=0.05)


def test_retrieved_nodes_can_be_learnt_by_match_length():
    """A suffix continuation after a 1-token match and one after a 4-token match both score 1.0 raw; with
    calibrate_by_match_length graft names them as different acceptance sources, so the verifier learns (and graft
    ranks by) their own rates."""
    assert [match_class(m) for m in (0, 1, 2, 3, 4, 7, 8, 100)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert match_class_sources("suffix") == tuple(f"suffix@{m}" for m in MATCH_CLASSES)
    p = proposer(budget=4, sources=("suffix", "successor"), prune=False, adaptive_budget=False,
                 calibrate_by_match_length=True)
    assert p.acceptance_sources == ("suffix@1", "suffix@2", "suffix@4", "suffix@8", "successor", MODEL_SOURCE)
    short = p.propose_trees(make_ctx([[5, 6, 7, 8, 9, 5]], req_ids=["s"]))[0]
    long = p.propose_trees(make_ctx([[1, 2, 3, 4, 9, 1, 2, 3, 4]], req_ids=["l"]))[0]
    assert short.token_ids.tolist()[:2] == [6, 7] and long.token_ids.tolist()[:2] == [9, 1]
    assert {p.acceptance_sources[s] for s in short.node_sources} == {"suffix@1"}
    assert {p.acceptance_sources[s] for s in long.node_sources} == {"suffix@4"}
    # after the short match's nodes were rejected, graft trusts them less than the long match's
    for _ in range(4):
        tree = p.propose_trees(make_ctx([[5, 6, 7, 8, 9, 5]], req_ids=["s"]))[0]
        p.on_verified([VerificationResult("s", tree, accepted_nodes=[], bonus_token=0)])
    ids = [p.acceptance_sources.index(n) for n in ("suffix@1", "suffix@4")]
    rates = [float(p.calibration(i, np.array([1.0]), np.array([1]))[0]) for i in ids]
    assert rates[0] < 0.5 < rates[1]
    pooled = proposer(sources=("suffix", "successor"))  # the default: one rate table per source
    assert pooled.acceptance_sources == ("suffix", "successor", MODEL_SOURCE)


def test_graft_glances_at_a_long_suffix_match_where_its_first_node_pays():
    """Option ``glance``: on a step the verifier's gate skips, a request whose suffix match's first node pays for its
    row on the step-cost model gets its retrieval-only tree; one whose match is short (a class the target rarely
    accepts) gets none, and without the option there is no glance at all."""
    p = proposer(glance=True, calibrate_by_match_length=True, sources=("suffix",), budget=8, eagle_checkpoint="none")
    long_match, short_match = p._source_id("suffix", 8), p._source_id("suffix", 1)
    trials = 200
    p.calibration.observe(np.full(trials, long_match), np.full(trials, 0.95), np.ones(trials))
    p.calibration.observe(np.full(trials, short_match), np.full(trials, 0.95), np.zeros(trials))
    passage = list(range(10, 30))
    repeating = [1, 2] + passage + [3, 4] + passage[:12]  # the passage again: its next token is 22
    short = [40, 41, 50, 41]  # "41" matched once before: continues with 50
    ctx = make_ctx([repeating, short])
    ctx.step_cost = Linear(0.05, 0.01)  # one more row costs a 2-request step 2 * (0.08 / 0.07 - 1) = 0.29 tokens
    trees = p.glance(ctx, [0, 1])
    assert trees is not None and trees[1] is None
    assert trees[0].token_ids[0] == 22 and p.stats.glance_trees == 1
    assert trees[0].token_ids[:8].tolist() == passage[12:20]  # the match's continuation, as retrieved
    assert set(trees[0].node_sources.tolist()) == {long_match}  # priced as a long match's nodes
    assert p.glance(make_ctx([short]), [0]) is None  # no cost model: nothing to price by
    ctx.step_cost = Linear(0.0, 0.01)  # a row costs what a request's plain row does: only a sure node would pay
    assert p.glance(ctx, [0, 1]) is None
    off = proposer(calibrate_by_match_length=True, sources=("suffix",), budget=8, eagle_checkpoint="none")
    ctx.step_cost = Linear(0.05, 0.01)
    assert off.glance(ctx, [0, 1]) is None


def test_the_head_drafts_for_the_requests_no_source_matched_on_steps_its_gate_keeps_it_out():
    """Where no retrieval source matched, graft has no tree and plain decoding is the head's only rival: on a step its
    gate (weighing it against the retrieval-only trees on every request) keeps it out, a gate of the unmatched rows'
    own lets it read and draft for those rows alone, while it pays there; ``unmatched_head: false`` keeps it out."""

    class CountingDrafter(ScriptedDrafter):
        def __init__(self, level_probs):
            super().__init__(level_probs)
            self.ingested: list[list[int]] = []

        def ingest(self, ctx):
            self.ingested.append([i for i in range(ctx.num_reqs) if ctx.needs_draft(i)])

    def graft(head_probs, **options):
        drafter = CountingDrafter({0: head_probs, 1: head_probs})
        p = GraftProposer(None, GraftOptions(budget=8, sources=("successor",), prune=False, **options),
                          drafter=drafter, vocab_size=VOCAB)
        p.learn_successors(np.arange(1, 20), (np.arange(1, 20) + 1)[:, None], np.full((19, 1), 0.95))
        p.head_drafts = lambda ctx, budget, rows: False  # its gate keeps it out: retrieval-only trees win
        return p, drafter

    def step(p):
        ctx = make_ctx([[1, 2, 3], [30, 31, 40]])  # row 0 continues a learned successor; nothing follows 40
        ctx.step_cost = Linear(0.05, 0.004)
        return ctx, p.propose_trees(ctx)

    p, drafter = graft([0.9, 0.9, 0.9])
    ctx, (matched, unmatched) = step(p)  # nothing known yet: the unmatched gate drafts, and learns
    assert drafter.ingested == [[1]] and drafter.calls[0] == [1] and ctx.draft_rows is None
    assert matched.token_ids.tolist()[:3] == [4, 5, 6] and MODEL_SOURCE in p.acceptance_sources
    assert unmatched.token_ids[0] == 50 and set(unmatched.node_sources.tolist()) == {
        p.acceptance_sources.index(MODEL_SOURCE)}
    assert p.stats.unmatched_head_steps == 1 and p.stats.retrieval_only_steps == 1
    p.head_cost.observe(2, 0.001)
    p.head_cost.observe(2, 0.001)  # 1 ms a call: a confident head pays against plain decoding
    for _ in range(3):
        step(p)
    assert drafter.ingested[1:] == [[1]] * 3 and p.unmatched_gate.last_rates[0] > p.unmatched_gate.last_rates[1]
    # the same head at 200 ms a call never pays: its gate keeps it out but for its probes
    p.head_cost.buckets = {0: 0.2}
    for _ in range(3):
        step(p)
    assert len(drafter.ingested) == 4 and p.unmatched_gate.last_rates[0] < p.unmatched_gate.last_rates[1]
    off, drafter = graft([0.9, 0.9, 0.9], unmatched_head=False)
    _, (_, unmatched) = step(off)
    assert drafter.ingested == [] and unmatched.num_nodes == 0 and off.unmatched_gate is None


def test_finished_outputs_kept_in_a_file_draft_for_the_next_engine(tmp_path):
    path = tmp_path / "outputs.tsds"
    first = proposer(budget=8, sources=("suffix",), adaptive_budget=False, suffix_global_file=str(path),
                     suffix_global_save_every=2)
    prompt, outputs = [30, 31, 32], {"a": [1, 2, 3, 4], "b": [7, 8, 9]}
    for req, out in outputs.items():
        first.propose_trees(make_ctx([prompt + out[:1]], req_ids=[req]))
        first.propose_trees(make_ctx([prompt + out], req_ids=[req]))
    first.on_requests_finished({"a"})
    assert not path.exists()  # one finished request of the two between saves
    first.on_requests_finished({"b"})
    assert path.exists()
    first.on_shutdown()  # nothing new since that save: the file stays as it is

    second = proposer(budget=8, sources=("suffix",), adaptive_budget=False, suffix_global_file=str(path))
    assert len(second.sources.suffix.global_store) == 9  # both outputs, a separator after each
    tree = second.propose_trees(make_ctx([[50, 1, 2]], req_ids=["c"]))[0]
    assert edges(tree)[:2] == [((), 3), ((3,), 4)]  # the first engine's output continues the new request


def test_store_file_option_needs_the_global_store():
    with pytest.raises(msgspec.ValidationError, match="suffix_global_file.*suffix_global"):
        msgspec.convert({"suffix_global_file": "outputs.tsds", "suffix_global": False}, GraftOptions)
    with pytest.raises(msgspec.ValidationError, match="suffix_global_file.*sources"):
        msgspec.convert({"suffix_global_file": "outputs.tsds", "sources": ["ngram"]}, GraftOptions)
