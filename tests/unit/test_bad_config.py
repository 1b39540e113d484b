"""Bad speculative configs fail at translation (startup) with one message that names the field (no engine).

The same table runs against real ``serve`` startups in ``scripts/bad_input.py``; ``test_server_reliability.py``
starts a few of them for real in CI.
"""

from __future__ import annotations

import os

import pytest

from vllm_treespec.config import TreeSpecConfigError, translate

SUFFIX_PATH = "vllm_treespec.proposers.suffix_tree.SuffixTreeProposer"
#: an existing file that is not a datastore (this one): rejected from its header at translation, before any engine
NOT_A_DATASTORE = os.path.abspath(__file__)

#: (id, speculative config, substrings the message must contain: the field and what is wrong)
BAD_CONFIGS = [
    ("method-type", {"method": 123}, ["method", "must be a string"]),
    ("method-unknown", {"method": "no_such_method"}, ["no_such_method", "not a known method", "suffix_tree"]),
    ("method-dotted-missing", {"method": "no_such_pkg.Proposer"}, ["no_such_pkg.Proposer", "cannot import"]),
    ("method-dotted-not-proposer", {"method": "collections.OrderedDict"}, ["collections.OrderedDict",
                                                                          "not a subclass"]),
    ("budget-zero", {"method": "suffix_tree", "num_speculative_tokens": 0}, ["num_speculative_tokens", "[1, 128]"]),
    ("budget-too-big", {"method": "suffix_tree", "num_speculative_tokens": 129}, ["num_speculative_tokens"]),
    ("budget-negative", {"method": "ngram_tree", "num_speculative_tokens": -4}, ["num_speculative_tokens"]),
    ("budget-string", {"method": "suffix_tree", "num_speculative_tokens": "8"}, ["num_speculative_tokens"]),
    ("budget-bool", {"method": "suffix_tree", "num_speculative_tokens": True}, ["num_speculative_tokens"]),
    ("budget-float", {"method": "static_tree", "num_speculative_tokens": 4.0}, ["num_speculative_tokens"]),
    ("budget-null", {"method": "suffix_tree", "num_speculative_tokens": None}, ["num_speculative_tokens"]),
    ("suffix-unknown-key", {"method": "suffix_tree", "max_nodez": 3}, ["max_nodez", "unknown key", "max_nodes"]),
    ("suffix-max-depth-zero", {"method": "suffix_tree", "max_depth": 0}, ["max_depth", ">= 1"]),
    ("suffix-max-depth-dashed", {"method": "suffix_tree", "max-depth": -2}, ["max_depth", ">= 1"]),
    ("suffix-max-depth-type", {"method": "suffix_tree", "max_depth": "deep"}, ["max_depth", "Expected `int`"]),
    ("suffix-min-token-prob-high", {"method": "suffix_tree", "min_token_prob": 1.5}, ["min_token_prob", "[0, 1]"]),
    ("suffix-min-token-prob-neg", {"method": "suffix_tree", "min_token_prob": -0.1}, ["min_token_prob"]),
    ("suffix-min-confidence-nan", {"method": "suffix_tree", "min_confidence": float("nan")}, ["min_confidence"]),
    ("suffix-min-match-len-zero", {"method": "suffix_tree", "min_match_len": 0}, ["min_match_len"]),
    ("suffix-spec-factor-zero", {"method": "suffix_tree", "max_spec_factor": 0}, ["max_spec_factor", "> 0"]),
    ("suffix-match-window-neg", {"method": "suffix_tree", "match_window": -1}, ["match_window"]),
    ("suffix-use-global-type", {"method": "suffix_tree", "use_global": "yes"}, ["use_global", "Expected `bool`"]),
    ("suffix-global-max-tokens", {"method": "suffix_tree", "global_max_tokens": 1}, ["global_max_tokens"]),
    ("suffix-max-cached-zero", {"method": "suffix_tree", "max_cached_requests": 0}, ["max_cached_requests"]),
    ("suffix-max-nodes-zero", {"method": "suffix_tree", "max_nodes": 0}, ["max_nodes"]),
    ("suffix-datastore-missing", {"method": "suffix_tree", "datastore": "/nonexistent/corpus.vtds"},
     ["datastore", "no such file"]),
    ("suffix-datastore-type", {"method": "suffix_tree", "datastore": 5}, ["datastore", "Expected `str | null`"]),
    ("suffix-datastore-not-a-datastore", {"method": "suffix_tree", "datastore": NOT_A_DATASTORE},
     ["datastore", "not a vllm-treespec datastore"]),
    ("graft-datastore-not-a-datastore", {"method": "graft", "datastore": NOT_A_DATASTORE},
     ["graft option 'datastore'", "not a vllm-treespec datastore"]),
    ("suffix-by-class-path", {"method": "custom_class", "model": SUFFIX_PATH, "max_depth": 0}, ["max_depth"]),
    ("ngram-min-n-zero", {"method": "ngram_tree", "min_n": 0}, ["min_n", ">= 1"]),
    ("ngram-max-n-below-min-n", {"method": "ngram_tree", "min_n": 3, "max_n": 2}, ["max_n", "min_n"]),
    ("ngram-max-occurrences-type", {"method": "ngram_tree", "max_occurrences": 2.5}, ["max_occurrences"]),
    ("ngram-max-tokens-per-request", {"method": "ngram_tree", "max_tokens_per_request": 1},
     ["max_tokens_per_request"]),
    ("ngram-unknown-key", {"method": "ngram_tree", "prompt_lookup_maxx": 4}, ["prompt_lookup_maxx", "unknown"]),
    ("static-branches-zero", {"method": "static_tree", "branches": 0}, ["branches", ">= 1"]),
    ("static-depth-type", {"method": "static_tree", "depth": "4"}, ["depth", "Expected `int`"]),
    ("static-branches-list", {"method": "static_tree", "branches": [1]}, ["branches"]),
    ("static-unknown-key", {"method": "static_tree", "width": 2}, ["width", "unknown"]),
    ("eagle-checkpoint-missing", {"method": "eagle_tree", "checkpoint": "/nonexistent/head"},
     ["checkpoint", "no such file"]),
    ("eagle-checkpoint-not-a-head", {"method": "eagle_tree", "checkpoint": "/"}, ["checkpoint", "config.json"]),
    ("eagle-depth-zero", {"method": "eagle_tree", "checkpoint": "/nonexistent/head", "depth": 0}, ["depth", ">= 1"]),
    ("eagle-floor-range", {"method": "eagle_tree", "checkpoint": "/nonexistent/head", "min_node_confidence": 1.5},
     ["min_node_confidence", "[0, 1)"]),
    ("eagle-top-k-type", {"method": "eagle_tree", "top_k": "8"}, ["top_k", "Expected `int`"]),
    ("eagle-dtype", {"method": "eagle_tree", "dtype": "int4"}, ["dtype"]),
    ("graft-eagle-dtype", {"method": "graft", "eagle_dtype": "int4"}, ["eagle_dtype"]),
    ("kv-aware-checkpoint-missing", {"method": "kv_aware", "checkpoint": "/nonexistent/head"},
     ["checkpoint", "no such file"]),
    ("kv-aware-checkpoint-not-a-head", {"method": "kv_aware", "checkpoint": "/"}, ["checkpoint", "config.json"]),
    ("kv-aware-mode", {"method": "kv_aware", "mode": "cross"}, ["mode"]),
    ("kv-aware-top-k-zero", {"method": "kv_aware", "checkpoint": "/nonexistent/head", "top_k": 0}, ["top_k", ">= 1"]),
    ("graft-eagle-checkpoint-not-a-head", {"method": "graft", "eagle_checkpoint": "/"},
     ["eagle_checkpoint", "config.json"]),
]


def test_table_is_large_enough():
    assert len(BAD_CONFIGS) >= 30
    assert len({case_id for case_id, _, _ in BAD_CONFIGS}) == len(BAD_CONFIGS)


@pytest.mark.parametrize("spec,expected", [(s, e) for _, s, e in BAD_CONFIGS], ids=[i for i, _, _ in BAD_CONFIGS])
def test_bad_config_fails_naming_the_field(spec, expected):
    with pytest.raises(TreeSpecConfigError) as info:
        translate(dict(spec), None)
    message = str(info.value)
    assert "\n" not in message, "one message, one line"
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("spec", [
    {"method": "suffix_tree", "num_speculative_tokens": 16, "max_depth": 8, "min_token_prob": 0.2},
    {"method": "ngram_tree", "num_speculative_tokens": 8, "min_n": 1, "max_n": 3},
    {"method": "static_tree", "num_speculative_tokens": 16, "branches": 2, "depth": 8},
])
def test_good_configs_translate(spec):
    """The checks above are not 'everything fails': the same methods with valid options pass."""
    new_spec, extra, is_tree = translate(dict(spec), None)
    assert is_tree and new_spec["method"] == "custom_class"
    assert new_spec["num_speculative_tokens"] == spec["num_speculative_tokens"]
    assert extra["vllm_treespec"]["method"] == spec["method"]
