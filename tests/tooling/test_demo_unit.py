"""The demo's configurations and its comparison table, without an engine (``bash scripts/demo.sh`` runs them)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_treespec.tools.demo import Run, runs_for, summary


def outputs(*token_lists):
    return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(t))]) for t in token_lists]


def test_graft_with_a_head_is_compared_with_graft_retrieval_only_ngram_and_no_speculation():
    runs = runs_for("graft", 16, "/heads/eagle3", baselines=True)
    assert [r.label for r in runs] == ["graft (head + retrieval)", "graft retrieval-only", "vLLM ngram (k=5)",
                                       "no speculation"]
    assert runs[0].spec == {"method": "graft", "num_speculative_tokens": 16, "eagle_checkpoint": "auto"}
    assert runs[1].spec["eagle_checkpoint"] == "none" and runs[2].spec["method"] == "ngram" and runs[3].spec is None
    assert [r.exact for r in runs] == [True, True, False, False]


def test_without_a_head_graft_runs_once_retrieval_only():
    runs = runs_for("graft", 16, None, baselines=True)
    assert [r.label for r in runs] == ["graft", "vLLM ngram (k=5)", "no speculation"]
    assert runs[0].spec["eagle_checkpoint"] == "none"
    assert [r.label for r in runs_for("suffix_tree", 8, None, baselines=False)] == ["suffix_tree", "no speculation"]


def test_summary_table_and_exactness():
    base = Run("no speculation", None, exact=False, outputs=outputs([1, 2], [3, 4]), speed=10.0)
    graft = Run("graft", {"method": "graft"}, outputs=outputs([1, 2], [3, 4]), speed=15.0, tau=2.5)
    ngram = Run("vLLM ngram (k=5)", {"method": "ngram"}, exact=False, outputs=outputs([1, 2], [3, 5]), speed=11.0,
                tau=1.2)
    lines, differs = summary([graft, ngram, base])
    assert not differs  # ngram is vLLM's: reported, not failed on
    assert lines[1].split() == ["graft", "15.0", "1.50x", "2.50", "2/2"]
    assert lines[2].split()[-1] == "1/2" and lines[3].split()[-2:] == ["-", "-"]
    graft.outputs = outputs([1, 2], [3, 9])
    assert summary([graft, base])[1]
