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
