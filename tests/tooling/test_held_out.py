"""Benchmarks refuse ShareGPT prompts a drafting head was trained on (vllm_treespec.tools.held_out)."""

from __future__ import annotations

import json

import pytest

from vllm_treespec.eagle.default_head import shipped_head_path
from vllm_treespec.tools import bench, bench_serve
from vllm_treespec.tools.bench import BenchError, MethodSpec, check_held_out, load_questions
from vllm_treespec.tools.held_out import head_training_span, heads_drafting, training_overlaps


def fake_head(tmp_path, span=(1000, 1010)):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"treespec_training": {"sharegpt_positions": list(span)}}))
    return head


def test_the_shipped_heads_recorded_span_is_where_the_trainer_drew_its_three_runs_prompts():
    from vllm_treespec.training.data import training_prompt_span, training_prompts

    # run 1: the default recipe's 1024 prompts; run 2 (--init-from): the next 1024; run 3 (--init-from): 2048 more
    span = head_training_span(shipped_head_path())
    first_run = training_prompt_span(1024)
    second_run = training_prompt_span(1024, first=first_run[1])
    third_run = training_prompt_span(2048, first=second_run[1])
    assert first_run == (1000, 2169) and second_run[1] == 3340
    assert span == (1000, third_run[1]) == (1000, 5680)
    from vllm_treespec.tools.data import sharegpt

    position_of = {q["question_id"]: i for i, q in enumerate(sharegpt(seed=0))}
    runs = training_prompts(1024) + training_prompts(1024, first=2169) + training_prompts(2048, first=3340)
    positions = [position_of[q["question_id"]] for q in runs]
    assert min(positions) == span[0] and max(positions) == span[1] - 1 and len(set(positions)) == 4096
    config = json.loads((shipped_head_path() / "config.json").read_text())["treespec_training"]
    second = config["continued_from"]
    assert second["head"] == "shipped" and second["sharegpt_positions"] == [1000, 3340]
    first = second["continued_from"]
    assert first["head"] == "shipped" and first["sharegpt_positions"] == [1000, 2169]


def test_overlap_names_the_positions_inside_the_span_only(tmp_path):
    head = fake_head(tmp_path)
    questions = load_questions(["sharegpt[1005:1013]", "humaneval[0:2]"], None)
    listed = [q for qs in questions.values() for q in qs]
    (overlap,) = training_overlaps(listed, [head])
    assert overlap.positions == (1005, 1006, 1007, 1008, 1009)
    assert "5 ShareGPT prompts (positions 1005-1009" in overlap.describe() and "(1000-1009)" in overlap.describe()
    assert training_overlaps([q for q in listed if q["category"] == "humaneval"], [head]) == []
    assert training_overlaps(load_questions(["sharegpt[1010:1012]"], None)["sharegpt"], [head]) == []


def test_a_head_without_a_recorded_span_is_not_checked(tmp_path):
    head = tmp_path / "elsewhere"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert head_training_span(head) is None
    assert head_training_span(tmp_path / "missing") is None
    assert training_overlaps(load_questions(["sharegpt[1000:1002]"], None)["sharegpt"], [head]) == []


def test_only_methods_that_draft_with_a_head_are_checked(tmp_path):
    head = fake_head(tmp_path)
    default = shipped_head_path()
    assert heads_drafting([("none", {}), ("ngram", {}), ("suffix_tree", {}), ("graft", {"eagle_checkpoint": "none"}),
                           ("eagle3", {"model": "not/a/folder"})]) == []
    assert heads_drafting([("eagle_tree", {"checkpoint": str(head)}), ("eagle3", {"model": str(head)})]) == [head]
    if default.is_dir():  # the default head is the cache's when one was trained there
        assert len(heads_drafting([("graft", {}), ("eagle_tree", {}), ("kv_aware", {})])) == 1


def test_kv_aware_methods_are_checked_against_the_kv_aware_head_of_their_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TREESPEC_CACHE", str(tmp_path))
    kv, hybrid = tmp_path / "kv-aware-smollm2-135m-kv", tmp_path / "kv-aware-smollm2-135m-hybrid"
    for folder in (kv, hybrid):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    assert heads_drafting([("kv_aware", {"mode": "kv"})]) == [kv]
    assert heads_drafting([("kv_aware", {}), ("graft", {"eagle_checkpoint": "kv_aware"})]) == [hybrid]


def test_bench_refuses_training_prompts_and_allows_them_on_request(tmp_path, capsys):
    head = fake_head(tmp_path)
    questions = load_questions(["sharegpt[1008:1012]"], None)
    graft = MethodSpec("graft", "graft", {"eagle_checkpoint": str(head)})
    with pytest.raises(BenchError, match=r"--prompts: 2 ShareGPT prompts .*sharegpt\[1010:1014\].*"
                                         r"--allow-training-prompts"):
        check_held_out(questions, [MethodSpec("none", "none"), graft], allow=False)
    check_held_out(questions, [MethodSpec("none", "none"), graft], allow=True)
    assert "warning: --prompts: 2 ShareGPT prompts" in capsys.readouterr().err
    check_held_out(questions, [MethodSpec("none", "none"), MethodSpec("ngram", "ngram")], allow=False)


@pytest.mark.parametrize("command", [bench.main, bench_serve.main])
def test_bench_commands_exit_2_before_starting_an_engine(command, capsys, tmp_path):
    from vllm_treespec.eagle.default_head import find_default_head

    if find_default_head() != shipped_head_path():
        pytest.skip("a head trained into the cache folder is the default here")
    rc = command(["--model", str(tmp_path), "--prompts", "sharegpt[1500:1502]", "--methods", "graft",
                  "--out", str(tmp_path / "out")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--prompts: 2 ShareGPT prompts" in err and "--allow-training-prompts" in err
    assert not (tmp_path / "out").exists()


def test_the_installed_command_checks_prompts_from_any_folder(tmp_path):
    """The check imports what an installed package has (a module importable only from the repository's root broke
    every `vllm-treespec bench` run outside it)."""
    import subprocess
    import sys

    from vllm_treespec.eagle.default_head import find_default_head

    if find_default_head() != shipped_head_path():
        pytest.skip("a head trained into the cache folder is the default here")
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from vllm_treespec.tools.cli import main; sys.exit(main())", "bench",
         "--model", str(tmp_path), "--prompts", "sharegpt[1500:1502]", "--methods", "graft",
         "--out", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--prompts: 2 ShareGPT prompts" in run.stderr
