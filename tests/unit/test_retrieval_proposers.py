"""suffix_tree and ngram_tree proposers through the public API, with a fake ProposeContext (no engine)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from vllm_treespec.api import DraftTree, ProposeContext, load_proposer_class
from vllm_treespec.proposers.ngram_tree import NgramTreeOptions, NgramTreeProposer
from vllm_treespec.proposers.suffix_tree import SuffixTreeOptions, SuffixTreeProposer
from vllm_treespec.retrieval.datastore import build_from_token_documents
from vllm_treespec.retrieval.store_file import documents_of


def make_ctx(req_ids, contexts, sampled, max_nodes=8) -> ProposeContext:
    width = max(len(c) for c in contexts) + 4
    token_ids = np.zeros((len(contexts), width), np.int32)
    for i, c in enumerate(contexts):
        token_ids[i, : len(c)] = c
    return ProposeContext(req_ids=list(req_ids), sampled_token_ids=sampled,
                          num_tokens=np.array([len(c) for c in contexts], np.int32), token_ids=token_ids,
                          max_nodes=max_nodes)


def test_builtin_names_resolve():
    assert load_proposer_class("suffix_tree") is SuffixTreeProposer
    assert load_proposer_class("ngram_tree") is NgramTreeProposer
    assert SuffixTreeProposer.options_type is SuffixTreeOptions and NgramTreeProposer.options_type is NgramTreeOptions


@pytest.mark.parametrize("cls, opts", [(SuffixTreeProposer, SuffixTreeOptions(min_token_prob=0.0)),
                                       (NgramTreeProposer, NgramTreeOptions(min_n=1))])
def test_propose_trees_per_row(cls, opts):
    proposer = cls(None, opts)
    a = [5, 6, 7, 8, 9, 5, 6]
    b = [1, 2, 3]
    ctx = make_ctx(["a", "b", "c"], [a, b, a], [[6], [], [7]], max_nodes=3)
    trees = proposer.propose_trees(ctx)
    assert trees[1] is None  # partial prefill: no draft
    assert isinstance(trees[0], DraftTree) and trees[0].token_ids.tolist() == [7, 8, 9]
    assert trees[0].node_probs.tolist() == [1.0, 1.0, 1.0] and trees[0].num_nodes <= 3
    # the vLLM custom_class entry degrades trees to their first-child chain (budget = num_speculative_tokens)
    proposer.max_nodes = 3
    assert proposer.propose([[6], [], [7]], ctx.num_tokens, ctx.token_ids) == [[7, 8, 9], [], [7, 8, 9]]
    # a request whose last token is new gets an empty tree
    assert proposer.propose_trees(make_ctx(["d"], [[1, 2, 3, 4]], [[4]]))[0].num_nodes == 0
    proposer.on_requests_finished({"a", "b", "c", "d", "0", "1", "2"})  # propose() names rows by index
    assert len(proposer.retriever.requests) == 0


def test_suffix_tree_merges_branches_and_learns_from_finished_requests():
    proposer = SuffixTreeProposer(None, SuffixTreeOptions(min_token_prob=0.0))
    prompt = [10, 11, 12]
    out = [1, 2, 3, 4, 1, 2, 5, 6]
    # first step after prefill: num_tokens = prompt + 1 sampled token
    proposer.propose_trees(make_ctx(["r1"], [prompt + out[:1]], [out[:1]]))
    tree = proposer.propose_trees(make_ctx(["r1"], [prompt + out[:6]], [out[4:6]]))[0]
    assert tree.token_ids.tolist() == [3, 4, 1, 2]
    proposer.propose_trees(make_ctx(["r1"], [prompt + out], [out[6:]]))
    proposer.on_requests_finished({"r1"})
    assert proposer.retriever.global_store.sam.tokens[:len(out)].tolist() == out  # the output only, not the prompt
    # a new request continues from the finished one's output: 1 2 -> {3, 5}
    tree = proposer.propose_trees(make_ctx(["r2"], [[40, 1, 2]], [[2]]))[0]
    roots = {int(t): float(p) for t, p, par in zip(tree.token_ids, tree.node_probs, tree.parents) if par == -1}
    assert roots == {3: 0.5, 5: 0.5}


def test_suffix_tree_indexes_whole_outputs_and_reads_prompt_lengths_from_the_engine():
    proposer = SuffixTreeProposer(None, SuffixTreeOptions(min_token_prob=0.0))
    assert proposer.wants_finished_outputs
    prompt, out = [10, 11, 12], [1, 2, 3, 4, 5, 6]
    # first seen three tokens into its output (it was not asked for a tree before): the engine's prompt length
    # marks where the output starts, not the tokens before this step
    ctx = make_ctx(["r1"], [prompt + out[:3]], [out[2:3]])
    ctx.num_prompt_tokens = np.array([len(prompt)])
    proposer.propose_trees(ctx)
    proposer.on_requests_finished({"r1"})
    assert proposer.retriever.global_store.sam.tokens[:4].tolist() == [1, 2, 3, -1]  # as far as it read
    # with the engine's outputs it indexes every committed token, also of a request it never drafted for
    proposer.on_outputs_finished({"r2": np.array(out), "r3": np.array([7, 8])})
    proposer.on_requests_finished({"r2", "r3"})
    stored = proposer.retriever.global_store.sam.tokens[:len(proposer.retriever.global_store)]
    documents = [d.tolist() for d in documents_of(stored)]
    assert documents[0] == [1, 2, 3] and sorted(documents[1:]) == [out, [7, 8]]


def test_suffix_tree_reads_a_datastore(tmp_path):
    path = tmp_path / "c.ds"
    build_from_token_documents([np.array([20, 21, 22, 23])], path, vocab_size=64, tokenizer="toy")
    proposer = SuffixTreeProposer(None, SuffixTreeOptions(datastore=str(path), use_global=False))
    tree = proposer.propose_trees(make_ctx(["x"], [[3, 20, 21]], [[21]]))[0]
    assert tree.token_ids.tolist() == [22, 23]


@pytest.mark.parametrize("options_type, raw, field", [
    (SuffixTreeOptions, {"max_depth": 0}, "max_depth"),
    (SuffixTreeOptions, {"min_token_prob": 1.5}, "min_token_prob"),
    (SuffixTreeOptions, {"max_spec_factor": 0}, "max_spec_factor"),
    (SuffixTreeOptions, {"max_nodes": 0}, "max_nodes"),
    (SuffixTreeOptions, {"datastore": "/nonexistent/file.ds"}, "datastore"),
    (NgramTreeOptions, {"min_n": 3, "max_n": 2}, "max_n"),
    (NgramTreeOptions, {"min_confidence": -0.1}, "min_confidence"),
    (NgramTreeOptions, {"max_occurrences": 0}, "max_occurrences"),
])
def test_options_are_validated_naming_the_field(options_type, raw, field):
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(raw, options_type)


def test_unknown_option_is_refused():
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"budget_nodes": 3}, SuffixTreeOptions)


def test_suffix_tree_keeps_finished_outputs_in_a_file_across_restarts(tmp_path):
    path = tmp_path / "outputs.tsds"
    first = SuffixTreeProposer(None, SuffixTreeOptions(min_token_prob=0.0, global_file=str(path),
                                                       global_save_every=1000))
    prompt, out = [10, 11, 12], [1, 2, 3, 4]
    first.propose_trees(make_ctx(["r1"], [prompt + out[:1]], [out[:1]]))
    first.propose_trees(make_ctx(["r1"], [prompt + out], [out[1:]]))
    first.on_requests_finished({"r1"})
    assert not path.exists()  # 1 of 1000 finished requests: not due
    first.on_shutdown()
    second = SuffixTreeProposer(None, SuffixTreeOptions(min_token_prob=0.0, global_file=str(path)))
    tree = second.propose_trees(make_ctx(["r2"], [[40, 1, 2]], [[2]]))[0]
    assert tree.token_ids.tolist() == [3, 4]  # the first engine's output, read back from the file


@pytest.mark.parametrize("raw, message", [
    ({"global_file": "/nonexistent/folder/o.tsds"}, "global_file.*does not exist"),
    ({"global_file": "{tmp}"}, "global_file.*is a folder"),
    ({"global_file": "{tmp}/junk.tsds"}, "global_file.*junk.tsds.*delete it"),
    ({"global_file": "{tmp}/o.tsds", "use_global": False}, "global_file.*use_global"),
    ({"global_save_every": 0}, "global_save_every"),
])
def test_store_file_options_are_checked_naming_the_field(tmp_path, raw, message):
    (tmp_path / "junk.tsds").write_bytes(b"not a datastore")
    raw = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in raw.items()}
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(raw, SuffixTreeOptions)
