"""The batch node budget (ECHO) on synthetic cost curves: flat -> full budget, steep -> no speculation, in between ->
the size that maximises expected tokens per second (checked against brute force), ancestor closure, caps, and a
batch's requests sharing one budget best-first."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_treespec.api import DraftTree
from vllm_treespec.cost.allocate import DraftGate, allocate, is_ancestor_closed, path_probs, path_products, trim
from vllm_treespec.cost.model import PiecewiseLinear, StepCostModel


class Curve:
    """Step seconds = fn(tokens) (+ per_request * (reqs - 1))."""

    def __init__(self, fn, per_request=0.0):
        self.fn, self.per_request = fn, per_request

    def predict_many(self, num_tokens, num_reqs=1, plain_tokens=None):
        return self.fn(np.asarray(num_tokens, np.float64)) + self.per_request * (num_reqs - 1)


FLAT = Curve(lambda t: np.full_like(t, 0.010))
STEEP = Curve(lambda t: 0.060 * t)  # every token costs a whole plain step
MIDDLE = Curve(lambda t: 0.060 + 0.006 * (t - 1))
STEEP_FIRST_NODES = Curve(lambda t: 0.060 + 0.030 * (t - 1))  # a node pays only where it is nearly sure


def tree(parents, probs, tokens=None):
    n = len(parents)
    return DraftTree(np.arange(n) if tokens is None else tokens, np.array(parents), np.array(probs, np.float32))


def star(probs):
    return tree([-1] * len(probs), probs)


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    bfs = tree(parents, rng.uniform(0.05, 1.0, n)).breadth_first()
    return DraftTree(np.arange(n), bfs.parents, bfs.node_probs)  # token id = node index


def rate(trees_and_keeps, cost, num_reqs):
    expected = num_reqs + sum(path_probs(t)[k].sum() for t, k in trees_and_keeps)
    return expected / float(cost.predict_many(num_reqs + sum(int(k.sum()) for _, k in trees_and_keeps), num_reqs))


def closed_subsets(t):
    for bits in itertools.product([False, True], repeat=t.num_nodes):
        keep = np.array(bits, bool)
        if is_ancestor_closed(t, keep):
            yield keep


def test_path_probs_multiply_along_the_path_and_never_increase():
    t = tree([-1, 0, 1, -1, 3], [0.5, 0.5, 2.0, 0.9, float("nan")])
    assert path_probs(t).tolist() == pytest.approx([0.5, 0.25, 0.25, 0.9, 0.0])
    rng = np.random.default_rng(0)
    for _ in range(20):
        r = random_tree(rng, 12)
        pp = path_probs(r)
        assert np.all(pp[r.parents >= 0] <= pp[r.parents[r.parents >= 0]])
    with pytest.raises(ValueError):
        path_probs(DraftTree.chain([1, 2]))
    # every factor clipped to [0, 1] (NaN = 0), and the products exactly the float64 ones, whatever the dtypes
    parents = np.array([-1, 0, 1, -1, 3, 4], np.int32)
    probs = np.array([0.3, float("inf"), -0.5, 0.7, 0.1, 0.9], np.float32)
    assert path_products(parents, probs).tolist() == [float(np.float32(0.3)), float(np.float32(0.3)), 0.0,
                                                       float(np.float32(0.7)),
                                                       float(np.float32(0.7)) * float(np.float32(0.1)),
                                                       float(np.float32(0.7)) * float(np.float32(0.1))
                                                       * float(np.float32(0.9))]
    assert path_products(np.zeros(0, np.int64), np.zeros(0)).shape == (0,)


def test_flat_curve_admits_the_full_budget():
    t = star([0.6, 0.3, 0.05, 0.01])
    a = allocate([t], FLAT)
    assert a.num_nodes.tolist() == [4] and a.trees[0].num_nodes == 4
    assert a.expected_tokens == pytest.approx(1 + 0.96, rel=1e-6)
    a = allocate([t], FLAT, per_request_cap=3)
    assert a.num_nodes.tolist() == [3]


def test_steep_curve_admits_nothing():
    a = allocate([star([0.9, 0.05]), tree([-1, 0, 1], [0.95, 0.95, 0.95])], STEEP)
    assert a.num_nodes.tolist() == [0, 0] and a.trees == [None, None]
    assert a.rate == pytest.approx(a.plain_rate) and a.seconds == pytest.approx(0.120)


@pytest.mark.parametrize("with_context", [False, True])
def test_trees_without_nodes_price_the_plain_step_as_trees_that_admit_none(with_context):
    """A step whose drafter found nothing is priced as a step whose nodes all lost: the same plain step."""
    empty = DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32))
    cost, row_excess = MIDDLE, None
    if with_context:  # rows priced by their requests' sequence lengths
        cost = StepCostModel(PiecewiseLinear([1, 2, 4, 8], [0.06, 0.066, 0.08, 0.11]), per_context=1e-5)
        row_excess = np.array([300.0, 500.0, 0.0])
    nothing = allocate([empty, None, empty], cost, overhead=0.002, row_excess=row_excess)
    lost = allocate([empty, None, star([1e-9])], cost, overhead=0.002, row_excess=row_excess)
    assert lost.num_nodes.tolist() == [0, 0, 0] and lost.gains.size == 1  # its node was a candidate, and lost
    assert nothing.trees == lost.trees == [None, None, None] and nothing.num_nodes.tolist() == [0, 0, 0]
    assert nothing.gains.size == 0 and nothing.admitted_gain == lost.admitted_gain == 0.0
    for field in ("expected_tokens", "seconds", "plain_rate"):
        assert getattr(nothing, field) == getattr(lost, field)
    assert nothing.expected_tokens == 3.0


def test_zero_probability_nodes_are_never_admitted():
    a = allocate([star([0.5, 0.0])], FLAT)
    assert a.num_nodes.tolist() == [1]


def test_in_between_picks_the_width_that_maximises_tokens_per_second():
    probs = [0.5, 0.2, 0.12, 0.08, 0.05, 0.03, 0.02, 0.01]
    t = star(probs)
    a = allocate([t], MIDDLE)
    # brute force over widths w (the w most likely children)
    rates = [(1 + sum(probs[:w])) / float(MIDDLE.predict_many(1 + w)) for w in range(len(probs) + 1)]
    best = int(np.argmax(rates))
    assert 0 < best < len(probs)
    assert a.num_nodes.tolist() == [best]
    assert a.rate == pytest.approx(max(rates))
    assert sorted(a.trees[0].node_probs.tolist()) == pytest.approx(sorted(probs[:best]))


@pytest.mark.parametrize("seed", range(6))
def test_best_over_every_ancestor_closed_subset(seed):
    rng = np.random.default_rng(seed)
    t = random_tree(rng, 9)
    for cost in (MIDDLE, Curve(lambda x: 0.05 + 0.02 * np.maximum(x - 4, 0)),
                 Curve(lambda x: 0.05 + 0.01 * np.floor((x - 1) / 4))):  # a stepped, GPU-tile-like curve
        a = allocate([t], cost)
        brute = max(rate([(t, k)], cost, 1) for k in closed_subsets(t))
        assert a.rate == pytest.approx(brute, rel=1e-9)


def test_admitted_sets_are_ancestor_closed_and_trimmed_trees_valid():
    rng = np.random.default_rng(7)
    for _ in range(30):
        trees = [random_tree(rng, int(rng.integers(1, 20))) for _ in range(3)]
        a = allocate(trees, MIDDLE, per_request_cap=int(rng.integers(1, 10)))
        for t, kept in zip(trees, a.trees):
            if kept is None:
                continue
            # every kept node's path is kept: its tokens' paths appear in the original (tokens are node ids here)
            for i in range(kept.num_nodes):
                original = int(kept.token_ids[i])
                path = [int(kept.token_ids[j]) for j in kept.path_to(i)]
                assert path == t.path_to(original)
            assert np.all(np.diff(kept.depths()) >= 0)  # still breadth-first


def test_equal_path_probabilities_keep_parents_first():
    t = tree([-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0])  # all paths equally likely
    a = allocate([t], Curve(lambda x: 0.06 + 0.05 * (x - 1)), per_request_cap=2)
    assert a.trees[0].parents.tolist() == [-1, 0]


def test_trim_reindexes_parents_and_refuses_open_sets():
    t = tree([-1, -1, 0, 1, 2], [0.9, 0.8, 0.7, 0.6, 0.5])
    kept = trim(t, np.array([True, False, True, False, True]))
    assert kept.token_ids.tolist() == [0, 2, 4] and kept.parents.tolist() == [-1, 0, 1]
    assert kept.node_probs.tolist() == pytest.approx([0.9, 0.7, 0.5])
    with pytest.raises(ValueError):
        trim(t, np.array([False, False, True, False, False]))
    assert trim(t, np.ones(5, bool)) is t


def test_per_request_cap_is_respected():
    trees = [star([0.9] * 6), star([0.9] * 6)]
    a = allocate(trees, FLAT, per_request_cap=[2, 4])
    assert a.num_nodes.tolist() == [2, 4]


def test_requests_share_the_batch_budget_best_first():
    confident = tree([-1, 0, 1, 2], [0.9, 0.9, 0.9, 0.9])
    unsure = star([0.3, 0.2, 0.1])
    a = allocate([unsure, confident], FLAT, batch_cap=5)
    # path probs: confident 0.9 0.81 0.729 0.656; unsure 0.3 0.2 0.1 -> the best five
    assert a.num_nodes.tolist() == [1, 4]
    a = allocate([unsure, confident], MIDDLE, num_reqs=2)
    brute = max(rate([(unsure, ku), (confident, kc)], MIDDLE, 2)
                for ku in closed_subsets(unsure) for kc in closed_subsets(confident))
    assert a.rate == pytest.approx(brute, rel=1e-9)
    assert a.num_nodes[1] >= a.num_nodes[0]


def test_trees_without_probabilities_are_kept_and_counted():
    plain = DraftTree.chain([5, 6, 7])
    a = allocate([plain, star([0.9, 0.5]), None], FLAT, per_request_cap=2)
    assert a.trees[0].token_ids.tolist() == [5, 6] and a.trees[2] is None
    assert a.num_nodes.tolist() == [2, 2, 0]
    a = allocate([plain, star([0.9, 0.5])], FLAT, batch_cap=4)
    assert a.num_nodes.tolist() == [3, 1]


def test_with_a_fitted_step_cost_model():
    model = StepCostModel(PiecewiseLinear([1, 2, 4, 8, 16, 32], [0.06, 0.062, 0.065, 0.08, 0.11, 0.17]))
    probs = [0.7, 0.5, 0.3, 0.2, 0.1, 0.08, 0.05, 0.04, 0.03, 0.02, 0.01, 0.01]
    a = allocate([star(probs)], model)
    rates = [(1 + sum(probs[:w])) / model.predict(1 + w) for w in range(len(probs) + 1)]
    assert a.num_nodes.tolist() == [int(np.argmax(rates))]



def test_a_long_requests_draft_rows_pay_the_row_slope_not_its_first_rows():
    """With the context priced per request (its sequence read once) and per row, a draft node of a long request
    costs the row slope: where one slope for every row (their sum) admits nothing at 4,096 positions, the split
    model admits the nodes its rows pay for, and prices the step it admits as the model does."""
    curve = PiecewiseLinear([1, 2, 4, 8, 16, 32], [0.06, 0.062, 0.065, 0.08, 0.11, 0.17])
    split = StepCostModel(curve, per_context=2e-6, reference_context=256, per_request_context=18e-6)
    single = StepCostModel(curve, per_context=2e-5, reference_context=256)
    probs = [0.5, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04]
    row = 4096.0 - 256
    assert allocate([star(probs)], single, row_excess=np.array([row])).total_nodes == 0
    a = allocate([star(probs)], split, row_excess=np.array([row]))
    k = a.total_nodes
    rates = [(1 + sum(probs[:w])) / split.predict(1 + w, 1, (1 + w) * row, request_excess=row)
             for w in range(len(probs) + 1)]
    assert k == int(np.argmax(rates)) > 0
    assert a.seconds == pytest.approx(split.predict(1 + k, 1, (1 + k) * row, request_excess=row))
    # two requests: E_R is both sequences once, whatever rows their trees add
    two = allocate([star(probs), star(probs)], split, row_excess=np.array([row, 0.0]))
    n = int(two.total_nodes)
    assert two.seconds == pytest.approx(split.predict(
        2 + n, 2, row * (1 + two.num_nodes[0]), plain_tokens=2, request_excess=row))


def test_rows_of_long_requests_are_priced_by_their_context():
    """Every row attends to its request's whole sequence: with a context term, the same tree earns fewer nodes on a
    long request than on a short one, and none where a row costs more than its gain can pay."""
    model = StepCostModel(PiecewiseLinear([1, 2, 4, 8, 16, 32], [0.06, 0.062, 0.065, 0.08, 0.11, 0.17]),
                          per_context=2e-5, reference_context=256)
    probs = [0.5, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04]
    widths = {}
    for seq_len in (256, 1024, 4096):
        row = seq_len - 256
        a = allocate([star(probs)], model, row_excess=np.array([row], np.float64))
        rates = [(1 + sum(probs[:w])) / model.predict(1 + w, 1, (1 + w) * row) for w in range(len(probs) + 1)]
        assert a.num_nodes.tolist() == [int(np.argmax(rates))]
        assert a.seconds == pytest.approx(model.predict(1 + a.total_nodes, 1, (1 + a.total_nodes) * row))
        widths[seq_len] = a.total_nodes
    assert widths[256] == allocate([star(probs)], model).total_nodes  # at the curve's context: as without
    assert widths[256] > widths[1024] > widths[4096] == 0
    # two requests, the same tree: the short one's nodes are admitted, the long one's are not
    both = allocate([star(probs), star(probs)], model, row_excess=np.array([0.0, 4096 - 256]))
    assert both.num_nodes[0] > 0 and both.num_nodes[1] == 0
    # candidates go best first by gain per second: the long request's nodes come after the short one's of equal
    # gain, so a budget that pays for only some nodes gives them to the short request
    long_first = allocate([star(probs), star(probs)], model, row_excess=np.array([1024 - 256, 0.0]))
    assert long_first.num_nodes[1] >= long_first.num_nodes[0]
    assert long_first.num_nodes[1] > allocate([star(probs), star(probs)], model, row_excess=np.array(
        [1024 - 256, 1024 - 256])).num_nodes[1]
    # the gate prices a step of the same rows the same way
    gate = DraftGate(model)
    gate.marginal = np.array(probs)
    assert gate.expected_best(1, row_excess=0.0)[0] > gate.expected_best(1, row_excess=4096 - 256)[0]

def test_min_gain_and_overhead_turn_marginal_speculation_off():
    t = star([0.1])
    cost = Curve(lambda x: 0.06 + 0.004 * (x - 1))
    assert allocate([t], cost).num_nodes.tolist() == [1]  # 1.1 / 0.064 > 1 / 0.06
    assert allocate([t], cost, min_gain=0.05).num_nodes.tolist() == [0]
    assert allocate([t], cost, overhead=0.005).num_nodes.tolist() == [0]


def test_the_gate_learns_the_mean_of_each_requests_jth_best_path_probability():
    """A tree without a j-th node counts 0 there; the running mean spans the longer of old and new gains (node_probs
    are float32, hence the tolerance)."""
    gate = DraftGate(STEEP, alpha=0.5)
    gate.record([star([0.9, 0.2]), None, star([0.4])], scale=0.5)
    np.testing.assert_allclose(gate.marginal, [(0.45 + 0.2) / 2, 0.1 / 2], rtol=1e-6)
    gate.record([star([0.8, 0.6, 0.3])])
    np.testing.assert_allclose(gate.marginal, [0.5 * 0.325 + 0.5 * 0.8, 0.5 * 0.05 + 0.5 * 0.6, 0.5 * 0.3],
                               rtol=1e-6)
    gate.record([star([1.0])])
    np.testing.assert_allclose(gate.marginal, [0.5 * 0.5625 + 0.5, 0.5 * 0.325, 0.5 * 0.15], rtol=1e-6)
    gate.record([None])  # nothing drafted: nothing learnt
    np.testing.assert_allclose(gate.marginal, [0.78125, 0.1625, 0.075], rtol=1e-6)


def test_the_gate_shares_a_steps_best_nodes_among_its_requests_as_the_allocator_admits_them():
    """One request with a long match beside three with nothing: the allocator admits the match's nodes first, and the
    gate's profile (the step's gains merged best first, the j-th at j / n of a request's nodes) predicts the rate it
    reaches. A mean of each tree's j-th node, repeated per request, priced it as four trees of a quarter of the
    match."""
    match, nothing = star([0.9] * 8), tree([], [])
    trees = [match, nothing, nothing, nothing]
    gate = DraftGate(MIDDLE)
    gate.record(trees)
    np.testing.assert_allclose(gate.marginal, [0.9, 0.9], rtol=1e-6)
    assert gate.expected_best(4)[0] == pytest.approx(allocate(trees, MIDDLE).rate, rel=1e-6)
    assert gate.expected_best(4)[0] > 4 / float(MIDDLE.predict_many(4, 4))  # it pays, and the gate sees it
    # the requests the drafter was asked for count, trees or not; at most the per-request cap of each tree
    asked = DraftGate(MIDDLE)
    asked.record([match, None, None, None], requests=4, per_request_cap=2)
    np.testing.assert_allclose(asked.marginal, [0.45], rtol=1e-6)
    assert asked.expected_best(4, max_nodes=2)[0] == pytest.approx(
        allocate(trees, MIDDLE, per_request_cap=2).rate, rel=1e-6)
    # any batch of stars (of a size that divides the gate's resolution): the best rate the gate sees for the batch
    # it learnt from is the allocator's, also where fewer nodes than requests pay
    rng = np.random.default_rng(0)
    paying = 0
    for _ in range(40):
        batch = [star(rng.uniform(0.0, 1.0, int(rng.integers(0, 6)))) for _ in range(int(rng.choice([1, 2, 4, 8])))]
        if not any(t.num_nodes for t in batch):
            continue
        learnt = DraftGate(STEEP_FIRST_NODES)
        learnt.record(batch)
        allocation = allocate(batch, STEEP_FIRST_NODES)
        assert max(learnt.expected_best(len(batch))) == pytest.approx(allocation.rate, rel=1e-6)
        paying += 0 < allocation.total_nodes < len(batch)
    assert paying >= 5
    # one request: as before, each tree's j-th best node
    single = DraftGate(MIDDLE)
    single.record([star([0.3, 0.8, 0.5])])
    np.testing.assert_allclose(single.marginal, [0.8, 0.5, 0.3], rtol=1e-6)


def test_the_gates_expected_rate_follows_every_change_of_its_gains():
    gate = DraftGate(STEEP)
    assert gate.expected_best(2)[0] == 0.0  # nothing learnt: no drafting rate
    gate.record([star([0.9, 0.9])])
    first = gate.expected_best(1, max_nodes=2)
    gate.record([star([0.1])])  # worse trees lower the gains it remembers
    second = gate.expected_best(1, max_nodes=2)
    assert second[0] < first[0] and second[1] == first[1]
    gate.marginal = np.array([0.9, 0.9])  # set directly, as a test or a restored state does
    assert gate.expected_best(1, max_nodes=2) == pytest.approx(first)
    flat = DraftGate(FLAT)  # where every node pays: the rate grows with the batch and the cap
    flat.marginal = np.array([0.9, 0.9])
    rates = [flat.expected_best(r, max_nodes=m)[0] for r, m in ((2, 2), (2, 1), (1, 1), (2, 2))]
    assert rates[0] > rates[1] > rates[2] and rates[3] == rates[0]


def test_skipped_steps_reuse_one_prediction_for_a_few_decisions():
    """A gate that keeps skipping on the same requests predicts its candidate steps once every REPRICE_EVERY
    decisions; the drafter's price counts at once, and another batch size, new gains or a draft predict afresh."""
    from vllm_treespec.cost.allocate import REPRICE_EVERY

    class Counting(Curve):
        calls = 0

        def predict_many(self, num_tokens, num_reqs=1, plain_tokens=None):
            self.calls += 1
            return super().predict_many(num_tokens, num_reqs, plain_tokens)

    class Drafter:
        seconds = 0.003  # 5% of MIDDLE's plain step: not free

        def predict(self, x):
            return self.seconds

    curve, drafter = Counting(MIDDLE.fn), Drafter()
    gate = DraftGate(curve, drafter, probe_every=10_000)
    gate.record([star([0.2, 0.1])])  # worth less than MIDDLE's 6 ms a node: it skips
    assert not any(gate.should_draft(4) for _ in range(3 * REPRICE_EVERY))
    assert curve.calls == 3
    assert not gate.should_draft(5) and curve.calls == 4  # another batch size
    gate.marginal = np.array([0.99, 0.99])  # new gains: the next decision is predicted afresh, and they pay
    assert gate.should_draft(5) and curve.calls == 5
    drafter.seconds = 1.0  # a call dearer than anything its trees save: skipped at once, on the same prediction
    assert not gate.should_draft(5) and curve.calls == 6
    drafter.seconds = 0.003
    assert gate.should_draft(5) and curve.calls == 6
    # a prediction goes stale for at most REPRICE_EVERY decisions: a step cost that fell is seen within them
    stale = DraftGate(curve, None, probe_every=10_000)
    stale.record([star([0.2])])
    assert not stale.should_draft(5)
    curve.fn = FLAT.fn
    decisions = [stale.should_draft(5) for _ in range(REPRICE_EVERY)]
    assert decisions == [False] * (REPRICE_EVERY - 1) + [True]


def test_draft_gate_runs_the_drafter_only_when_it_pays():
    trees = [star([0.8, 0.4, 0.2])]
    gate = DraftGate(FLAT, drafter_cost=None, probe_every=3)
    assert gate.should_draft(1)  # no history
    gate.record(trees)
    assert gate.should_draft(1)
    steep = DraftGate(STEEP, probe_every=3, probe_share=1.0)  # every skipped step buys a node's verification
    steep.record(trees)
    assert [steep.should_draft(1) for _ in range(5)] == [False, False, False, True, False]
    # that probe's trees did not pay either: the next probe waits twice as long, and so on up to max_probe_every
    assert steep.interval == 6 and [steep.should_draft(1) for _ in range(6)] == [False] * 5 + [True]
    for _ in range(10):
        while not steep.should_draft(1):
            pass
    assert steep.interval == steep.max_probe_every == 128
    # a decision to draft resets it
    steep.cost = FLAT
    assert steep.should_draft(1) and not steep.probing and steep.interval == 3

    class Drafter:
        def __init__(self, seconds):
            self.seconds = seconds

        def predict(self, x):
            return self.seconds

    cheap, dear = DraftGate(MIDDLE, Drafter(0.001)), DraftGate(MIDDLE, Drafter(0.2))
    cheap.record(trees)
    dear.record(trees)
    assert cheap.should_draft(2) and not dear.should_draft(2)
    # one node per request at most: 0.8 each for two requests, a step of 3 or 4 tokens plus the drafter's 1 ms
    best, plain = cheap.expected_best(2, max_nodes=1, drafter_seconds=0.001)
    assert best == pytest.approx(max((2 + 0.8) / (0.072 + 0.001), (2 + 1.6) / (0.078 + 0.001)))
    assert plain == pytest.approx(2 / 0.066)


def test_a_gate_that_forgets_drafts_next_and_learns_the_new_trees_alone():
    """forget() (a batch of new requests): the wait for the next probe and what the old trees were worth go; the next
    decisions draft (not probes: their trees are priced as any) until trees are recorded, which are then the gate's
    whole knowledge; what drafting saved at that load and the probes' allowance stay."""
    gate = DraftGate(STEEP, probe_every=3, probe_share=1.0)
    gate.record([star([0.2, 0.1])])
    while gate.interval < 12:  # probes that did not pay: the wait doubles
        gate.should_draft(1)
    gate.surplus_by_load[gate._load] = 0.004
    assert not gate.should_draft(1)
    allowance = gate.allowance
    gate.forget()
    assert gate.gains is None and gate.interval == 3 and gate.skipped == 0
    assert gate.surplus == 0.004 and gate.allowance == allowance
    assert gate.should_draft(1) and not gate.probing
    gate.record([None])  # no trees: nothing learnt, it drafts again
    assert gate.should_draft(1) and not gate.probing and gate.allowance == allowance
    good = [star([0.99, 0.98, 0.97])]
    gate.record(good)
    learnt = DraftGate(STEEP)
    learnt.record(good)
    np.testing.assert_array_equal(gate.gains, learnt.gains)  # nothing of the old trees' worth is left in them


def test_a_drafter_cheaper_than_its_share_of_a_step_drafts_every_step():
    """A drafter whose measured call costs at most ``free_share`` of a plain step is called on every step, even where
    its recent trees did not pay (the allocation admits none of their nodes then, so the step runs plain); a dearer
    one, or one not measured yet whose trees do not pay, waits for its probes."""

    class Drafter:
        def __init__(self, seconds):
            self.seconds = seconds

        def predict(self, x):
            return self.seconds

    trees = [star([0.5, 0.4, 0.3, 0.2])]  # nothing here pays on STEEP (a 60 ms token)
    cheap = DraftGate(STEEP, Drafter(0.0005), probe_every=4)  # 0.5 ms: under 2% of a 60 ms plain step
    dear = DraftGate(STEEP, Drafter(0.0015), probe_every=4, probe_share=1.0)
    unmeasured = DraftGate(STEEP, Drafter(None), probe_every=4, probe_share=1.0)
    for gate in (cheap, dear, unmeasured):
        gate.record(trees)
    assert [cheap.should_draft(1) for _ in range(10)] == [True] * 10 and not cheap.probing
    assert allocate(trees, STEEP).total_nodes == 0
    assert [dear.should_draft(1) for _ in range(5)] == [False] * 4 + [True] and dear.probing
    assert [unmeasured.should_draft(1) for _ in range(5)] == [False] * 4 + [True]
    # the share is relative to the step: at 8 requests the same call is a smaller part of a longer step
    batch = DraftGate(STEEP, Drafter(0.0015), probe_every=4)
    batch.record(trees * 8)
    assert batch.should_draft(8) and not batch.probing


def test_a_drafter_whose_rare_matches_pay_for_its_calls_drafts_every_step():
    """A drafter dearer than ``free_share`` whose trees are worthless on most steps and a sure match on some (a
    retrieval hit) keeps drafting while what its allocations saved, averaged over its calls, beats its call; the
    mean of its trees' gains says the opposite. Where matches are too rare for the call, it waits for probes."""

    class Drafter:
        def predict(self, x):
            return 0.003  # 5% of MIDDLE's 60 ms plain step: not free

    match, miss = [star([1.0, 1.0, 1.0])], [star([0.05])]

    def run(gate, every, steps):
        decisions = []
        for step in range(steps):
            decisions.append(gate.should_draft(1))
            if decisions[-1]:
                hit = step % every == 0
                trees = match if hit else miss
                gate.record(trees)
                gate.allocated(allocate(trees, MIDDLE))
                gate.verified(3 if hit else None)  # the match is accepted whole; a miss verifies nothing
        return decisions

    frequent = DraftGate(MIDDLE, Drafter(), probe_every=4)
    decisions = run(frequent, every=10, steps=200)
    # a match saves 3 tokens (180 ms) for 18 ms: 16 ms a call averaged over ten calls, against the call's 3 ms
    assert all(decisions) and frequent.surplus > 0.003
    best, plain = frequent.expected_best(1, drafter_seconds=0.003)
    assert best < plain  # the averaged gains alone would have kept it off
    rare = DraftGate(MIDDLE, Drafter(), probe_every=4)
    decisions = run(rare, every=400, steps=400)
    # the one match keeps it drafting while its saving lasts (a dozen calls at surplus_alpha 0.05), then it waits
    assert all(decisions[:10]) and decisions[100:].count(True) <= 4 and rare.surplus < 0.003
    # a call that proposed nothing saved nothing
    rare.allocated(None)
    assert rare.surplus < 0.003


def test_what_drafting_saved_is_learnt_per_load():
    """A saving learnt at 8 requests does not keep the drafter on at 16, where its trees do not pay: the surplus is
    kept per power-of-two load bucket, and each bucket's starts from 0."""

    class Drafter:
        def predict(self, x):
            return 0.004  # above free_share of a plain step at 8 and at 16 requests

    gate = DraftGate(MIDDLE, Drafter(), probe_every=1000)
    gate.record([star([0.05])])  # trees worth nothing at their prices
    for _ in range(40):  # at 8 requests every allocation was a sure match: it saved 3 tokens of plain decoding
        gate.should_draft(8)
        gate.allocated(allocate([star([1.0, 1.0, 1.0])], MIDDLE))
        gate.verified(3)
    saved_at_8 = gate.surplus
    assert saved_at_8 > 0.004 and gate.should_draft(8)  # it saved more than its call costs
    best, plain = gate.expected_best(16, drafter_seconds=0.004)
    assert best < plain
    assert not gate.should_draft(16) and gate.surplus == 0.0  # nothing learnt at 16: plain decoding
    assert not gate.should_draft(12)  # the same bucket
    assert gate.should_draft(7) and gate.surplus == saved_at_8  # back at 5-8 requests, its saving still counts
    assert gate.surplus_by_load == {8: saved_at_8}


def test_shared_seconds_price_the_whole_drafting_step_but_neither_a_probe_nor_a_free_call():
    """``shared_seconds`` (what a drafting step costs besides this drafter: graft's call without its head, the tree
    work) is part of drafting's step against plain decoding; but a probe's price and the share that makes a drafter
    free are the drafter's own call, which is all that drafting with it adds to a step that drafts anyway."""

    class Drafter:
        def __init__(self, seconds):
            self.seconds = seconds

        def predict(self, x):
            return self.seconds

    gate = DraftGate(MIDDLE, Drafter(0.003))  # 5% of MIDDLE's plain step: not free
    gate.record([star([0.9, 0.9])])  # 2.8 tokens in ~75 ms against a 60 ms token
    assert gate.should_draft(1)
    with_rest = gate.last_rates[0]
    assert not gate.should_draft(1, shared_seconds=0.15)  # ...not with 150 ms more of the step
    assert gate.last_rates[0] < gate.last_rates[1] < with_rest
    free = DraftGate(MIDDLE, Drafter(0.001))  # under 2% of the plain step: drafts whatever the rest costs
    free.record([star([0.9, 0.9])])
    assert free.should_draft(1, shared_seconds=0.15) and free.last_rates[0] < free.last_rates[1]

    def first_probe(shared_seconds):
        probing = DraftGate(MIDDLE, Drafter(0.003), probe_every=4)
        probing.record([star([0.05])])  # worth nothing: every step skips until a probe
        for step in range(200):
            if probing.should_draft(1, shared_seconds=shared_seconds):
                assert probing.probing
                return step
        return None

    assert first_probe(0.0) == first_probe(0.15)


def test_a_catch_up_is_priced_with_the_call_and_paid_out_of_a_probes_allowance():
    """``extra_seconds`` (a head's catch-up on the rows that steps without drafts left it) is part of drafting's
    price: trees that pay for the call alone do not pay for the call and a long catch-up. A probe pays it, per
    probed request, out of the allowance the skipped steps set aside: after a long spell it waits until they have
    set aside enough, instead of spending many times its share."""

    class Drafter:
        def predict(self, x):
            return 0.003  # 5% of MIDDLE's plain step: not free

    sure = DraftGate(MIDDLE, Drafter())
    sure.record([star([0.9, 0.9])])
    assert sure.should_draft(1) and not sure.should_draft(1, extra_seconds=0.2)
    assert sure.last_rates[0] < sure.last_rates[1]

    def first_probe(extra_seconds):
        gate = DraftGate(MIDDLE, Drafter(), probe_every=4)
        gate.record([star([0.05])])  # worth nothing at MIDDLE's 6 ms a node: every step skips until a probe
        for step in range(200):
            if gate.should_draft(1, extra_seconds=extra_seconds):
                assert gate.probing and gate.probe_requests == 1
                return step
        return None

    # 1% of a 60 ms plain step is set aside per skipped step: a node's 6 ms and the call's 3 ms after 15 steps,
    # with a 30 ms catch-up after 65
    assert 14 <= first_probe(0.0) <= 16
    assert 64 <= first_probe(0.030) <= 66


def test_the_gate_prices_trees_at_the_verifiers_expectation_correction():
    """Trees recorded with ``scale`` (the verifier's accepted-over-expected correction) are worth that much less: a
    drafter that pays on its raw numbers does not when the verifier will discount them."""
    trees = [star([0.9, 0.6, 0.3])]
    raw, scaled = DraftGate(MIDDLE), DraftGate(MIDDLE)
    raw.record(trees)
    scaled.record(trees, scale=0.1)
    assert scaled.marginal == pytest.approx(raw.marginal * 0.1)
    assert raw.should_draft(1) and not scaled.should_draft(1)  # a node pays its 6 ms above 0.1 of a 60 ms step
    capped = DraftGate(MIDDLE)
    capped.record(trees, scale=4.0)
    assert capped.marginal.max() == 1.0


def test_what_an_allocation_saved_is_measured_from_what_the_target_accepted():
    """The surplus counts the tokens an allocation's step committed, not the ones it expected: an allocation the
    calibration overrated (2 expected, none accepted) cost its nodes and saved nothing, and the surplus says so; a
    probe's saving is counted with the tree work it was priced without."""
    trees = [star([1.0, 1.0])]
    sure, overrated, probe = DraftGate(MIDDLE), DraftGate(MIDDLE), DraftGate(MIDDLE)
    allocation = allocate(trees, MIDDLE)
    assert allocation.admitted_gain == pytest.approx(2.0) and allocation.total_nodes == 2
    for gate, accepted, extra in ((sure, 2, 0.0), (overrated, 0, 0.0), (probe, 1, 0.01)):
        gate.allocated(allocation, extra_seconds=extra)
        assert gate.surplus == 0.0  # learnt from the outcome, not the expectation
        gate.verified(accepted)
    assert sure.surplus == pytest.approx(0.05 * (3 * 0.060 - 0.072))  # surplus_alpha of it, from 0
    assert overrated.surplus == pytest.approx(0.05 * (0.060 - 0.072)) and overrated.surplus < 0
    assert probe.surplus == pytest.approx(0.05 * (2 * 0.060 - 0.072 - 0.01))
    sure.verified(2)  # an outcome counts once
    assert sure.surplus == pytest.approx(0.05 * (3 * 0.060 - 0.072))


def test_a_probe_verifies_at_most_its_share_of_the_skipped_steps():
    """Where drafting does not pay, a probe may add to its step no more than ``probe_share`` of the predicted time of
    the steps skipped since the last probe, the drafter's call included; it waits past its schedule until that pays
    for the call and one node, then explores: it verifies as many nodes as the rest of the allowance pays for, best
    first, whether they pay at their prices or not."""

    class Drafter:
        def predict(self, x):
            return 0.012 * x  # the drafter's call, per request it drafts for: paid out of the allowance

    trees = [star([0.5, 0.4, 0.3, 0.2])]  # on MIDDLE (6 ms a node over a 60 ms step) 0.5 alone would pay
    gate = DraftGate(MIDDLE, Drafter(), probe_every=4, probe_share=0.01)
    gate.record([star([0.05])])  # what the trees were worth lately: nothing that pays
    skipped = 0
    while not gate.should_draft(1):
        skipped += 1
    # due after 4 skipped steps, the probe waited until 1% of the skipped steps' 60 ms paid for a 6 ms node and
    # the 12 ms call; what is left of the allowance verifies
    assert skipped == 30 and gate.probing and gate.allowance == 0.0 and gate.probe_requests == 1
    assert gate.probe_seconds == pytest.approx(30 * 0.01 * 0.060 - 0.012)
    assert allocate(trees, MIDDLE, max_extra_seconds=gate.probe_seconds, explore=True).total_nodes == 1
    # exploring: the allowance's nodes, best first, paying or not (a 0.05 node does not pay for 6 ms)
    assert allocate([star([0.05, 0.04])], MIDDLE, max_extra_seconds=0.013).total_nodes == 0
    assert allocate([star([0.05, 0.04])], MIDDLE, max_extra_seconds=0.013, explore=True).total_nodes == 2
    assert allocate(trees, MIDDLE, max_extra_seconds=0.024, explore=True).total_nodes == 4
    assert allocate(trees, MIDDLE, max_extra_seconds=0.1, explore=True).total_nodes == 4  # no more than there are
    # the probe learnt nothing that pays: the next one is due twice as late, and waits for its node just the same
    skipped = 0
    while not gate.should_draft(1):
        skipped += 1
    assert skipped == 30 and gate.interval == 8
    for _ in range(2):  # 16, 32
        while not gate.should_draft(1):
            pass
    skipped = 0
    while not gate.should_draft(1):
        skipped += 1
    assert skipped == gate.interval == 64 and gate.probe_seconds == pytest.approx(64 * 0.01 * 0.060 - 0.012)
    # at 4 requests the same 38.4 ms pays for two requests' calls and nodes (36 ms), not three (54 ms)
    busy = DraftGate(MIDDLE, Drafter(), probe_every=4, probe_share=0.01)
    busy.record([star([0.05])])
    busy.allowance, busy.skipped = 0.0384, 64
    assert busy.should_draft(4) and busy.probe_requests == 2
    assert busy.probe_seconds == pytest.approx(0.0384 - 0.024)
    # where one node costs a whole 60 ms step (STEEP) the first probe comes after 120 skipped steps (with its call)
    steep = DraftGate(STEEP, Drafter(), probe_every=4, probe_share=0.01)
    steep.record([star([0.05])])
    skipped = 0
    while not steep.should_draft(1):
        skipped += 1
    assert skipped == 120 and allocate(trees, STEEP, max_extra_seconds=steep.probe_seconds, explore=True
                                       ).total_nodes == 1
    # drafting that pays needs no probe and is not capped
    flat = DraftGate(FLAT, Drafter(), probe_share=0.01)
    flat.record(trees)
    assert flat.should_draft(1) and not flat.probing and flat.probe_seconds is None


def test_step_budget_trims_scored_trees_and_learns_step_times(monkeypatch):
    from vllm_treespec.cost.budget import StepBudget
    from vllm_treespec.cost.model import FORMAT_VERSION, CostKey, CostRecord, StepSample

    samples = [StepSample(t, 1, 0.06 + 0.006 * (t - 1)) for t in (1, 2, 4, 8, 16, 32)]
    record = CostRecord(format_version=FORMAT_VERSION, key=CostKey("m", "float32", "cpu", "0", 1), samples=samples,
                        drafters={"Drafter": [StepSample(1, 1, 0.001), StepSample(2, 2, 0.002)]})
    budget = StepBudget.from_record(record, max_nodes=4, drafter="Drafter")
    assert budget.gate.drafter_cost.predict(2) == pytest.approx(0.002)
    unscored = DraftTree.chain([1, 2, 3])
    assert budget.admit([unscored, None]) == [unscored, None] and budget.stats["allocations"] == 0
    probs = [0.5, 0.2, 0.12, 0.08, 0.05, 0.03]
    trees = budget.admit([star(probs)])
    rates = [(1 + sum(probs[:w])) / (0.06 + 0.006 * w) for w in range(5)]  # capped at max_nodes = 4
    assert trees[0].num_nodes == int(np.argmax(rates))
    assert budget.stats["proposed_nodes"] == 4 and budget.stats["admitted_nodes"] == trees[0].num_nodes
    assert budget.should_draft(1)
    # step times observed: the model follows a machine twice as slow
    clock = iter(np.arange(0, 1000, 0.5).tolist())
    monkeypatch.setattr("vllm_treespec.cost.budget.time.perf_counter", lambda: next(clock))
    before = budget.cost.predict(1)
    for _ in range(40):
        budget.step_started(1, 1)
        budget.step_finished()  # 0.5 s per step
    assert budget.cost.predict(1) == pytest.approx(0.5, rel=0.05) and before == pytest.approx(0.06)
    budget.step_finished()  # without a start: ignored
    assert budget.stats["observed_steps"] == 40


def test_step_budget_for_a_runner_that_cannot_be_measured_is_none():
    from vllm_treespec.cost.budget import StepBudget

    assert StepBudget.for_runner(object(), max_nodes=4) is None


def test_a_probe_s_allowance_is_never_negative_and_the_plain_step_is_always_affordable():
    """A fitted curve may predict a step with one more row as cheaper than the plain step (between its points, or
    with a context term); a probe priced on it once got a negative allowance, and a step whose trees were all empty
    then found no affordable prefix at all, not even the plain step: the served engine died (IndexError). The
    allowance is floored at zero and the plain step is affordable whatever the allowance."""

    class Drafter:
        def predict(self, x):
            return 0.020 * x  # dear enough that drafting does not pay: the gate probes

    dips = Curve(lambda t: np.where(t > 1, 0.050, 0.060))  # one more row predicted 10 ms cheaper
    gate = DraftGate(dips, Drafter(), probe_every=1, probe_share=0.01)
    gate.record([star([0.01])])  # nothing that pays
    while not gate.should_draft(1):
        pass
    assert gate.probing and gate.probe_seconds is not None and gate.probe_seconds >= 0.0
    empty = DraftTree(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32))
    for allowance in (gate.probe_seconds, -0.010):
        for explore in (True, False):
            nothing = allocate([empty, None], MIDDLE, max_extra_seconds=allowance, explore=explore)
            assert nothing.total_nodes == 0 and nothing.trees == [None, None]
    assert allocate([star([0.5, 0.4])], MIDDLE, max_extra_seconds=-0.010, explore=True).total_nodes == 0


def test_a_row_never_makes_a_step_cheaper_for_the_gate_or_the_allocator():
    """Where the predicted step dips as rows are added (short requests' negative context terms on a flat stretch of
    the curve), neither the gate nor the allocator sees a step cheaper than the plain one: the dip is priced flat,
    as on a flat curve at the plain step's time, never below it."""
    dips = Curve(lambda t: 0.060 - 0.002 * (t - 1))  # every row 2 ms cheaper: nonsense a fit can produce locally
    flat = Curve(lambda t: np.full_like(t, 0.060))
    trees = [star([0.3, 0.2, 0.1])]
    on_dips, on_flat = allocate(trees, dips), allocate(trees, flat)
    assert on_dips.seconds == pytest.approx(0.060) and on_dips.rate == pytest.approx(on_flat.rate)  # before: 0.054 s
    gates = []
    for curve in (dips, flat):
        gate = DraftGate(curve, None)
        gate.record(trees)
        gates.append(gate._rates(1, None, None, 0.0, None))
    assert gates[0] == pytest.approx(gates[1])  # (best, plain): before, the dip raised the best rate by 11%


def test_steps_timed_slow_at_a_few_drafts_do_not_price_every_larger_tree_as_dear():
    """A served engine's warm-up ran while a neighbouring server still polled: its first verifying steps of 2-7 tokens
    read ~2x their curve and taught the draft correction there; its later verifying steps were all of 33 tokens (the
    gate's probes), at 0.8x. With prices made monotone by a running maximum, a tree of any size cost at least the
    2-token step's inflated price, so the gate never drafted again and no small step was timed to correct it. Prices
    are monotone by trusting the cheaper of two predictions: 1 draft costs at most what 32 do."""
    curve = PiecewiseLinear([1, 2, 4, 8, 16, 32, 64], [0.028, 0.030, 0.024, 0.030, 0.036, 0.043, 0.07])
    model = StepCostModel(curve)
    for tokens, ratio in ((4, 2.0), (2, 2.2), (7, 1.9), (4, 2.0)):  # the contended warm-up: slow steps, few drafts
        model.observe(tokens, 1, float(curve(tokens)) * ratio, drafts=tokens - 1)
    for _ in range(40):
        model.observe(1, 1, 0.024)  # plain steps at one request
        model.observe(33, 1, float(curve(33)) * 0.8, drafts=32)  # the probes: large trees, faster than the curve
    raw = model.predict_many(np.arange(1, 34, dtype=np.float64), 1, plain_tokens=1)
    assert raw[1] > raw[32] > raw[0]  # the trap's shape: one draft priced dearer than 32

    trees = [star([0.4, 0.2, 0.1] + [0.02] * 29)]  # 1.28 accepted drafts expected of 32 nodes: pay at 35 ms, not at 57
    allocation = allocate(trees, model)
    assert allocation.total_nodes > 0 and allocation.seconds <= raw[32] + 1e-12  # before: no node admitted
    gate = DraftGate(model, None)
    gate.record(trees)
    best, plain = gate._rates(1, 32, None, 0.0, None)
    assert best > plain  # before: every drafting step priced at least raw[1], and the gate skipped
    assert gate.should_draft(1, 32)
