"""``vllm-treespec bench`` and ``bench serve`` end to end on real engines (short runs)."""

from __future__ import annotations

import json
import os

import pytest

from vllm_treespec.tools import bench, bench_serve

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def test_bench_offline_reports_every_category_and_is_lossless(tmp_path, monkeypatch):
    from engine_helpers import close, make_llm

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # bench would quieten vLLM for the rest of the session
    # bench leaves this set for the rest of its process: restored after the test
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    engines = []

    def in_process_engine(model, spec, args):
        # the bench's engines in this process (seconds to start, not ~25 s); each closed before the next
        while engines:
            close(engines.pop())
        engines.append(make_llm(model, spec.speculative_config(), dtype=args.dtype, max_model_len=args.max_model_len,
                                max_num_seqs=max(args.batch_size, 1), seed=args.seed,
                                enforce_eager=args.enforce_eager))
        return engines[-1]

    monkeypatch.setattr(bench, "build_llm", in_process_engine)
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "repeat", "turns": ["Repeat this sentence twice: the cat sat on the mat."]},
        {"question_id": 2, "category": "code", "turns": ["Write a Python function that adds two numbers.",
                                                         "Now make it add three numbers."]},
    ]))
    out = tmp_path / "out"
    try:
        # no step-cost budget: on a machine where a wider step costs more than it gains, it would verify nothing,
        # and this test needs tree steps
        code = bench.main(["--prompts", str(questions), "--turns", "2", "--max-tokens", "24", "--enforce-eager",
                           "--methods", 'suffix_tree:{"num_speculative_tokens":16,"cost_budget":false}',
                           "--out", str(out)])
    finally:
        while engines:
            close(engines.pop())
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    rows = {(r["method"], r["category"]): r for r in report["rows"]}
    assert set(rows) == {(m, c) for m in ("none", "suffix_tree") for c in ("repeat", "code", "overall")}
    overall = rows[("suffix_tree", "overall")]
    assert overall["requests"] == 3  # two turns of the code question
    assert overall["lossless"] == {"identical": 2, "prompts": 2}
    assert overall["drafts"] > 0 and overall["tau"] >= 1.0 and overall["tokens_per_step"] > 1.0
    assert len(overall["acceptance_per_pos"]) == 16
    assert all(a >= b for a, b in zip(overall["acceptance_per_pos"], overall["acceptance_per_pos"][1:]))
    assert rows[("none", "overall")]["drafts"] == 0 and rows[("none", "overall")]["speedup"] == pytest.approx(1.0)
    assert overall["speedup"] > 0 and overall["tok_per_s"] > 0 and overall["decode_tok_per_s"] > 0
    # each engine's worker timed its plain forwards: no speculation's ~70; the tree engine's only where it verified
    # nothing (none if fewer than MIN_PLAIN_FORWARDS), and the ratio at equal engine speed follows from both
    (none_ms,) = rows[("none", "overall")]["plain_forward_ms_repeats"]
    (tree_ms,) = overall["plain_forward_ms_repeats"]
    assert 0 < none_ms < 10_000
    expected = None if tree_ms is None else pytest.approx(overall["speedup"] * tree_ms / none_ms, rel=1e-6)
    assert overall["normalised_speedup"] == expected
    assert {p.name for p in out.iterdir()} >= {"results.json", "table.txt", "speedup.png", "tau.png",
                                               "acceptance.png"}


def test_bench_serve_sweeps_levels_and_stops_every_server(tmp_path):
    import psutil

    from vllm_treespec.tools.models import ensure_tiny_llama

    out = tmp_path / "serve"
    code = bench_serve.main(["--model", str(ensure_tiny_llama()), "--prompts", "humaneval", "--concurrency", "1,4",
                             "--requests-per-level", "4", "--max-tokens", "16", "--max-model-len", "1024",
                             "--enforce-eager", "--methods", 'static_tree:{"num_speculative_tokens":8}',
                             "--out", str(out)])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert [m["label"] for m in report["methods"]] == ["none", "static_tree"]
    for method in report["methods"]:
        assert method["status"] == "ok"
        assert set(method["levels"]) == {"1", "4"}
        for level in method["levels"].values():
            assert level["succeeded"] == level["requests"] == 4
            assert level["ttft_s"]["p50"] > 0 and level["output_tok_per_s"] > 0
        if len(os.sched_getaffinity(0)) >= 2:
            # vLLM reserved a CPU beside its worker's (the first), and the server's other processes went there
            assert method["pinned_cpus"] and min(os.sched_getaffinity(0)) not in method["pinned_cpus"]
        assert not psutil.pid_exists(method["server_pid"]) or \
            psutil.Process(method["server_pid"]).status() == psutil.STATUS_ZOMBIE
        port_flag = f"--port {method['port']}"
        assert not [p for p in psutil.process_iter(["cmdline"]) if port_flag in " ".join(p.info["cmdline"] or [])]
    assert (out / "serve.png").stat().st_size > 5000
