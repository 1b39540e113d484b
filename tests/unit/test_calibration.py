"""The verifier's acceptance calibration (vllm_treespec.verify.calibration), without an engine: node_probs become
calibrated acceptance probabilities per source, and every step's committed tokens teach it — trees and chains alike,
cut to what was scheduled; drafts that were not what vLLM verified teach nothing."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import FakeProposer, FakeRequest, fake_runner, recording_layer, schedule

from vllm_treespec.api import DraftTree, DraftTreeError
from vllm_treespec.attn import plan
from vllm_treespec.cost.allocate import allocate
from vllm_treespec.cost.model import PiecewiseLinear, StepCostModel
from vllm_treespec.verify.calibration import (ACCEPTANCE_PRIOR_TRIALS, AcceptanceCalibration, AcceptanceTracker,
                                              accepted_walk)
from vllm_treespec.verify.verifier import TreeVerifier

# 10 -> 12, 10 -> 13, 11: two sources
TREE = DraftTree(np.array([10, 11, 12, 13]), np.array([-1, -1, 0, 0], np.int32),
                 np.array([0.95, 0.35, 0.55, 0.15], np.float32), np.array([0, 1, 0, 1], np.int32))


@pytest.fixture(autouse=True)
def no_published_batch():
    yield
    plan.publish(None)


def test_calibration_starts_at_the_raw_number_and_learns_the_rate():
    cal = AcceptanceCalibration(["suffix", "successor"])
    raw = np.array([0.05, 0.55, 0.95])
    assert np.allclose(cal(0, raw), raw)
    cal.observe(np.zeros(40, np.int64), np.full(40, 0.97), np.arange(40) == 0)
    m = ACCEPTANCE_PRIOR_TRIALS
    source_rate = (1 + m * 0.95) / (40 + m)  # the bin's prior: the source's rate, from its raw number
    assert cal(0, np.array([0.95]))[0] == pytest.approx((1 + m * source_rate) / (40 + m))
    # one source id per node; a source without data keeps its raw numbers
    assert cal(np.array([0, 1]), np.array([0.95, 0.95])).tolist() == pytest.approx(
        [(1 + m * source_rate) / (40 + m), 0.95])


def test_a_bin_without_data_starts_from_its_sources_rate_not_its_raw_number():
    cal = AcceptanceCalibration(["suffix"])
    cal.observe(np.zeros(200, np.int64), np.full(200, 0.95), np.arange(200) < 40)  # 20% at raw 0.95
    m = ACCEPTANCE_PRIOR_TRIALS
    source_rate = (40 + m * 0.65) / (200 + m)
    assert cal(0, np.array([0.65]))[0] == pytest.approx(source_rate)  # bin 6 has no data
    assert cal(0, np.array([0.65]))[0] < 0.25


def test_depths_are_learned_apart():
    """Root children and deep nodes in the same raw bin: each depth class gets its own rate, and the pooled rate
    (graft's ranking, no depth) mixes both."""
    cal = AcceptanceCalibration(["ngram"])
    n = 400
    cal.observe(np.zeros(n, np.int64), np.full(n, 0.95), np.arange(n) < n // 4, np.ones(n, np.int64))
    cal.observe(np.zeros(n, np.int64), np.full(n, 0.95), np.arange(n) < n * 9 // 10, np.full(n, 5))
    root, deep = cal(0, np.array([0.95, 0.95]), np.array([1, 7]))
    assert root == pytest.approx(0.25, abs=0.02) and deep == pytest.approx(0.9, abs=0.02)
    assert cal(0, np.array([0.95]))[0] == pytest.approx(0.575, abs=0.02)
    assert cal(0, np.array([0.95]), np.array([2]))[0] == pytest.approx(0.95)  # depth 2 has no data yet


def test_expectation_correction_scales_every_path_probability():
    """Drafts that yield half of what the rates expected: the tracker halves root children's probabilities, so every
    path probability (the allocator's gain) halves; deeper nodes keep their conditional rate."""
    tracker = AcceptanceTracker(["suffix", "successor"])
    correction = tracker.expectation
    assert correction.factor == 1.0
    for _ in range(400):
        correction.observe(40.0, 20.0)
    assert correction.factor == pytest.approx(0.5, abs=0.01)
    calibrated = tracker.calibrate([TREE])[0]
    # no data yet: each node at most 1/2 (the ceiling), then root children scaled
    assert calibrated.node_probs.tolist() == pytest.approx(
        [0.5 * correction.factor, 0.35 * correction.factor, 0.5, 0.15], abs=1e-6)
    for _ in range(500):
        correction.observe(1.0, 10.0)
    assert correction.factor == 2.0  # bounded
    assert tracker.calibrate([TREE])[0].node_probs[0] == 1.0  # and a probability stays one


def test_each_request_is_priced_by_its_own_record_shrunk_to_the_batchs():
    """Two requests handed the same trees: the target keeps every draft of one (a span copied from its prompt) and
    none of the other's (prose). The batch's correction averages them and misprices both; each request's own
    correction follows what its drafts yield, a new request starts at the batch's, and a finished one is forgotten."""
    tracker = AcceptanceTracker(["suffix", "successor"])
    chain = DraftTree(np.array([10, 12]), np.array([-1, 0], np.int32), np.array([0.5, 0.5], np.float32),
                      np.zeros(2, np.int32))
    for _ in range(30):
        tracker.handed(["copy", "prose"], [chain, chain], [chain, chain])
        tracker.scheduled({"copy": [10, 12], "prose": [10, 12]})
        tracker.committed(["copy", "prose"], [[10, 12, 7], [5]])
    batch = tracker.expectation.factor
    copy, prose, new = (tracker.by_request.factor(req_id, batch) for req_id in ("copy", "prose", "new"))
    assert copy > 1.5 * batch and prose < 0.5 * batch
    assert new == batch
    rate = tracker.calibrate([chain], corrected=False, req_ids=["prose"])[0].node_probs[0]  # a probe's: uncorrected
    priced = [t.node_probs[0] for t in tracker.calibrate([chain] * 3, req_ids=["copy", "prose", "new"])]
    assert priced == pytest.approx([min(rate * copy, 1.0), rate * prose, rate * batch], rel=1e-6)
    # without request ids every tree is priced by the batch's correction
    assert [t.node_probs[0] for t in tracker.calibrate([chain] * 2)] == pytest.approx([rate * batch] * 2, rel=1e-6)
    tracker.forget({"prose"})
    assert tracker.by_request.factor("prose", batch) == batch


def test_tracker_measures_expected_against_accepted():
    tracker = AcceptanceTracker(["suffix", "successor"])
    tracker.handed(["a"], [TREE], [TREE])
    tracker.scheduled({"a": [10, 11, 12, 13]})
    tracker.committed(["a"], [[10, 12, 99]])  # 10 then 12 accepted
    # expected with the raw numbers under the ceiling of a source without data (1/2): 0.5 + 0.35 + 0.5 * (0.5 + 0.15)
    assert tracker.expectation.expected == pytest.approx(0.5 + 0.35 + 0.5 * 0.65, abs=1e-6)
    assert tracker.expectation.accepted == 2.0
    # learned by depth: 10 and 11 at depth 1 (10 accepted), 12 and 13 at depth 2 (12 accepted)
    cal = tracker.calibration
    assert cal.depth_trials[:, 0].sum() == 2 and cal.depth_trials[:, 1].sum() == 2
    assert cal.depth_accepts[0, 0].sum() == 1 and cal.depth_accepts[0, 1].sum() == 1


def test_the_budget_believes_no_more_of_a_source_than_its_record_shows():
    """A retrieval continuation seen once scores 1.0. A fresh engine once priced such nodes at 1 after a probe whose 5
    nodes were all accepted, and verified 120 of them in a batch of 8 (none accepted): the ceiling, the estimate with
    the source's prior from its record (Laplace's rule of succession) instead of its raw number, keeps a handful of
    successes from becoming certainty; with a long record it is the record, bin by bin."""
    tracker = AcceptanceTracker(["suffix"])
    cal = tracker.calibration
    m = ACCEPTANCE_PRIOR_TRIALS
    chain = DraftTree(np.arange(20, 35), np.arange(-1, 14).astype(np.int32), np.ones(15, np.float32),
                      np.zeros(15, np.int32))
    cal.observe(np.zeros(5, np.int64), np.ones(5), np.ones(5, bool), np.arange(1, 6))  # one probe: 5 of 5
    assert np.allclose(cal(0, np.ones(15), chain.depths()), 1.0)  # the rates graft ranks by
    probs = tracker.calibrate([chain], corrected=False)[0].node_probs
    assert probs[0] == pytest.approx((1 + m * 2 / 3) / (1 + m))  # 1 of 1 at depth 1: prior 2/3
    assert probs[2] == pytest.approx((3 + m * 4 / 5) / (3 + m))  # 3 of 3 deeper: prior 4/5
    assert np.cumprod(probs).sum() < 4  # what the budget expects of the 15-node chain, not 15
    # a long record of a source whose confident nodes are accepted and its unsure ones are not: every bin is priced
    # at its own rate (the source's mean, ~0.5, does not cap its confident bin)
    n = 1000
    raw = np.where(np.arange(2 * n) < n, 0.95, 0.05)
    cal.observe(np.zeros(2 * n, np.int64), raw, (np.arange(2 * n) < 0.9 * n) | (np.arange(2 * n) >= 1.9 * n),
                np.ones(2 * n, np.int64))
    tree = DraftTree(np.array([1, 2]), np.array([-1, -1], np.int32), np.array([0.95, 0.05], np.float32),
                     np.zeros(2, np.int32))
    assert tracker.calibrate([tree], corrected=False)[0].node_probs.tolist() == pytest.approx([0.9, 0.1], abs=0.01)


def test_node_sources_are_checked_and_kept_by_cuts():
    with pytest.raises(DraftTreeError, match="node_sources"):
        DraftTree(np.array([1, 2]), np.array([-1, 0]), None, np.array([0]))
    assert TREE.truncate(2).node_sources.tolist() == [0, 1]
    assert TREE.breadth_first().node_sources.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="acceptance_sources"):
        AcceptanceTracker(["only"]).calibrate([TREE])


def test_walk_follows_the_committed_tokens():
    assert accepted_walk(TREE, [10, 13]).tolist() == [True, False, False, True]
    assert accepted_walk(TREE, []).tolist() == [False] * 4
    assert accepted_walk(TREE, [12]) is None  # 12 is not a root child: not this tree


def test_tracker_learns_from_what_was_scheduled_and_committed():
    tracker = AcceptanceTracker(["suffix", "successor"])
    cal = tracker.calibration
    calibrated = tracker.calibrate([TREE, None])
    assert np.allclose(calibrated[0].node_probs, [0.5, 0.35, 0.5, 0.15])  # no data yet: the raw numbers, at most 1/2
    kept = DraftTree(np.array([10, 12, 11]), np.array([-1, 0, -1], np.int32))  # what the budget kept
    tracker.handed(["a", "b"], [TREE, None], [kept, None])
    tracker.scheduled({"a": [10, 12]})  # vLLM scheduled two of the three drafts
    tracker.committed(["a", "b"], [[10, 7], [5]])  # 10 accepted, then the target's own 7
    # reached: 10 (accepted, suffix, raw 0.95) and its child 12 (rejected, suffix, raw 0.55); 11 was not scheduled
    assert cal.trials.sum() == 2 and cal.accepts[0, 9] == 1 and cal.trials[0, 5] == 1
    # 10's other child, 13, was not verified, but 12 was (and rejected): the 7 says nothing of 13 under sampling
    assert tracker.stats == {"learned_trees": 1, "learned_nodes": 2, "unverified_nodes": 0}
    # the next calibration of those bins (10 at depth 1, 12 at depth 2) follows
    root_prior, child_prior = (1 + 8 * 0.95) / 9, 8 * 0.55 / 9
    assert cal(0, np.array([0.95, 0.55]), np.array([1, 2])).tolist() == pytest.approx(
        [(1 + 8 * root_prior) / 9, 8 * child_prior / 9])


def test_chains_teach_too_and_replaced_drafts_do_not():
    tracker = AcceptanceTracker([])
    chain = DraftTree(np.array([4, 5, 6]), np.array([-1, 0, 1], np.int32), np.array([0.9, 0.9, 0.9], np.float32))
    tracker.handed(["a"], [chain], [chain])
    tracker.scheduled({"a": [4, 5, 6]})
    tracker.committed(["a"], [[4, 5, 9]])  # two accepted, the third rejected
    assert tracker.calibration.trials.sum() == 3 and tracker.calibration.accepts.sum() == 2
    tracker.handed(["a"], [chain], [chain])
    tracker.scheduled({"a": [4, 8]})  # not the drafts we handed (a chain fallback, placeholders)
    tracker.committed(["a"], [[4, 8, 1]])
    tracker.handed(["a"], [chain], [chain])
    tracker.scheduled({})  # not scheduled with drafts
    tracker.committed(["a"], [[4, 5, 6, 1]])
    assert tracker.calibration.trials.sum() == 3


def test_the_token_after_the_last_accepted_node_teaches_its_unverified_children():
    tracker = AcceptanceTracker(["suffix", "successor"])
    depth_trials, depth_accepts = tracker.calibration.depth_trials, tracker.calibration.depth_accepts
    # the budget kept root child 10 only; 10 was accepted and the target's next token is 12: of 10's children left
    # out, 12 (suffix, raw 0.55) would have been accepted and 13 (successor, raw 0.15) not, both at depth 2. Root
    # child 11 is no child of the last accepted node: the token says nothing of it
    tracker.handed(["a"], [TREE], [TREE.truncate(1)])
    tracker.scheduled({"a": [10]})
    assert tracker.committed(["a"], [[10, 12]]) == 1
    assert depth_trials.sum() == 3 and tracker.stats == {"learned_trees": 1, "learned_nodes": 1,
                                                         "unverified_nodes": 2}
    assert (depth_trials[0, 0, 9], depth_accepts[0, 0, 9]) == (1, 1)  # 10, verified
    assert (depth_trials[0, 1, 5], depth_accepts[0, 1, 5]) == (1, 1)  # 12, not verified
    assert (depth_trials[1, 1, 1], depth_accepts[1, 1, 1]) == (1, 0)  # 13, not verified
    # the drafter proposed, the budget admitted nothing: the step's token (11) decides the root children
    tracker.handed(["a"], [TREE], [TREE.truncate(0)])
    tracker.scheduled({})
    assert tracker.committed(["a"], [[11]]) is None  # no draft was verified
    assert (depth_trials[0, 0, 9], depth_accepts[0, 0, 9]) == (2, 1)  # 10
    assert (depth_trials[1, 0, 3], depth_accepts[1, 0, 3]) == (1, 1)  # 11
    assert tracker.stats["unverified_nodes"] == 4 and depth_trials.sum() == 5
    # a verified child was rejected (12): under sampling the token is then drawn from what the target left, so its
    # unverified sibling 13 is not counted
    tracker.handed(["a"], [TREE], [DraftTree(np.array([10, 12]), np.array([-1, 0], np.int32))])
    tracker.scheduled({"a": [10, 12]})
    assert tracker.committed(["a"], [[10, 13]]) == 1
    assert depth_trials.sum() == 7 and tracker.stats["unverified_nodes"] == 4
    # not what was handed, or more tokens than the verified drafts can give: nothing
    tracker.handed(["a"], [TREE], [TREE.truncate(1)])
    tracker.scheduled({"a": [11]})
    tracker.committed(["a"], [[11, 12]])
    tracker.handed(["a"], [TREE], [TREE.truncate(0)])
    tracker.scheduled({})
    tracker.committed(["a"], [[10, 12]])
    assert depth_trials.sum() == 7 and tracker.stats["unverified_nodes"] == 4


def test_a_class_priced_out_by_its_first_outcomes_is_re_priced_by_the_tokens_after_it():
    """A depth class whose first verified nodes were rejected is priced below what a row costs; learning only from
    verified nodes it was never verified again (a batch-1 engine verified one root child a step for hundreds of steps
    of copied code whose deeper nodes were accepted). The committed token after each accepted root child re-prices it
    and the budget admits the chain again."""
    from vllm_treespec.cost.budget import StepTime

    tokens = np.arange(1, 40)
    cost = StepTime(StepCostModel(PiecewiseLinear(tokens, 0.05 + 0.01 * (tokens - 1))))  # a row: 1/5 of a step
    tracker = AcceptanceTracker(["suffix"])
    cal = tracker.calibration
    cal.observe(np.zeros(20, np.int64), np.full(20, 0.95), np.arange(20) < 18, np.ones(20, np.int64))
    cal.observe(np.zeros(4, np.int64), np.full(4, 0.95), np.zeros(4, bool), np.full(4, 2))  # deeper: 0 of 4
    chain = DraftTree(np.array([10, 12, 14, 16]), np.arange(-1, 3).astype(np.int32), np.full(4, 0.95, np.float32),
                      np.zeros(4, np.int32))
    target = [10, 12, 14, 16, 18]  # what the target writes: the whole chain is right

    def admitted() -> DraftTree:
        return allocate(tracker.calibrate([chain], corrected=False), cost).trees[0]

    assert admitted().num_nodes == 1
    for _ in range(12):
        kept = admitted()
        tracker.handed(["a"], [chain], [kept])
        tracker.scheduled({"a": kept.token_ids.tolist()})
        assert tracker.committed(["a"], [target[: kept.num_nodes + 1]]) == kept.num_nodes
    assert admitted().num_nodes == 4
    assert tracker.stats["unverified_nodes"] >= 4


def test_the_verifier_calibrates_for_the_budget_and_hands_proposers_the_calibration():
    from vllm_treespec.cost.budget import StepBudget
    from vllm_treespec.cost.model import PiecewiseLinear, StepCostModel

    class Sourced(FakeProposer):
        acceptance_sources = ("suffix", "successor")

        def use_acceptance(self, calibration):
            self.acceptance = calibration

    requests = [FakeRequest("a", [1, 2, 3, 4, 9], [3, 0])]
    runner = fake_runner(requests, 8)
    proposer = Sourced({"a": TREE})
    verifier = TreeVerifier(runner, proposer)
    verifier._layers = [recording_layer()]
    assert proposer.acceptance is verifier.acceptance.calibration and proposer.acceptance.names == ["suffix",
                                                                                                      "successor"]
    tokens = np.arange(1, 40)
    verifier.budget = StepBudget(StepCostModel(PiecewiseLinear(tokens, 0.05 + 0.01 * (tokens - 1))), 8)
    # suffix nodes at raw 0.9-1 were almost never accepted: the budget sees ~0.1, not 0.95
    verifier.acceptance.calibration.observe(np.zeros(200, np.int64), np.full(200, 0.95), np.arange(200) < 20)
    # at 10 ms a token over a 50 ms step only the successor's 0.35 node pays; on the raw numbers 10 (0.95) would lead
    assert verifier.propose([[9]]) == [[11]]
    assert max(verifier.budget.last.gains) == pytest.approx(0.35)
    record = 21 / 202  # Laplace's rule on the source's 20 of 200: below its raw-number prior, so the ceiling binds
    assert np.isclose(verifier.budget.last.gains, (20 + 8 * record) / 208).any()  # node 10, calibrated
    # an engine step: what was handed is scheduled and its outcome learned at the next propose
    verifier.budget = None
    proposer.trees = {"a": DraftTree(np.array([10, 11]), np.array([-1, -1], np.int32),
                                     np.array([0.35, 0.35], np.float32), np.array([1, 1], np.int32))}
    drafts = verifier.propose([[9]])
    assert drafts == [[10, 11]]
    scheduler_output, num_scheduled = schedule(runner, {"a": drafts[0]})
    verifier.attach(scheduler_output, num_scheduled)
    plan.publish(None)
    trials = verifier.acceptance.calibration.trials.sum()
    verifier.propose([[11, 4]])  # 11 accepted, then the target's 4
    assert verifier.acceptance.calibration.trials.sum() == trials + 2
    assert verifier.acceptance.calibration.accepts[1].sum() == 1


def test_classes_of_a_split_source_start_from_their_family():
    """suffix@1 and suffix@8 (graft's match lengths) are learnt apart; a class with no record yet takes the family's
    rate, where a plain source with no record takes its raw number (capped: 1/2)."""
    cal = AcceptanceCalibration(["suffix@1", "suffix@2", "suffix@8", "successor"])
    raw, depth = np.array([1.0]), np.array([1])
    n = 40
    cal.observe(np.zeros(n, np.int64), np.ones(n), np.arange(n) < 10, np.ones(n, np.int64))  # suffix@1: 25%
    cal.observe(np.full(n, 2), np.ones(n), np.arange(n) < 36, np.ones(n, np.int64))  # suffix@8: 90%
    short, fresh, long = (float(cal(i, raw, depth)[0]) for i in range(3))
    assert short < 0.35 and long > 0.8
    assert fresh == pytest.approx((46 + 8) / (80 + 8))  # the family: 46 of 80 and the raw 1.0 as 8 trials
    assert float(cal.capped(1, raw, depth)[0]) == pytest.approx((46 + 1) / (80 + 2))  # the family's record
    assert float(cal(3, raw, depth)[0]) == 1.0 and float(cal.capped(3, raw, depth)[0]) == 0.5  # unsplit: as before
    # depth classes stay apart within the family: no record at depth 2 yet
    assert float(cal(1, raw, np.array([2]))[0]) == 1.0
    # pooled over depths (depth None) and per node sources
    both = cal(np.array([0, 2]), np.array([1.0, 1.0]))
    assert both[0] < 0.35 < 0.8 < both[1]


def reference_rate(cal: AcceptanceCalibration, source: int, raw: float, depth: int | None, capped: bool) -> float:
    """One node's rate by the documented estimate, written out from the counts (no cached sums)."""
    m = ACCEPTANCE_PRIOR_TRIALS
    raw = min(max(raw, 0.0), 1.0)
    b = min(int(raw * 10), 9)
    trials = cal.depth_trials.sum(axis=1) if depth is None else cal.depth_trials[:, min(max(depth, 1), 3) - 1]
    accepts = cal.depth_accepts.sum(axis=1) if depth is None else cal.depth_accepts[:, min(max(depth, 1), 3) - 1]
    source_trials, source_accepts = float(trials[source].sum()), float(accepts[source].sum())
    prior = (source_accepts + m * raw) / (source_trials + m)
    ceiling = (source_accepts + 1.0) / (source_trials + 2.0)
    family_name = cal.names[source].split("@")[0]
    if "@" in cal.names[source]:
        members = [i for i, name in enumerate(cal.names) if name.split("@")[0] == family_name]
        family_trials, family_accepts = float(trials[members].sum()), float(accepts[members].sum())
        family = (family_accepts + m * raw) / (family_trials + m)
        family_ceiling = (family_accepts + 1.0) / (family_trials + 2.0)
        prior = (source_accepts + m * family) / (source_trials + m)
        ceiling = (source_accepts + m * family_ceiling) / (source_trials + m)
    if capped:
        prior = min(prior, ceiling)
    return min((float(accepts[source, b]) + m * prior) / (float(trials[source, b]) + m), 1.0)


def test_rates_are_exactly_the_documented_estimate_between_and_after_observations():
    """The rates come from sums of the counts kept until the next observation (graft calibrates several trees a
    step): every rate, split sources and pooled depths included, equals the estimate written out from the counts,
    bit for bit, however the observations interleave with the calls."""
    cal = AcceptanceCalibration(["suffix@1", "suffix@2", "suffix@8", "successor", "model"])
    rng = np.random.default_rng(0)
    for _ in range(6):
        n = int(rng.integers(1, 60))
        cal.observe(rng.integers(0, 5, n), rng.random(n), rng.random(n) < 0.4, rng.integers(1, 6, n))
        sources, raw, depth = rng.integers(0, 5, 40), rng.random(40), rng.integers(1, 6, 40)
        raw[:3] = [0.0, 1.0, 0.999]
        for capped in (False, True):
            rates = cal._rate(sources, raw, depth, capped)
            assert rates.tolist() == [reference_rate(cal, int(s), float(r), int(d), capped)
                                      for s, r, d in zip(sources, raw, depth)]
            pooled = cal._rate(sources, raw, None, capped)
            assert pooled.tolist() == [reference_rate(cal, int(s), float(r), None, capped)
                                       for s, r in zip(sources, raw)]
        one = cal(2, raw, depth)  # one source for every node
        assert one.tolist() == [reference_rate(cal, 2, float(r), int(d), False) for r, d in zip(raw, depth)]
