"""scripts/replay_matches.py on made-up outputs: what it counts, by match length, is what the outputs repeat."""

from __future__ import annotations

import numpy as np
from script_helpers import load_script

from vllm_treespec.retrieval import RetrievedTree


def _script():
    return load_script("replay_matches")


def test_walk_counts_only_reached_nodes():
    script = _script()
    # root children 5 and 6; 5's child 7, 6's child 8; the output continues 5 7 9
    tree = RetrievedTree(np.array([5, 6, 7, 8]), np.array([-1, -1, 0, 1]), np.ones(4, np.float32))
    accepted, reached, depths = script.walk(tree, [5, 7, 9])
    assert accepted.tolist() == [True, False, True, False]
    assert reached.tolist() == [True, True, True, False] and depths.tolist() == [1, 1, 2, 2]


def test_a_long_repeat_is_accepted_after_long_matches():
    script = _script()
    loop = list(range(100, 112))
    # the output repeats a 12-token loop three times: once the loop is in the context, matches grow long and every
    # retrieved continuation of the loop is accepted
    nodes, paths = script.replay([{"prompt": [1, 2, 3], "output": loop * 3}])
    long_class = len(script.MATCH_CLASSES) - 1
    accepted, reached = nodes[("suffix", long_class, 1, True)]
    assert reached > 0 and accepted == reached
    assert np.mean(paths[("suffix", long_class)]) > 5
    assert "suffix" in script.report(nodes, paths)


def test_vllm_ngram_drafts_after_the_earliest_longest_match():
    script = _script()
    # the 2-gram "1 2" ends the context and occurs twice before it: vLLM drafts what followed its first occurrence
    assert script.vllm_ngram(np.array([1, 2, 7, 8, 1, 2, 9, 1, 2]), 3) == [7, 8, 1]
    assert script.vllm_ngram(np.array([1, 2, 3, 4]), 5) == []  # nothing to match


def test_best_chain_follows_the_most_probable_child():
    script = _script()
    tree = RetrievedTree(np.array([5, 6, 7, 8]), np.array([-1, -1, 1, 1]), np.array([.3, .7, .4, .6], np.float32))
    assert script.best_chain(tree, 5) == [6, 8] and script.best_chain(tree, 1) == [6]


def test_policies_on_a_repeated_loop_decode_in_fewer_steps_than_plain_decoding():
    script = _script()
    loop = list(range(100, 112))
    results = script.replay_policies([{"prompt": [1, 2, 3], "output": loop * 4}])
    assert set(results) == set(script.POLICIES)
    ngram_tokens, ngram_nodes, ngram_share = results["vLLM ngram, k=5"]
    # once the loop is in the context, every ngram draft of 5 is accepted: more than 1 token a step, at most 6
    assert 1.0 < ngram_tokens <= 6.0 and 0 < ngram_share <= 1 and ngram_nodes <= 5
    # a chain of up to 16 retrieved tokens commits more per step than one of up to 5, trees at least as much
    assert results["suffix chain, <=16"][0] > results["suffix chain, <=5"][0]
    assert results["suffix + n-gram trees, 32 each"][0] >= results["suffix tree, 32"][0] - 1e-9
    assert "vLLM ngram" in script.report_policies(results)


def test_hindsight_verifies_only_what_is_accepted_and_is_the_fastest_policy():
    script = _script()
    loop = list(range(100, 112))
    # a forward costs 10 ms plus 1 ms a row: verifying fewer nodes for the same tokens is faster
    results = script.replay_policies([{"prompt": [1, 2, 3], "output": loop * 4}],
                                     step_seconds=lambda tokens: 0.01 + 0.001 * tokens)
    hindsight, trees = results["hindsight: accepted path only"], results["suffix + n-gram trees, 32 each"]
    assert hindsight[0] == trees[0] and hindsight[1] < trees[1]  # the same path, none of the rejected nodes
    assert all(len(r) == 4 for r in results.values())
    assert hindsight[3] == max(r[3] for r in results.values())
    table = script.report_policies(results)
    assert "vs ngram" in table and "1.00x" in table


class _LinearCost:
    """A step-cost curve: a plain step takes ``base`` seconds, each draft row ``per_row`` more."""

    def __init__(self, base: float, per_row: float) -> None:
        self.base, self.per_row = base, per_row

    def predict_many(self, num_tokens, num_reqs=1, excess=0.0, plain_tokens=None, request_excess=None):
        return self.base + self.per_row * (np.asarray(num_tokens, np.float64) - 1)

    def predict(self, num_tokens, num_reqs=1):
        return float(self.predict_many(num_tokens, num_reqs))


def test_the_budget_policy_verifies_what_is_free_and_nothing_that_costs_more_than_it_can_yield():
    script = _script()
    loop = list(range(100, 112))
    records = [{"prompt": [1, 2, 3], "output": loop * 4}]
    everything = script.replay_policies(records)["suffix + n-gram trees, 32 each"]
    free = script.replay_priced(records, _LinearCost(0.01, 0.0))
    # rows cost nothing: every proposal is verified whole, up to the cap, so it commits what the trees do
    assert free[2] == everything[2] and free[0] == everything[0]
    # a row costs ten plain steps: no draft can pay for itself, so nothing is verified
    dear = script.replay_priced(records, _LinearCost(0.001, 0.01))
    assert dear[:3] == (1.0, 0.0, 0.0) and abs(dear[3] - 1 / 0.001) < 1e-6


def test_the_budget_policy_learns_a_repeated_loop_and_beats_plain_decoding():
    script = _script()
    loop = list(range(100, 112))
    records = [{"prompt": [1, 2, 3], "output": loop * 4}]
    cost = _LinearCost(0.01, 0.001)
    for by_match_length in (False, True):
        breakdown = {}
        tokens, nodes, share, rate = script.replay_priced(records, cost, by_match_length, breakdown=breakdown)
        # the loop's later passes are accepted whole: more than a token a step, at a better rate than plain steps'
        assert tokens > 2.0 and 0 < share < 1 and rate > 1 / cost.predict(1)
        # per match class: the budget accepts no more than the trees held, and the loop's repeats match long
        steps, held, accepted, admitted = (sum(cell[j] for cell in breakdown.values()) for j in range(4))
        assert accepted <= held and accepted <= admitted and max(breakdown) == script.MATCH_CLASSES[-1]
        assert 0 < steps <= round(len(records[0]["output"]) / tokens)  # steps with a match, of all steps
        assert "match" in script.report_breakdowns({"graft's budget": breakdown})
        # the budget cuts the trees to the nodes that pay: fewer than all both sources propose
    assert nodes < script.replay_policies(records)["suffix + n-gram trees, 32 each"][1]


def test_in_sample_rates_price_a_repeated_loop_as_the_outputs_accepted_it():
    script = _script()
    loop = list(range(100, 112))
    records = [{"prompt": [1, 2, 3], "output": loop * 4}]
    rates = script.in_sample_rates(records)
    assert rates and all(0 < r < 1 for r in rates.values())
    # the suffix source's longest match class: the loop's repeats, accepted wherever the target reached them
    long_suffix = len(script.MATCH_CLASSES) - 1
    assert min(r for (source, _, _), r in rates.items() if source == long_suffix) > 0.9
    cost = _LinearCost(0.01, 0.001)
    tokens, nodes, share, rate = script.replay_priced(records, cost, rates=rates)
    assert tokens > 2.0 and rate > 1 / cost.predict(1)


def test_a_corpus_datastore_lets_the_suffix_source_draft_what_the_request_never_held(tmp_path):
    script = _script()
    from vllm_treespec.retrieval import load_datastore
    from vllm_treespec.retrieval.datastore import build_from_token_documents

    answer = list(range(200, 240))  # nothing in the prompt or the output repeats: only a corpus can predict it
    record = {"prompt": [1, 2, 3], "output": answer}
    path = tmp_path / "corpus.tsds"
    build_from_token_documents([np.array([7, 8, 9] + answer, np.int32)], path, vocab_size=1000, tokenizer="made-up")
    corpus = load_datastore(path).automaton
    alone, with_corpus = script.replay_policies([record]), script.replay_policies([record], corpus=corpus)
    assert alone["suffix chain, <=5"][0] == 1.0  # one token a step: nothing to retrieve
    assert with_corpus["suffix chain, <=5"][0] > 3.0  # the corpus's copy of the answer is matched and drafted
    assert with_corpus["vLLM ngram, k=5"] == alone["vLLM ngram, k=5"]  # vLLM's matcher never sees a corpus
    nodes, _ = script.replay([record], corpus)
    assert sum(accepted for (source, *_), (accepted, _) in nodes.items() if source == "suffix") > 20
