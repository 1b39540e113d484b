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
