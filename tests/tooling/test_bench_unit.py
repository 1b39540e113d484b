"""The bench's method syntax, counter arithmetic, summary and table (no engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_treespec.tools import bench
from vllm_treespec.tools.bench import BenchError, CategoryRun, MethodResult, MethodSpec, SpecCounters


def test_parse_methods_labels_options_and_baseline_first():
    specs = bench.parse_methods('ngram:{"num_speculative_tokens": 5, "prompt_lookup_max": 4}; '
                                'st=suffix_tree:{"datastore": "/a;b.vtds"};none;static_tree')
    assert [s.label for s in specs] == ["none", "ngram", "st", "static_tree"]
    assert specs[0].speculative_config() is None
    assert specs[1].speculative_config() == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    assert specs[2].options == {"datastore": "/a;b.vtds"}  # ';' inside JSON strings is not a separator
    assert specs[3].speculative_config() == {"method": "static_tree"}


def test_parse_methods_adds_the_baseline():
    assert [s.label for s in bench.parse_methods("suffix_tree")] == ["none", "suffix_tree"]


def test_a_second_baseline_is_paired_with_the_first():
    """``none;none_b=none;graft`` (the README's noise floor): both baselines run first, and the second is paired
    with ``none`` per round like any method."""
    from vllm_treespec.tools.bench_serve import add_ratios, merge_rounds

    specs = bench.parse_methods("graft;none;none_b=none")
    assert [(s.label, s.speculative_config()) for s in specs] == [("none", None), ("none_b", None),
                                                                   ("graft", {"method": "graft"})]
    none = merge_rounds([_serve_entry("none", {"8": rate}, i) for i, rate in enumerate((50.0, 40.0, 60.0))])
    none_b = merge_rounds([_serve_entry("none_b", {"8": rate}, i) for i, rate in enumerate((55.0, 40.0, 54.0))])
    add_ratios([none, none_b])
    assert none_b["levels"]["8"]["rounds_vs_none"] == pytest.approx([1.1, 1.0, 0.9])
    assert none_b["levels"]["8"]["vs_none_paired"] == pytest.approx(1.0)


@pytest.mark.parametrize("text,needle", [
    ('suffix_tree:{"max_depth": }', "not valid JSON"),
    ("suffix_tree:[1, 2]", "must be a JSON object"),
    ('suffix_tree:{"method": "x"}', "must not repeat 'method'"),
    ("suffix_tree ngram", "expected ';'"),
    ("suffix_tree;suffix_tree", "duplicate label"),
    ('none:{"num_speculative_tokens": 3}', "'none' takes no options"),
    ("=suffix_tree", "expected [LABEL=]METHOD"),
])
def test_parse_methods_errors_say_what_is_wrong(text, needle):
    with pytest.raises(BenchError, match=None) as info:
        bench.parse_methods(text)
    assert needle in str(info.value)


def test_check_method_catches_bad_tree_options_before_running():
    bench.check_method(MethodSpec("ngram", "ngram", {"num_speculative_tokens": 3}))  # vLLM's own: not ours to check
    with pytest.raises(BenchError, match="max_depth"):
        bench.check_method(MethodSpec("st", "suffix_tree", {"max_depth": 0}))


def test_read_counters_sums_engines_and_subtracts():
    def metrics(drafts, accepted, per_pos):
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=drafts),
                SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=drafts * 4),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
                SimpleNamespace(name="vllm:num_requests_running", value=3)]

    before = bench.read_counters(metrics(2, 1, [1, 0, 0, 0]))
    after = bench.read_counters(metrics(10, 12, [7, 3, 2, 0]) + metrics(0, 0, [0, 0, 0, 0]))
    delta = after - before
    assert (delta.drafts, delta.draft_tokens, delta.accepted, delta.accepted_per_pos) == (8, 32, 11, [6, 3, 2, 0])
    assert delta.tau == pytest.approx(1 + 11 / 8)
    assert delta.acceptance_per_pos == pytest.approx([6 / 8, 3 / 8, 2 / 8, 0])
    assert SpecCounters().tau is None


def _result(label, method, speeds, outputs, counters=None):
    result = MethodResult(MethodSpec(label, method))
    for speed in speeds:
        result.repeats.append({cat: CategoryRun(elapsed_s=10.0, output_tokens=int(speed * 10), decode_tokens=90,
                                                decode_s=9.0, requests=2, counters=counters or SpecCounters())
                               for cat in ("code", "chat")})
    result.outputs = outputs
    return result


def test_summarize_speedup_median_and_lossless_counts():
    base_out = {"code": {1: [[1, 2]], 2: [[3]]}, "chat": {3: [[4], [5, 6]]}}
    spec_out = {"code": {1: [[1, 2]], 2: [[3, 9]]}, "chat": {3: [[4], [5, 6]]}}
    counters = SpecCounters(drafts=4, draft_tokens=16, accepted=6, accepted_per_pos=[3, 2, 1, 0])
    results = [_result("none", "none", [10.0, 12.0, 11.0], base_out),
               _result("st", "suffix_tree", [20.0, 30.0, 22.0], spec_out, counters),
               MethodResult(MethodSpec("suffix", "suffix"), status="skipped", reason="needs arctic-inference")]
    rows = bench.summarize(results, temperature=0.0)
    by = {(r["method"], r["category"]): r for r in rows}
    code = by[("st", "code")]
    assert code["tok_per_s"] == pytest.approx(22.0)  # median of repeats
    assert code["speedup"] == pytest.approx(22.0 / 11.0)
    assert code["lossless"] == {"identical": 1, "prompts": 2}
    assert code["tau"] == pytest.approx(1 + 18 / 12)  # counters summed over the 3 repeats
    assert code["tokens_per_step"] == pytest.approx(720 / (720 - 18))  # every step counts, drafted or not
    assert by[("none", "code")]["tokens_per_step"] == pytest.approx(1.0)
    assert by[("st", "overall")]["lossless"] == {"identical": 2, "prompts": 3}
    assert "lossless" not in by[("none", "code")]
    assert by[("suffix", "overall")]["status"] == "skipped"
    table = bench.format_table(rows)
    assert "1/2" in table and "2.00x" in table and "needs arctic-inference" in table
    assert "informational" not in table and "informational in bfloat16" in bench.format_table(rows, dtype="bfloat16")
    json.dumps(rows)  # plain data


def _forwards(*ms):
    """Per engine, its plain forwards all of ``ms`` (None: too few to read), without contexts."""
    return [None if m is None else [(m, None)] * bench.MIN_PLAIN_FORWARDS for m in ms]


def test_norm_speedup_brings_every_engine_to_the_median_engines_speed():
    """Engines of one configuration run at different speeds: scaled by each engine's median plain forward, the runs of a
    method agree, and the ratio is the methods' (2x here) where the raw medians say 1.6x."""
    out = {"code": {1: [[1]]}, "chat": {2: [[2]]}}
    none = _result("none", "none", [10.0, 8.0, 10.0], out)
    none.plain_forwards = _forwards(40.0, 50.0, 40.0)  # tok/s x ms = 400 on every engine
    tree = _result("st", "suffix_tree", [16.0, 16.0, 25.0], out)
    tree.plain_forwards = _forwards(50.0, 50.0, 32.0)  # 800
    rows = {(r["method"], r["category"]): r for r in bench.summarize([none, tree], temperature=0.0)}
    overall = rows[("st", "overall")]
    assert overall["speedup"] == pytest.approx(1.6)
    assert overall["normalised_speedup"] == pytest.approx(2.0)
    assert overall["normalised_tok_per_s"] == pytest.approx(800 / 45)  # the median of the six readings: 45 ms
    assert rows[("st", "code")]["normalised_speedup"] == pytest.approx(2.0)
    assert overall["plain_forward_ms_repeats"] == [50.0, 50.0, 32.0]
    table = bench.format_table(list(rows.values()))
    assert "1.60x" in table and "2.00x" in table and "median engine's (45.0 ms; engines 32.0-50.0 ms)" in table

    tree.plain_forwards = _forwards(50.0, None, 32.0)  # one engine ran too few plain forwards: that method has none
    rows = {(r["method"], r["category"]): r for r in bench.summarize([none, tree], temperature=0.0)}
    assert rows[("st", "overall")]["normalised_speedup"] is None
    assert rows[("none", "overall")]["normalised_tok_per_s"] == pytest.approx(400 / 40)  # median of 5 readings
    none.plain_forwards = tree.plain_forwards = _forwards(None, None, None)
    rows = bench.summarize([none, tree], temperature=0.0)
    assert all(r["normalised_speedup"] is None for r in rows)
    assert "norm. speedup:" not in bench.format_table(rows)


def test_an_engines_speed_is_read_from_its_plain_forwards_once_it_ran_enough_of_them():
    """A tree engine that verifies on nearly every step runs only its budget's plain samples (6-10 a repeat of 768
    tokens): 5 are enough for a reading, fewer give none (and the reading is asked for the batch's request count)."""
    class Engine:
        def __init__(self, count):
            self.count, self.asked = count, []

        def collective_rpc(self, fn, kwargs):
            self.asked.append(kwargs)
            return [{1: [(18.5, 300)] * self.count, 4: [(30.0, 1200)] * 100}]

    assert bench.plain_forwards(Engine(bench.MIN_PLAIN_FORWARDS), 1) == [(18.5, 300)] * bench.MIN_PLAIN_FORWARDS
    assert bench.plain_forwards(Engine(6), 4) == [(30.0, 1200)] * 100
    assert bench.plain_forwards(Engine(bench.MIN_PLAIN_FORWARDS - 1), 1) is None
    assert bench.plain_forwards(Engine(100), 2) is None  # no forward of 2 requests
    assert bench.MIN_PLAIN_FORWARDS <= 6
    engine = Engine(50)
    bench.plain_forwards(engine, 1, reset=True)
    assert engine.asked == [{"reset": True, "contexts": True}]


def test_engines_compare_at_one_context_whichever_steps_their_gates_left_plain():
    """A plain forward's time grows with its context, and a tree engine's gate picks which steps run plain. Two
    engines of one speed (20 ms + 3 ms per 1000 tokens), one whose plain forwards were the long-context steps, read
    alike; their medians did not (27.5 against 20.9 ms). A faster engine stays faster by its own margin, and a
    reading without contexts falls back to its median."""
    rng = np.random.default_rng(0)

    def engine(base, contexts):
        return [(base + 3.0 * c / 1000 + float(rng.normal(0, 0.05)), int(c)) for c in contexts]

    short, long = np.linspace(100, 500, 40), np.linspace(2000, 3000, 40)
    readings = [engine(20.0, short), engine(20.0, long), engine(16.0, np.concatenate([short, long])), None,
                [(25.0, None)] * 5]
    speeds, context, slope = bench.engine_speeds(readings)
    assert slope == pytest.approx(3.0, abs=0.05)
    assert speeds[0] == pytest.approx(speeds[1], abs=0.1)
    assert speeds[0] - speeds[2] == pytest.approx(4.0, abs=0.1)
    assert speeds[0] == pytest.approx(20.0 + 3.0 * context / 1000, abs=0.1)
    assert speeds[3] is None and speeds[4] == 25.0
    assert np.median([ms for ms, _ in readings[1]]) - np.median([ms for ms, _ in readings[0]]) > 5

    # summarize moves each repeat's forwards to that context before scaling its tok/s
    out = {"code": {1: [[1]]}}
    none = _result("none", "none", [10.0, 10.0], out)
    none.plain_forwards = [engine(20.0, short), engine(20.0, short)]
    tree = _result("st", "suffix_tree", [20.0, 20.0], out)
    tree.plain_forwards = [engine(20.0, long), engine(20.0, long)]  # as fast, its plain steps the long ones
    rows = {(r["method"], r["category"]): r for r in bench.summarize([none, tree], temperature=0.0)}
    overall = rows[("st", "overall")]
    assert overall["normalised_speedup"] == pytest.approx(2.0, rel=0.01)  # their medians would say 2.6x
    assert overall["plain_forward_ms_per_1000_context"] == pytest.approx(3.0, abs=0.05)
    assert "tokens of context (moved along 2.9" in bench.format_table(list(rows.values()))


def test_no_lossless_check_when_sampling():
    out = {"code": {1: [[1]]}, "chat": {2: [[2]]}}
    rows = bench.summarize([_result("none", "none", [1.0], out), _result("st", "suffix_tree", [1.0], out)], 0.7)
    assert all("lossless" not in r for r in rows)


def test_plot_writes_pngs(tmp_path):
    out = {"code": {1: [[1]]}, "chat": {2: [[2]]}}
    counters = SpecCounters(drafts=2, draft_tokens=8, accepted=2, accepted_per_pos=[1, 1, 0, 0])
    rows = bench.summarize([_result("none", "none", [1.0], out), _result("st", "suffix_tree", [2.0], out, counters)],
                           0.0)
    paths = bench.plot(rows, tmp_path)
    assert [p.name for p in paths] == ["speedup.png", "tau.png", "acceptance.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_load_questions_limits_per_category(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}"]})
                              for i in range(7)))
    grouped = bench.load_questions([str(path)], limit=2)
    assert {c: [q["question_id"] for q in qs] for c, qs in grouped.items()} == {"a": [0, 2], "b": [1, 3]}


def test_bench_rejects_bad_arguments(capsys):
    assert bench.main(["--methods", "suffix_tree:{oops}", "--prompts", "x"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert bench.main(["--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1" in capsys.readouterr().err
    assert bench.main(["--prompts", "no_such_set", "--methods", "none"]) == 2
    assert "--prompts: unknown prompt set 'no_such_set'" in capsys.readouterr().err


def _serve_entry(label: str, rates: dict[str, float], pid: int) -> dict:
    level = lambda rate: {"requests": 4, "succeeded": 4, "output_tok_per_s": rate, "requests_per_s": rate / 100,  # noqa: E731
                          "ttft_s": {"p50": 0.1, "p99": 0.2}, "itl_s": {"p50": 0.05, "p99": 0.1},
                          "tpot_s": {"p50": 0.05}, "tokens_per_chunk": 1.0, "marker": pid,
                          "replies": [{"ttft_s": pid / 10}]}
    return {"label": label, "method": label, "status": "ok", "port": 8000 + pid, "server_pid": pid,
            "levels": {c: level(r) for c, r in rates.items()}}


def test_bench_serve_repeats_report_the_median_round_and_ratios():
    from vllm_treespec.tools.bench_serve import add_ratios, format_table, merge_rounds

    none = merge_rounds([_serve_entry("none", {"1": 20.0, "4": 60.0}, 1),
                         _serve_entry("none", {"1": 10.0, "4": 70.0}, 2),
                         _serve_entry("none", {"1": 15.0, "4": 50.0}, 3)])
    # per level the median round's own stats (not a mix of rounds), with every round's rate
    assert none["levels"]["1"]["output_tok_per_s"] == 15.0 and none["levels"]["1"]["marker"] == 3
    assert none["levels"]["4"]["output_tok_per_s"] == 60.0 and none["levels"]["4"]["marker"] == 1
    assert none["levels"]["1"]["rounds_tok_per_s"] == [20.0, 10.0, 15.0]
    assert none["rounds"] == 3 and none["server_pids"] == [1, 2, 3]
    # every round's requests, not only the median round's: a burst in one round is found there
    assert none["levels"]["1"]["rounds_replies"] == [[{"ttft_s": 0.1}], [{"ttft_s": 0.2}], [{"ttft_s": 0.3}]]
    # an even count takes the lower median: a real round, never an average
    graft = merge_rounds([_serve_entry("graft", {"1": 30.0, "4": 57.0}, 4),
                          _serve_entry("graft", {"1": 24.0, "4": 66.0}, 5)])
    assert graft["levels"]["1"]["output_tok_per_s"] == 24.0 and graft["levels"]["4"]["output_tok_per_s"] == 57.0
    broken = merge_rounds([{"label": "x", "status": "failed", "reason": "boom", "round": 1},
                           {"label": "x", "status": "crashed", "reason": "bang", "round": 2, "levels": {}}])
    assert broken["status"] == "failed" and broken["reason"] == "boom"
    assert [f["round"] for f in broken["failed_rounds"]] == [1, 2]
    methods = [none, graft, broken]
    add_ratios(methods)
    assert graft["levels"]["1"]["vs_none"] == pytest.approx(24.0 / 15.0)
    assert graft["levels"]["4"]["vs_none"] == pytest.approx(57.0 / 60.0)
    assert none["levels"]["4"]["vs_none"] == pytest.approx(1.0)
    # graft's two rounds are paired with the baseline's first two (round numbers by position here)
    assert graft["levels"]["1"]["rounds_vs_none"] == pytest.approx([30.0 / 20.0, 24.0 / 10.0])
    other = merge_rounds([_serve_entry("other", {"1": 40.0, "4": 60.0}, 7),
                          _serve_entry("other", {"1": 10.0, "4": 140.0}, 8),
                          _serve_entry("other", {"1": 30.0, "4": 50.0}, 9)])
    add_ratios([none, other])
    assert other["levels"]["1"]["rounds_vs_none"] == pytest.approx([2.0, 1.0, 2.0])
    assert other["levels"]["1"]["vs_none_paired"] == pytest.approx(2.0)  # rounds 2.0 / 1.0 / 2.0
    assert other["levels"]["4"]["vs_none_paired"] == pytest.approx(1.0)  # rounds 1.0 / 2.0 / 1.0
    assert other["levels"]["4"]["vs_none"] == pytest.approx(1.0)
    table = format_table(methods + [other])
    assert "2.00x" in table and "1.60x" in table and "0.95x" in table and "30.0 / 24.0" in table and "boom" in table


def test_bench_serve_keeps_the_rounds_a_crash_left():
    """A round whose server crashed is left out of the method's figures, named in the table and results, and the
    other rounds are paired with the baseline's rounds of the same number."""
    from vllm_treespec.tools.bench_serve import add_ratios, format_table, merge_rounds

    def entry(label, rate, pid, number):
        return {**_serve_entry(label, {"2": rate}, pid), "round": number}

    none = merge_rounds([entry("none", 20.0, 1, 1), entry("none", 40.0, 2, 2), entry("none", 10.0, 3, 3)])
    crash = {"label": "graft", "method": "graft", "status": "crashed", "round": 2, "reason": "ValueError: x",
             "log": "server-graft-r2.log", "levels": {"2": {"output_tok_per_s": 1.0}}}
    graft = merge_rounds([entry("graft", 30.0, 4, 1), crash, entry("graft", 12.0, 6, 3)])
    assert graft["status"] == "ok" and graft["rounds"] == 2 and graft["round_numbers"] == [1, 3]
    assert graft["failed_rounds"] == [{"round": 2, "status": "crashed", "reason": "ValueError: x",
                                       "log": "server-graft-r2.log"}]
    assert graft["levels"]["2"]["rounds_tok_per_s"] == [30.0, 12.0]  # the crashed round's partial level left out
    add_ratios([none, graft])
    assert graft["levels"]["2"]["rounds_vs_none"] == pytest.approx([1.5, 1.2])  # rounds 1 and 3, not 1 and 2
    assert graft["levels"]["2"]["vs_none_paired"] == pytest.approx(1.35)
    table = format_table([none, graft])
    assert "graft: round 2 crashed: ValueError: x (server-graft-r2.log)" in table


def test_bench_serve_pairs_rounds_at_equal_engine_speed(tmp_path):
    """Each level reads its server's plain forwards in its window; a round's ratio at equal speed is its raw ratio
    times the method's plain forward over no speculation's, and a round without a reading leaves the column empty."""
    from vllm_treespec.tools.bench_serve import add_forward_times, add_ratios, format_table, merge_rounds

    def entry(label, rates, forward_ms, pid):
        e = _serve_entry(label, {"4": rates}, pid)
        records = [(10.0 + j, 4, forward_ms, None) for j in range(25)] + [(10.5, 3, 999.0, None)]  # the tail
        records += [(50.0 + j, 4, 1.0, None) for j in range(30)]  # another level's window (files without contexts)
        add_forward_times(e, records, {"4": (10.0, 40.0)})
        return e

    none = merge_rounds([entry("none", 50.0, 40.0, 1), entry("none", 40.0, 50.0, 2), entry("none", 60.0, 40.0, 3)])
    graft = merge_rounds([entry("graft", 45.0, 45.0, 4), entry("graft", 48.0, 44.0, 5),
                          entry("graft", 54.0, 30.0, 6)])
    assert none["levels"]["4"]["rounds_plain_forward_ms"] == [40.0, 50.0, 40.0]
    assert graft["levels"]["4"]["plain_forward"] == {"ms": 44.0, "reqs": 4, "count": 25}  # the median round's
    add_ratios([none, graft])
    level = graft["levels"]["4"]
    assert level["rounds_vs_none"] == pytest.approx([0.9, 1.2, 0.9])
    assert level["rounds_vs_none_equal_speed"] == pytest.approx([0.9 * 45 / 40, 1.2 * 44 / 50, 0.9 * 30 / 40])
    assert level["vs_none_paired_equal_speed"] == pytest.approx(0.9 * 45 / 40)  # rounds 1.01 / 1.06 / 0.68
    assert level["equal_speed_by"] == "median"
    row = next(line for line in format_table([none, graft]).splitlines() if line.startswith("graft"))
    assert row.split()[4:7] == ["0.96x", "0.90x", "1.01x"]  # vs none, paired, paired at equal engine speed
    # the plain forwards, then the host time between them: none here (the forwards are a second apart)
    assert row.endswith("45.0 / 44.0 / 30.0 ms  - / - / - ms")
    few = _serve_entry("graft", {"4": 45.0}, 7)
    add_forward_times(few, [(10.0 + j, 4, 40.0, None) for j in range(5)], {"4": (10.0, 40.0)})
    assert few["levels"]["4"]["plain_forward"] is None  # too few forwards to read a speed from
    sparse = merge_rounds([few, entry("graft", 48.0, 40.0, 8), entry("graft", 54.0, 30.0, 9)])
    add_ratios([none, sparse])
    assert "vs_none_paired" in sparse["levels"]["4"] and "vs_none_paired_equal_speed" not in sparse["levels"]["4"]


def test_bench_serve_compares_plain_forwards_at_one_context():
    """Two servers whose forwards take the same time at the same context, but whose plain steps ran at different
    contexts (a gate that drafts on the short-context steps leaves the long ones plain): their medians differ, and
    the paired ratio at equal engine speed is the raw one, read at no speculation's context; a server twice as slow
    at every context counts twice as slow."""
    from vllm_treespec.tools.bench_serve import add_forward_times, add_ratios, merge_rounds

    def entry(label, rate, contexts, pid, speed=1.0):
        e = _serve_entry(label, {"8": rate}, pid)
        records = [(10.0 + j, 8, speed * (40.0 + 4.0 * c / 1000.0), c) for j, c in enumerate(contexts)]
        add_forward_times(e, records, {"8": (10.0, 100.0)})
        return e

    short, long = list(range(1000, 4000, 100)), list(range(2000, 5000, 100))
    none = merge_rounds([entry("none", 60.0, short, 1), entry("none", 60.0, short, 2)])
    graft = merge_rounds([entry("graft", 57.0, long, 3), entry("graft", 57.0, long, 4)])
    plain = graft["levels"]["8"]["plain_forward"]
    assert plain["fit"] == pytest.approx([40.0, 4.0]) and plain["context"] == pytest.approx(3450.0)
    assert plain["context_range"][0] < none["levels"]["8"]["plain_forward"]["context"] < plain["context_range"][1]
    assert plain["ms"] > none["levels"]["8"]["plain_forward"]["ms"] + 3  # the medians: 53.8 against 49.8 ms
    add_ratios([none, graft])
    level = graft["levels"]["8"]
    assert level["equal_speed_by"] == "context"
    assert level["vs_none_paired_equal_speed"] == pytest.approx(0.95)  # the same speed: the raw ratio
    slow = merge_rounds([entry("graft", 30.0, long, 5, speed=2.0), entry("graft", 30.0, long, 6, speed=2.0)])
    add_ratios([none, slow])
    assert slow["levels"]["8"]["vs_none_paired_equal_speed"] == pytest.approx(1.0)  # half the rate, twice as slow
    # plain forwards far from no speculation's context: the line would be extrapolated, so no figure
    far = merge_rounds([entry("graft", 57.0, list(range(6000, 9000, 100)), 7),
                        entry("graft", 57.0, list(range(6000, 9000, 100)), 8)])
    add_ratios([none, far])
    assert "vs_none_paired" in far["levels"]["8"] and "vs_none_paired_equal_speed" not in far["levels"]["8"]


def test_bench_serve_rejects_bad_repeats(capsys):
    from vllm_treespec.tools.bench_serve import main

    assert main(["--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_repeats_go_round_robin_and_a_failing_method_stops_alone(monkeypatch):
    """Repeat r of every method runs before repeat r+1 of any, in reverse order every other round (drift reaches
    all alike); a method that fails keeps its message, runs no more repeats and does not stop the others."""
    order = []

    def fake_repeat(model, tokenizer, result, questions, args, repeat, progress=None):
        order.append((repeat, result.spec.label))
        if result.spec.label == "bad":
            raise RuntimeError("boom")
        result.repeats.append({"c": CategoryRun(1.0, 10)})

    monkeypatch.setattr(bench, "run_repeat", fake_repeat)
    specs = bench.parse_methods("a=suffix_tree;bad=ngram_tree;b=graft")
    args = SimpleNamespace(repeats=3, turns=1)
    results = bench.run_round_robin("m", None, specs, {"c": [{"turns": ["q"]}]}, args)
    assert order == [(0, "none"), (0, "a"), (0, "bad"), (0, "b"), (1, "b"), (1, "a"), (1, "none"),
                     (2, "none"), (2, "a"), (2, "b")]
    by = {r.spec.label: r for r in results}
    assert by["bad"].status == "failed" and "boom" in by["bad"].reason and by["bad"].repeats == []
    assert len(by["a"].repeats) == len(by["none"].repeats) == 3


def test_bench_serve_summarises_the_servers_budget_trace_per_level(tmp_path):
    """A server that wrote a budget trace gets each level's summary (the steps inside that level's window) and the
    table's share of steps that verified drafts; a server without one (no speculation) gets neither."""
    from vllm_treespec.cost.trace import _encoder
    from vllm_treespec.tools.bench_serve import add_budget_trace, format_table

    steps = [{"t": 1.0, "reqs": 1, "tokens": 5, "gate": "draft", "admitted": 4, "accepted": 2},
             {"t": 2.0, "reqs": 1, "tokens": 1, "gate": "skip"},
             {"t": 11.0, "reqs": 4, "tokens": 4, "gate": "skip"}]
    path = tmp_path / "budget-graft-r1.jsonl.123"
    path.write_bytes(b"".join(_encoder.encode(s) + b"\n" for s in steps))
    entry = _serve_entry("graft", {"1": 30.0, "4": 50.0}, 1)
    add_budget_trace(entry, [path], {"1": (0.5, 2.5), "4": (10.0, 12.0)})
    assert entry["levels"]["1"]["budget"]["verifying_steps"] == 1 and entry["levels"]["1"]["budget"]["steps"] == 2
    assert entry["levels"]["4"]["budget"]["drafted"] == 0
    plain = _serve_entry("none", {"1": 20.0, "4": 50.0}, 2)
    add_budget_trace(plain, [], {"1": (0.5, 2.5)})
    assert "budget" not in plain["levels"]["1"] and "budget_trace" not in plain
    table = format_table([plain, entry])
    assert " 50% " in table and " 0% " in table


def test_bench_serve_reads_each_round_against_its_servers_own_plain_steps():
    """The table's ``vs own plain``: the median over rounds of each level's decode steps against its server's own
    plain steps (the budget trace's ``own_plain``); rounds without one are left out, and a server without a trace
    shows ``-``."""
    from vllm_treespec.tools.bench_serve import format_table, merge_rounds

    def entry(pid, ratio):
        e = _serve_entry("graft", {"4": 40.0 + pid}, pid)
        e["levels"]["4"]["budget"] = {"steps": 100, "verifying_steps": 20,
                                      "own_plain": None if ratio is None else {"ratio": ratio}}
        return e

    graft = merge_rounds([entry(1, 0.90), entry(2, 1.20), entry(3, None), entry(4, 1.00)])
    assert graft["levels"]["4"]["rounds_vs_own_plain"] == [0.90, 1.20, None, 1.00]
    none = merge_rounds([_serve_entry("none", {"4": 40.0}, 5)])
    table = format_table([none, graft]).splitlines()
    header = table[0].split("  ")
    column = [h.strip() for h in header if h.strip()].index("vs own plain")
    assert next(r for r in table if r.startswith("graft")).split()[column] == "1.00x"
    assert next(r for r in table if r.startswith("none")).split()[column] == "-"


def test_bench_reports_the_share_of_steps_that_verified_drafts():
    """Offline bench: a method whose engine wrote a budget trace gets a line per method under the table."""
    graft = bench.MethodResult(bench.parse_methods("graft")[1])
    graft.budget = [{"steps": 200, "verifying_steps": 50, "admitted_per_verifying_step": 12.0,
                     "accepted_per_verifying_step": 3.5}, {"steps": 100, "verifying_steps": 10,
                                                           "admitted_per_verifying_step": 8.0,
                                                           "accepted_per_verifying_step": 1.0}]
    none = bench.MethodResult(bench.parse_methods("graft")[0])
    text = bench.budget_lines([none, graft])
    assert "graft: steps that verified drafts 25% of 200 / 10% of 100" in text and "none" not in text
    assert "own plain steps" not in text  # traces without a plain reference
    graft.budget[0]["own_plain"] = {"ratio": 1.234, "steps": 190, "verifying_steps": 50, "plain_steps": 140}
    graft.budget[1]["own_plain"] = None
    assert "decode steps against the engine's own plain steps 1.23x" in bench.budget_lines([graft])
    assert "expected / committed" not in bench.budget_lines([graft])
    graft.budget[0]["expected_vs_realized"] = {"ratio": 1.047, "steps": 50}
    assert "their expected / committed tokens 1.05; decode steps" in bench.budget_lines([graft])
    assert "offered" not in bench.budget_lines([graft])  # a trace from before the field
    graft.budget[0].update(offering_steps=60, offered_per_offering_step=27.5, learned_nodes=140, unverified_nodes=90)
    assert ("3.50 drafts accepted per such step; 27.5 nodes offered per priced proposal, calibration taught by 140 "
            "verified and 90 left-out nodes)") in bench.budget_lines([graft])
    assert bench.budget_lines([none]) == ""


def test_bench_serve_refuses_to_send_a_prompt_twice(tmp_path, capsys):
    """Every request of a server gets a prompt of its own: a reused prompt is scored against an answer the server has
    already produced (graft's store of finished outputs then predicts it whole, ~10 tokens per chunk)."""
    from vllm_treespec.tools.bench_serve import main

    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q{i}"]}) for i in range(24)))
    assert main(["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1,2,4",
                 "--requests-per-level", "16", "--methods", "none"]) == 2
    err = capsys.readouterr().err
    assert "gives 24 prompts" in err and "sends 48 requests" in err and "more prompts" in err


def test_bench_serve_waves_send_at_least_that_many_times_the_concurrency(tmp_path, capsys):
    """``--waves N``: a level sends max(--requests-per-level, N x concurrency) fresh prompts, so a level of 16 at 16
    requests is not one wave (its time then the prefill and the slowest request); N < 1 is refused."""
    from vllm_treespec.tools.bench_serve import build_parser, level_batches, main

    args = build_parser().parse_args(["--concurrency", "1,4,16", "--waves", "3"])
    args.concurrency = [1, 4, 16]
    prompts = [f"q{i}" for i in range(100)]
    batches = level_batches(prompts, args)
    assert [(c, len(b)) for c, b in batches] == [(1, 16), (4, 16), (16, 48)]
    assert batches[2][1] == prompts[32:80]  # fresh prompts at every level
    args.waves = 1
    assert [len(b) for _, b in level_batches(prompts, args)] == [16, 16, 16]

    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q{i}"]}) for i in range(63)))
    assert main(["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1,16", "--waves", "3",
                 "--methods", "none"]) == 2
    err = capsys.readouterr().err
    assert "gives 63 prompts" in err and "--waves 3 sends 64 requests" in err  # 16 + 3 x 16
    assert main(["--model", str(tmp_path), "--prompts", str(path), "--waves", "0", "--methods", "none"]) == 2
    assert "--waves must be >= 1" in capsys.readouterr().err


def test_bench_serve_plain_starts_that_methods_servers_never_drafting(tmp_path, monkeypatch, capsys):
    """``--plain LABEL``: that method's servers get VLLM_TREESPEC_NEVER_DRAFT=1 (its verifier never drafts), the
    others do not; a label that is not a speculative method's is refused before any server starts."""
    from vllm_treespec.settings import NEVER_DRAFT_ENV
    from vllm_treespec.tools import bench_serve

    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q{i}"]}) for i in range(4)))
    common = ["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1", "--requests-per-level", "1",
              "--methods", "graft;graft_plain=graft", "--out", str(tmp_path / "out")]
    assert bench_serve.main(common + ["--plain", "none"]) == 2
    assert "--plain names ['none']" in capsys.readouterr().err
    envs = {}

    class FakeServer:
        port = 0

        def __init__(self, model, spec, args, log_path, env):
            self.label = log_path.stem.removeprefix("server-").rsplit("-r", 1)[0]  # server-LABEL-rN.log
            envs[self.label] = env

        def start(self):
            raise bench_serve.ServerStartError(f"not starting {self.label} in a unit test", None, "")

        def stop(self):
            pass

    monkeypatch.setattr(bench_serve, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda model: WordTokenizer())
    bench_serve.main(common + ["--plain", "graft_plain"])
    assert envs["graft_plain"][NEVER_DRAFT_ENV] == "1"
    assert NEVER_DRAFT_ENV not in envs["graft"] and NEVER_DRAFT_ENV not in envs["none"]
    from vllm_treespec.patches.forward_times import FORWARD_TIMES_FILE_ENV

    # every server, speculative or not, writes its plain forwards to a file of its own round
    assert {label: Path(env[FORWARD_TIMES_FILE_ENV]).name for label, env in envs.items()} == {
        label: f"forwards-{label}-r1.txt" for label in ("none", "graft", "graft_plain")}


def test_a_crashed_servers_reason_is_the_exception_its_log_ends_with():
    """A server that dies during a round is reported with the exception of its last traceback (the worker's, not the
    EngineDeadError that every later request raises), else with its log's last line."""
    from vllm_treespec.tools.bench_serve import crash_reason

    log = "\n".join([
        "(APIServer pid=1) INFO 11-30 21:00:00 [api_server.py:1] starting",
        "(Worker pid=3) ERROR 11-30 21:02:31 [multiproc_executor.py:9]   File \"x.py\", line 4, in step",
        "(Worker pid=3) ERROR 11-30 21:02:31 [multiproc_executor.py:9] IndexError: index 7 is out of bounds",
        "(APIServer pid=1) ERROR 11-30 21:02:32 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue.",
        "(APIServer pid=1) INFO 11-30 21:02:33 [launcher.py:254] [shutdown] API server: shutdown triggered",
    ])
    assert crash_reason(log) == "IndexError: index 7 is out of bounds"
    assert crash_reason("Killed\n") == "Killed"
    assert crash_reason("") == "the server exited (empty log)"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_keep_off_worker_cpus_pins_every_server_process_but_the_worker():
    """bench serve's default CPU placement: every thread of the server's processes goes to the CPUs its workers
    (processes bound to fewer CPUs than the server, as vLLM binds its CPU worker) left free, and so do the workers'
    helper threads; the workers' own threads keep theirs; a server without such a worker is left alone."""
    import psutil

    from vllm_treespec.tools.serving import keep_off_worker_cpus

    cpus = sorted(os.sched_getaffinity(0))
    worker_cpu = cpus[0]
    # a worker bound to one CPU, with a helper thread started after the binding (as torch.distributed's gloo loops)
    worker = (f"import ctypes, os, threading, time; os.sched_setaffinity(0, {{{worker_cpu}}})\n"
              "def helper():\n"
              "    ctypes.CDLL(None).prctl(15, b'gloo_tcp_loop')  # PR_SET_NAME: the thread's name in /proc\n"
              "    time.sleep(60)\n"
              "threading.Thread(target=helper, daemon=True).start(); time.sleep(0.2)\n"
              "print(1, flush=True); time.sleep(60)\n")

    def server(with_worker: bool) -> subprocess.Popen:
        code = ("import subprocess, sys, threading, time\n"
                + (f"child = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE)\n"
                   "child.stdout.readline()\n" if with_worker else "")
                + "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                "print('ready', flush=True); time.sleep(60)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
        assert proc.stdout.readline().strip() == b"ready"
        return proc

    plain, served = server(False), server(True)
    try:
        assert keep_off_worker_cpus(plain.pid) == set()
        assert set(psutil.Process(plain.pid).cpu_affinity()) == set(cpus)
        free = set(cpus) - {worker_cpu}
        assert keep_off_worker_cpus(served.pid) == free
        threads = os.listdir(f"/proc/{served.pid}/task")
        assert len(threads) >= 2 and all(os.sched_getaffinity(int(t)) == free for t in threads)
        [child] = psutil.Process(served.pid).children()
        assert child.cpu_affinity() == [worker_cpu]  # its compute thread keeps its binding, its helper does not
        helpers = [t for t in os.listdir(f"/proc/{child.pid}/task") if int(t) != child.pid]
        assert len(helpers) == 1 and os.sched_getaffinity(int(helpers[0])) == free
    finally:
        for proc in (plain, served):
            os.killpg(proc.pid, 9)
            proc.wait()


class WordTokenizer:  # one token per word of the templated prompt
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "<user> " + messages[-1]["content"] + " <assistant>"

    def __call__(self, text):
        return SimpleNamespace(input_ids=text.split())


def test_questions_longer_than_the_context_are_refused_before_any_engine_starts():
    questions = {"sharegpt": [{"question_id": "a", "category": "sharegpt", "turns": ["one two"]},
                              {"question_id": "b", "category": "sharegpt", "turns": [" ".join(["w"] * 10)]}]}
    bench.check_prompt_lengths(WordTokenizer(), questions, max_model_len=13)  # 12 tokens leave one to generate
    with pytest.raises(BenchError, match=r"--prompts: 1 question\(s\) do not fit --max-model-len 12 .*"
                                         r"sharegpt 'b' \(12 tokens\).*raise --max-model-len"):
        bench.check_prompt_lengths(WordTokenizer(), questions, max_model_len=12)
    bench.check_prompt_lengths(WordTokenizer(), questions, max_model_len=16, output_tokens=4)
    with pytest.raises(BenchError, match=r"do not fit --max-model-len 15 with 4 output tokens: sharegpt 'b'"):
        bench.check_prompt_lengths(WordTokenizer(), questions, max_model_len=15, output_tokens=4)
    questions["sharegpt"][1]["position"] = "sharegpt[7766]"  # a sliced set's question names its place in the set
    with pytest.raises(BenchError, match=r"sharegpt 'b' at sharegpt\[7766\] \(12 tokens\)"):
        bench.check_prompt_lengths(WordTokenizer(), questions, max_model_len=12)


def test_bench_serve_refuses_prompts_that_leave_no_room_for_max_tokens(tmp_path, monkeypatch, capsys):
    """A server answers a prompt that cannot take ``--max-tokens`` more with an error: such prompts are refused
    before any server starts, named, with the fix."""
    from vllm_treespec.tools import bench_serve

    path = tmp_path / "q.jsonl"
    turns = ["short one", " ".join(["w"] * 40), "short two"]
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [t]})
                              for i, t in enumerate(turns)))
    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda model: WordTokenizer())
    started = []
    monkeypatch.setattr(bench_serve, "ServerProcess", lambda *a, **k: started.append(a))
    common = ["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1", "--requests-per-level", "3",
              "--methods", "none", "--out", str(tmp_path / "out")]
    assert bench_serve.main(common + ["--max-model-len", "64", "--max-tokens", "32"]) == 2
    err = capsys.readouterr().err
    assert "do not fit --max-model-len 64 with 32 output tokens: a 1 (42 tokens)" in err
    assert "raise --max-model-len" in err and not started and not (tmp_path / "out").exists()


def test_bench_serve_interleave_runs_every_server_level_by_level_in_turn(tmp_path, monkeypatch):
    """``--interleave``: each round starts every method's server before any level runs, then runs each level on
    every server in turn, the order reversed at every level and every round; a server that fails to start is
    reported failed and the others still run; one that crashes is stopped at its next turn (a worker outliving its
    API server would slow the others) and its method reported failed; every server is stopped at the round's end,
    before the next round's start; with ``--repeats`` the rounds are paired as without it."""
    from vllm_treespec.tools import bench_serve

    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q{i}"]}) for i in range(8)))
    events, servers = [], {}

    class FakeServer:
        def __init__(self, model, spec, args, log_path, env):
            self.label = log_path.stem.removeprefix("server-").rsplit("-r", 1)[0]  # server-LABEL-rN.log
            self.port = 8000 + len(events)
            self.url = f"http://127.0.0.1:{self.label}"
            self.process = SimpleNamespace(pid=1)
            self.running = self.crashed = False
            self.crashes = self.label == "crashy" and "crashy" not in servers  # the first round's dies in a level
            servers[self.label] = self

        def start(self):
            if self.label == "broken":
                raise bench_serve.ServerStartError("broken does not start", None, "")
            events.append(("start", self.label))
            self.running = True
            return self

        def alive(self):
            return self.running and not self.crashed

        def rss_by_process(self):
            return {1: ("python", 1 << 30)}

        def log_tail(self, chars=6000):
            return "(Worker pid=3) ERROR [core.py:1] RuntimeError: the worker died\n(APIServer pid=1) INFO shut down\n"

        def stop(self):
            if self.running:
                events.append(("stop", self.label))
            self.running = False

    async def fake_level(url, prompts, concurrency, max_tokens, temperature):
        label = url.rsplit(":", 1)[1]
        if prompts[0] != bench_serve.WARMUP_PROMPT:
            events.append((concurrency, label, tuple(prompts)))
            servers[label].crashed = servers[label].crashes
        reply = SimpleNamespace(ok=True, finish_reason="stop", completion_tokens=10, first_token_s=0.1, elapsed_s=1.0,
                                chunk_gaps_s=[0.1], chunks=5, status=200, error=None, body=None, started=0.0,
                                usage=None)
        return [reply] * len(prompts), 2.0 if label == "none" else 1.0

    monkeypatch.setattr(bench_serve, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serve, "run_level", fake_level)
    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda model: WordTokenizer())
    monkeypatch.setattr(bench_serve, "plot", lambda methods, out_dir: out_dir / "serve.png")
    monkeypatch.setattr(bench_serve, "available_memory_bytes", lambda: 64 << 30)  # four servers fit
    out = tmp_path / "out"
    code = bench_serve.main(["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1,2",
                             "--requests-per-level", "2", "--methods", "graft;crashy=graft;broken=graft",
                             "--interleave", "--repeats", "2", "--cpu-affinity", "os", "--out", str(out)])
    assert code == 1  # broken failed, crashy crashed in a round
    first, second = ("q0", "q1"), ("q2", "q3")
    assert events == [
        ("start", "none"), ("start", "graft"), ("start", "crashy"),
        (1, "none", first), (1, "graft", first), (1, "crashy", first),
        ("stop", "crashy"), (2, "graft", second), (2, "none", second),  # crashy's turn: stopped, not run
        ("stop", "none"), ("stop", "graft"),
        ("start", "crashy"), ("start", "graft"), ("start", "none"),  # round 2: the round's order reversed
        (1, "crashy", first), (1, "graft", first), (1, "none", first),
        (2, "none", second), (2, "graft", second), (2, "crashy", second),
        ("stop", "crashy"), ("stop", "graft"), ("stop", "none")]
    report = json.loads((out / "results.json").read_text())
    by = {m["label"]: m for m in report["methods"]}
    assert by["broken"]["status"] == "failed" and "does not start" in by["broken"]["reason"]
    # crashy died in round 1: its figures are round 2's, and round 1's crash is reported with its own log
    assert by["crashy"]["status"] == "ok" and by["crashy"]["rounds"] == 1 and by["crashy"]["round_numbers"] == [2]
    (failure,) = by["crashy"]["failed_rounds"]
    assert failure["round"] == 1 and failure["status"] == "crashed"
    assert failure["reason"] == "RuntimeError: the worker died" and failure["log"].endswith("server-crashy-r1.log")
    assert "crashy: round 1 crashed: RuntimeError: the worker died" in (out / "table.txt").read_text()
    assert by["graft"]["status"] == by["none"]["status"] == "ok" and by["graft"]["rounds"] == 2
    for level in ("1", "2"):
        assert by["graft"]["levels"][level]["rounds_vs_none"] == [2.0, 2.0]
        assert by["graft"]["levels"][level]["vs_none_paired"] == 2.0
    assert by["graft"]["rss"]["max_mib"] == 1024


def test_rss_sampler_counts_the_servers_own_growth_and_reports_helpers_apart():
    from vllm_treespec.tools.serving import RssSampler

    mib = 1 << 20
    api, worker = (1, ("python", 900 * mib)), (2, ("VLLM::Worker", 2500 * mib))
    timeline = [
        dict([api, worker]),
        dict([api, worker, (7, ("cc1plus", 2600 * mib))]),  # inductor compiling a sampler op: not the server's
        dict([api, (2, ("VLLM::Worker", 2700 * mib))]),  # the worker's own growth counts
        dict([api, (2, ("VLLM::Worker", 2600 * mib))]),
    ]
    sampler = RssSampler(SimpleNamespace())
    sampler.samples = list(enumerate(timeline))
    summary = sampler.summary()
    assert summary["samples"] == 4
    assert (summary["start_mib"], summary["max_mib"], summary["end_mib"]) == (3400, 3600, 3500)
    assert summary["mid_mib"] == 3600
    assert summary["helpers_max_mib"] == 2600 and summary["helpers"] == ["cc1plus"]
    empty = RssSampler(SimpleNamespace())
    empty.samples = [(0.0, {})]
    assert empty.summary() == {"samples": 0}


SMOLLM2_LIKE = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                "torch_dtype": "bfloat16"}


def test_a_servers_kv_cache_is_what_the_busiest_level_needs(tmp_path):
    """K/V bytes a token from the model's config (GQA heads, head_dim from hidden_size), at the server's dtype or
    the model's own for "auto"; whole GiB for the busiest level's requests at once, at least one request of
    max_model_len, at most the tools' default of 4 GiB."""
    from vllm_treespec.tools.server_memory import kv_bytes_per_token, kv_cache_gib

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_LIKE))
    assert kv_bytes_per_token(tmp_path, "float32") == 30 * 2 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(tmp_path, "bfloat16") == kv_bytes_per_token(tmp_path, "auto") == 23040
    assert kv_bytes_per_token(tmp_path / "missing", "float32") is None
    # 16 requests of 1000 + 128 tokens (+ 64 draft slots each) in fp32: 0.88 GiB, 1.02 with the margin
    assert kv_cache_gib(46080, 16, 1000, 128, 4096) == 2
    assert kv_cache_gib(23040, 16, 1000, 128, 4096) == 1
    assert kv_cache_gib(46080, 1, 10, 16, 4096) == 1  # one max_model_len request: 0.18 GiB
    assert kv_cache_gib(46080, 64, 3000, 1000, 4096) == 4  # never above the default


def test_bench_serve_interleave_sizes_each_servers_kv_cache_and_refuses_servers_that_do_not_fit(
        tmp_path, monkeypatch, capsys):
    """``--interleave``: every server gets VLLM_CPU_KVCACHE_SPACE = the KV cache its busiest level needs (or the
    user's value); servers that would not fit in the available memory together are refused before any starts, with
    the numbers and the fixes, and nothing is written."""
    from vllm_treespec.tools import bench_serve

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_LIKE))
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q{i}"]}) for i in range(4)))
    envs = {}

    class FakeServer:
        port = 0

        def __init__(self, model, spec, args, log_path, env):
            self.label = log_path.stem.removeprefix("server-").rsplit("-r", 1)[0]
            envs[self.label] = env

        def start(self):
            raise bench_serve.ServerStartError(f"not starting {self.label} in a unit test", None, "")

        def stop(self):
            pass

    monkeypatch.setattr(bench_serve, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda model: WordTokenizer())
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    common = ["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1,2", "--requests-per-level", "1",
              "--methods", "ngram;graft;glance=graft", "--out", str(tmp_path / "out"), "--cpu-affinity", "os"]
    # four servers of 1 GiB KV cache and ~2.5 GiB besides, 1 GiB spare: 15 GiB
    monkeypatch.setattr(bench_serve, "available_memory_bytes", lambda: 14 << 30)
    assert bench_serve.main(common + ["--interleave"]) == 2
    err = capsys.readouterr().err
    assert "--interleave keeps 4 servers up at once (none, ngram, graft, glance), each with 1 GiB of KV cache" in err
    assert "~15.0 GiB" in err and "14.0 GiB available, room for 3" in err and "drop --interleave" in err
    assert not envs and not (tmp_path / "out").exists()

    monkeypatch.setattr(bench_serve, "available_memory_bytes", lambda: 15 << 30)
    bench_serve.main(common + ["--interleave"])
    assert {label: env["VLLM_CPU_KVCACHE_SPACE"] for label, env in envs.items()} == {
        "none": "1", "ngram": "1", "graft": "1", "glance": "1"}
    assert json.loads((tmp_path / "out" / "results.json").read_text())["config"]["kv_cache_gib"] == 1

    envs.clear()  # the user's size is kept, and checked
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert bench_serve.main(common + ["--interleave"]) == 2
    assert "each with 3 GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)" in capsys.readouterr().err and not envs
    monkeypatch.setattr(bench_serve, "available_memory_bytes", lambda: 64 << 30)
    bench_serve.main(common + ["--interleave"])
    assert {env["VLLM_CPU_KVCACHE_SPACE"] for env in envs.values()} == {"3"}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    assert bench_serve.main(common + ["--interleave"]) == 2
    assert "VLLM_CPU_KVCACHE_SPACE='1.5': must be whole GiB" in capsys.readouterr().err

    envs.clear()  # one server at a time: the servers' own default, no check
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.setattr(bench_serve, "available_memory_bytes", lambda: 1 << 30)
    bench_serve.main(common)
    assert envs and all("VLLM_CPU_KVCACHE_SPACE" not in env for env in envs.values())


def test_bench_serve_pairs_every_tree_method_with_vllms_best_method_at_each_level():
    """``vs_builtin``: each level's rounds against those of whichever of vLLM's own methods in the run did best at
    that level against no speculation (paired), the median of the round-by-round ratios; in the table as e.g.
    ``2.00x ngram``. vLLM's methods and no speculation get none; a run without vLLM's methods adds nothing."""
    from vllm_treespec.tools.bench_serve import add_builtin_ratios, add_ratios, format_table, merge_rounds

    def method(label, rounds, name=None):
        merged = merge_rounds([_serve_entry(label, rates, pid) for pid, rates in enumerate(rounds)])
        merged["method"] = name or label
        return merged

    none = method("none", [{"1": 10.0, "4": 40.0}] * 3)
    ngram = method("ngram", [{"1": 15.0, "4": 40.0}, {"1": 12.0, "4": 44.0}, {"1": 14.0, "4": 36.0}])
    suffix = method("suffix", [{"1": 11.0, "4": 48.0}] * 3)
    graft = method("graft", [{"1": 30.0, "4": 48.0}, {"1": 24.0, "4": 36.0}, {"1": 21.0, "4": 60.0}])
    glance = method("glance", [{"1": 30.0, "4": 48.0}] * 3, name="graft")
    methods = [none, ngram, suffix, graft, glance]
    add_ratios(methods)
    add_builtin_ratios(methods)
    # at 1 request ngram did best (1.4x paired against suffix's 1.1x), at 4 suffix (1.2x against 1.0x)
    assert graft["levels"]["1"]["vs_builtin"] == {"label": "ngram", "rounds": pytest.approx([2.0, 2.0, 1.5]),
                                                  "paired": pytest.approx(2.0)}
    assert graft["levels"]["4"]["vs_builtin"]["label"] == "suffix"
    assert graft["levels"]["4"]["vs_builtin"]["paired"] == pytest.approx(1.0)  # rounds 1.0 / 0.75 / 1.25
    assert glance["levels"]["4"]["vs_builtin"]["paired"] == pytest.approx(1.0)
    assert all("vs_builtin" not in s for m in (none, ngram, suffix) for s in m["levels"].values())
    assert "2.00x ngram" in format_table(methods)
    alone = [method("none", [{"1": 10.0}] * 2), method("graft", [{"1": 12.0}] * 2)]
    add_ratios(alone)
    add_builtin_ratios(alone)
    assert "vs_builtin" not in alone[1]["levels"]["1"]


def _healthy_fake_servers(monkeypatch, tmp_path, on_level, seconds=lambda label: 1.0, on_warm_up=None):
    """``bench serve`` against servers that always start and stay up, each level answered at once: ``on_level(
    concurrency, label)`` is called for every level but the warm-ups (``on_warm_up(label)`` for those), and a level
    of server ``label`` reports ``seconds(label)`` of wall time. Returns the path of 8 one-turn prompts."""
    from vllm_treespec.tools import bench_serve

    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps({"question_id": i, "category": "a", "turns": [f"q{i}"]}) for i in range(8)))

    class FakeServer:
        def __init__(self, model, spec, args, log_path, env):
            self.label = log_path.stem.removeprefix("server-").rsplit("-r", 1)[0]
            self.port, self.url = 0, f"http://127.0.0.1:{self.label}"
            self.process = SimpleNamespace(pid=1)

        def start(self):
            return self

        def alive(self):
            return True

        def rss_by_process(self):
            return {}

        def stop(self):
            pass

    async def fake_level(url, prompts, concurrency, max_tokens, temperature):
        label = url.rsplit(":", 1)[1]
        if prompts[0] != bench_serve.WARMUP_PROMPT:
            on_level(concurrency, label)
        elif on_warm_up is not None:
            on_warm_up(label)
        reply = SimpleNamespace(ok=True, finish_reason="stop", completion_tokens=10, first_token_s=0.1, elapsed_s=1.0,
                                chunk_gaps_s=[0.1], chunks=5, status=200, error=None, body=None, started=0.0,
                                usage=None)
        return [reply] * len(prompts), seconds(label)

    monkeypatch.setattr(bench_serve, "ServerProcess", FakeServer)
    monkeypatch.setattr(bench_serve, "run_level", fake_level)
    monkeypatch.setattr(bench_serve, "load_tokenizer", lambda model: WordTokenizer())
    monkeypatch.setattr(bench_serve, "plot", lambda methods, out_dir: out_dir / "serve.png")
    monkeypatch.setattr(bench_serve, "available_memory_bytes", lambda: 64 << 30)
    return path


def test_bench_serve_turn_pause_waits_only_between_different_servers(tmp_path, monkeypatch):
    """``--interleave --turn-pause S`` (default TURN_PAUSE_S): a server whose turn follows another server's (its level or its warm-up)
    waits S seconds first; one that runs again right after itself (the reversed order's first of a level) does not."""
    from vllm_treespec.tools import bench_serve

    events = []
    path = _healthy_fake_servers(monkeypatch, tmp_path, lambda concurrency, label: events.append((concurrency, label)),
                                 on_warm_up=lambda label: events.append(("warm-up", label)))
    monkeypatch.setattr(bench_serve.time, "sleep", lambda seconds: events.append(("pause", seconds)))
    common = ["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1,2", "--requests-per-level", "2",
              "--methods", "graft", "--interleave", "--cpu-affinity", "os", "--out", str(tmp_path / "out")]
    bench_serve.main(common + ["--turn-pause", "1.5"])
    # warm-ups: none, graft (after none's); level 1: none (after graft's warm-up), graft; level 2 reversed: graft
    # (itself), none
    warm_ups = [("warm-up", "none"), ("pause", 1.5), ("warm-up", "graft")]
    assert events == warm_ups + [("pause", 1.5), (1, "none"), ("pause", 1.5), (1, "graft"), (2, "graft"),
                                 ("pause", 1.5), (2, "none")]
    events.clear()
    bench_serve.main(common + ["--turn-pause", "0"])
    assert events == [("warm-up", "none"), ("warm-up", "graft"), (1, "none"), (1, "graft"), (2, "graft"), (2, "none")]
    events.clear()
    bench_serve.main(common)  # paused by default
    pause = ("pause", bench_serve.TURN_PAUSE_S)
    assert events == [("warm-up", "none"), pause, ("warm-up", "graft"), pause, (1, "none"), pause, (1, "graft"),
                      (2, "graft"), pause, (2, "none")]


def test_bench_serve_writes_each_finished_round_before_the_next(tmp_path, monkeypatch):
    """results.json and table.txt are written after every round: a run stopped in its third round (a session's
    time; three rounds of five levels took ~2 hours on a slow CPU) keeps its first two, marked partial."""
    from vllm_treespec.tools import bench_serve

    levels_run = []

    def on_level(concurrency, label):
        levels_run.append(concurrency)
        if len(levels_run) > 8:  # two rounds of 2 levels x 2 servers, then the third round is stopped
            raise KeyboardInterrupt

    path = _healthy_fake_servers(monkeypatch, tmp_path, on_level, seconds=lambda label: 2.0 if label == "none" else 1.0)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        bench_serve.main(["--model", str(tmp_path), "--prompts", str(path), "--concurrency", "1,2",
                          "--requests-per-level", "2", "--methods", "graft", "--interleave", "--repeats", "3",
                          "--turn-pause", "0", "--cpu-affinity", "os", "--out", str(out)])
    report = json.loads((out / "results.json").read_text())
    assert report["rounds_completed"] == 2
    by = {m["label"]: m for m in report["methods"]}
    assert by["graft"]["rounds"] == by["none"]["rounds"] == 2
    assert by["graft"]["levels"]["1"]["rounds_vs_none"] == [2.0, 2.0]
    assert (out / "table.txt").read_text().startswith("partial: 2 of 3 rounds\n")


def test_bench_serve_keeps_every_requests_own_timings_in_the_order_sent():
    from vllm_treespec.tools.bench_serve import level_stats
    from vllm_treespec.tools.serving import Reply

    def reply(started, ttft, elapsed, tokens, prompt_tokens, status=200, finish="stop"):
        r = Reply()
        r.status, r.finish_reason, r.started, r.first_token_s, r.elapsed_s = status, finish, started, ttft, elapsed
        r.usage, r.chunks = {"completion_tokens": tokens, "prompt_tokens": prompt_tokens}, tokens // 2
        return r

    replies = [reply(100.0, 0.2, 3.0, 64, 40), reply(103.0, 2.5, 6.0, 64, 900), reply(109.0, None, 0.1, 0, 12, 500)]
    stats = level_stats(replies, 9.1)
    assert stats["ttft_s"]["p50"] == pytest.approx(1.35)  # the percentiles hide which request waited
    records = stats["replies"]
    assert [r["sent_s"] for r in records] == [0.0, 3.0, 9.0]
    assert [r["ttft_s"] for r in records] == [0.2, 2.5, None]
    assert [r["prompt_tokens"] for r in records] == [40, 900, 12]
    assert [r["ok"] for r in records] == [True, True, False]
    assert records[1]["elapsed_s"] == 6.0 and records[1]["output_tokens"] == 64 and records[1]["chunks"] == 32
    json.dumps(stats)  # results.json takes it as it is


def test_cpu_use_names_the_servers_processes_the_load_generator_and_the_other_servers():
    """As `bench serve` records each level: a spinning process under the server counts by its name, one under
    another server as "other", and the cores' busy seconds cover them."""
    import psutil

    from vllm_treespec.tools.serving import CpuUse

    spin = "import time\nend = time.monotonic() + {}\nwhile time.monotonic() < end: pass\n"
    server = subprocess.Popen([sys.executable, "-c", spin.format(1.5)])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    name = psutil.Process(server.pid).name()  # both children run this interpreter
    try:
        cpu = CpuUse(server.pid).start()
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # the load generator's own work
            pass
        used = cpu.stop()
    finally:
        for p in (server, other):
            p.kill()
            p.wait()
    assert used["processes"][name] > 0.1  # the server's spinning, a share of a core even on a busy machine
    assert used["processes"]["load generator"] > 0.1
    assert used["processes"].get(f"other {name}", 0.0) < 0.1  # the sleeping neighbour: counted apart, idle
    assert len(used["core_busy_s"]) == psutil.cpu_count() and sum(used["core_busy_s"]) > 0.2
    assert used["wall_s"] == pytest.approx(0.6, abs=0.5)


def test_client_priority_is_real_time_for_the_calling_thread_only_and_restored(monkeypatch):
    """The load generator's event loop runs at SCHED_FIFO with reset-on-fork (no server or thread it starts
    inherits it) and gets its old policy back; without the permission it says so and runs as it was."""
    from vllm_treespec.tools import serving

    calls = []
    monkeypatch.setattr(serving.os, "sched_getscheduler", lambda pid: serving.os.SCHED_OTHER)
    monkeypatch.setattr(serving.os, "sched_getparam", lambda pid: serving.os.sched_param(0))
    monkeypatch.setattr(serving.os, "sched_setscheduler", lambda pid, policy, param: calls.append(
        (pid, policy, param.sched_priority)))
    with serving.client_priority() as priority:
        assert priority == "fifo"
        assert calls == [(0, serving.os.SCHED_FIFO | serving.os.SCHED_RESET_ON_FORK, 1)]
    assert calls[-1] == (0, serving.os.SCHED_OTHER, 0)

    def refuse(pid, policy, param):
        raise PermissionError("Operation not permitted")

    monkeypatch.setattr(serving.os, "sched_setscheduler", refuse)
    with serving.client_priority() as priority:
        assert priority == "normal"


def test_client_priority_on_this_machine_leaves_the_thread_as_it_found_it():
    import threading

    from vllm_treespec.tools.serving import client_priority

    before = os.sched_getscheduler(0)
    seen = {}
    with client_priority() as priority:
        seen["inside"] = os.sched_getscheduler(0)
        worker = threading.Thread(target=lambda: seen.setdefault("thread", os.sched_getscheduler(0)))
        worker.start()
        worker.join()
    assert os.sched_getscheduler(0) == before
    if priority == "fifo":  # permitted here (root): real time inside, and a thread started there is not
        assert seen["inside"] & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO
        assert seen["thread"] == os.SCHED_OTHER
    else:
        assert seen["inside"] == before
