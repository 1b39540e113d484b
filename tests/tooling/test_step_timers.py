"""The step timers (vllm_treespec.patches.step_timers): what they add up (the garbage collector's pauses too), the
snapshots a server's processes write, a level's window read back from them, and bench serve's and step_split's
readings of it."""

from __future__ import annotations

import gc
import io
import json
import sys
import time
import types

import pytest
from script_helpers import load_script

from vllm_treespec.patches import step_timers
from vllm_treespec.tools import bench_serve


@pytest.fixture
def timed_module(monkeypatch):
    module = types.ModuleType("fake_engine_for_timers")

    class Engine:
        def step(self, tokens):
            return tokens * 2

        def fail(self):
            raise ValueError("the step failed")

    module.Engine = Engine
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_timer_adds_each_call_and_passes_results_and_errors_through(timed_module):
    timers = step_timers.StepTimers(entries=[
        (timed_module.__name__, "Engine", "step"), (timed_module.__name__, "Engine", "fail"),
        (timed_module.__name__, "Engine", "missing"),  # a renamed function: left untimed, nothing else
        ("vllm_treespec.not_imported_by_anyone", "Thing", "run"),  # this project's module, not imported: skipped
    ])
    timers.install()
    timers.install()  # idempotent: a second install does not time twice
    engine = timed_module.Engine()
    assert engine.step(3) == 6 and engine.step(4) == 8
    with pytest.raises(ValueError, match="the step failed"):
        engine.fail()
    gc.collect()  # a full collection: timed as the garbage collector's (automatic ones may add younger ones)
    full = timers.calls["gc.generation2"]
    timers.uninstall_gc()
    gc.collect()  # not any more
    assert full >= 1 and timers.calls["gc.generation2"] == full
    assert {key: n for key, n in timers.calls.items() if not key.startswith("gc.")} == {"Engine.step": 2,
                                                                                        "Engine.fail": 1}
    assert set(timers.totals) == set(timers.calls) and all(s >= 0 for s in timers.totals.values())
    assert "vllm_treespec.not_imported_by_anyone" not in sys.modules


def test_a_server_process_appends_snapshots_that_a_window_reads_back(timed_module, monkeypatch, tmp_path):
    monkeypatch.setattr(step_timers, "SNAPSHOT_SECONDS", 0.0)  # a snapshot at every call
    sink = io.StringIO()
    timers = step_timers.StepTimers(sink=sink, entries=[(timed_module.__name__, "Engine", "step")])
    timers.install()
    engine = timed_module.Engine()
    for tokens in range(3):
        engine.step(tokens)
    timers.uninstall_gc()
    snapshots = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [s["calls"]["Engine.step"] for s in snapshots] == [1, 2, 3]
    assert 0 < snapshots[0]["minor_faults"] <= snapshots[-1]["minor_faults"]  # the process's, so far
    assert snapshots[0]["time"] <= snapshots[-1]["time"]


def _snapshot(time, seconds, calls, minor_faults=None):
    record = {"time": time, "seconds": seconds, "calls": calls}
    if minor_faults is not None:
        record["minor_faults"] = minor_faults
    return json.dumps(record) + "\n"


def test_a_window_is_each_process_s_last_snapshot_before_its_end_less_its_last_before_its_start(tmp_path):
    step = step_timers.STEP_KEY
    worker = tmp_path / "timers.jsonl.101"
    worker.write_text(_snapshot(10.0, {step: 1.0}, {step: 10}, minor_faults=100)
                      + _snapshot(20.0, {step: 3.0, "GPUModelRunner._sample": 0.5},
                                  {step: 50, "GPUModelRunner._sample": 40}, minor_faults=900)
                      + "{torn line\n"
                      + _snapshot(30.0, {step: 9.0}, {step: 200}))
    engine_core = tmp_path / "timers.jsonl.100"
    engine_core.write_text(_snapshot(12.0, {"Scheduler.schedule": 0.2}, {"Scheduler.schedule": 20})
                           + _snapshot(21.0, {"Scheduler.schedule": 0.6}, {"Scheduler.schedule": 60}))
    api_server = tmp_path / "timers.jsonl.99"
    api_server.write_text("")  # a process that times nothing
    seconds, calls = step_timers.window_totals([worker, engine_core, api_server], 15.0, 25.0)
    assert calls == {step: 40, "GPUModelRunner._sample": 40, "Scheduler.schedule": 40, step_timers.FAULTS_KEY: 800}
    assert seconds == pytest.approx({step: 2.0, "GPUModelRunner._sample": 0.5, "Scheduler.schedule": 0.4})
    per_step = step_timers.per_step(seconds, calls)
    assert per_step == pytest.approx({step: 50.0, "GPUModelRunner._sample": 12.5, "Scheduler.schedule": 10.0})
    assert list(per_step) == [step, "GPUModelRunner._sample", "Scheduler.schedule"]  # dearest first
    assert step_timers.per_step({"Scheduler.schedule": 0.1}, {"Scheduler.schedule": 3}) is None  # no steps counted


def test_bench_serve_reads_each_level_s_split_and_step_split_prints_it_beside_no_speculation(tmp_path, capsys):
    step = step_timers.STEP_KEY
    files = {}
    for label, sample_seconds in (("none", 0.4), ("graft", 0.9)):
        path = tmp_path / f"timers-{label}-r1.jsonl.1"
        path.write_text(_snapshot(1.0, {step: 0.0}, {step: 0}, minor_faults=0)
                        + _snapshot(5.0, {step: 5.0, "GPUModelRunner._sample": sample_seconds},
                                    {step: 100, "GPUModelRunner._sample": 100},
                                    minor_faults=round(sample_seconds * 1000)))
        files[label] = [path]
    methods = []
    for label in ("none", "graft"):
        entry = {"label": label, "status": "ok", "levels": {"16": {}}}
        bench_serve.add_step_timers(entry, files[label], {"16": (0.5, 6.0)})
        assert entry["levels"]["16"]["step_timers"]["steps"] == 100
        assert entry["levels"]["16"]["step_timers"]["minor_faults_per_step"] == {"none": 4, "graft": 9}[label]
        entry["levels"]["16"]["rounds_step_timers"] = [entry["levels"]["16"]["step_timers"]]
        methods.append(entry)
    untimed = {"label": "x", "status": "ok", "levels": {"16": {}}}
    bench_serve.add_step_timers(untimed, [], {"16": (0.5, 6.0)})
    assert "step_timers" not in untimed["levels"]["16"]

    lines = load_script("step_split").served_split({"methods": methods})
    assert lines[0].startswith("== 16 requests") and "none 100; graft 100" in lines[0]
    assert lines[1] == "  minor page faults per step (rounds): none 4; graft 9"
    sample = next(line for line in lines if "GPUModelRunner._sample" in line).split()
    assert sample[1:] == ["4.000", "9.000", "+5.000"]  # ms per step: none, graft, graft - none


def test_each_call_is_counted_by_its_time_and_a_window_reads_the_spread_back(timed_module, monkeypatch, tmp_path):
    assert [step_timers.duration_bucket(s) for s in (0.0, 0.5e-6, 1e-6, 3e-6, 1e-3)] == [0, 0, 1, 2, 10]
    monkeypatch.setattr(step_timers, "SNAPSHOT_SECONDS", 0.0)
    sink = io.StringIO()
    timers = step_timers.StepTimers(sink=sink, entries=[(timed_module.__name__, "Engine", "step")])
    timers.install()
    timers.uninstall_gc()
    timed_module.Engine().step(1)
    assert sum(timers.durations["Engine.step"].values()) == 1
    assert "durations" in json.loads(sink.getvalue().splitlines()[-1])

    path = tmp_path / "timers-graft-r1.jsonl.7"
    lines = [{"time": 2.0, "seconds": {}, "calls": {}, "durations": {"Sampler.forward": {"9": 5, "11": 1}}},
             {"time": 4.0, "seconds": {}, "calls": {}, "durations": {"Sampler.forward": {"9": 105, "11": 4}}}]
    path.write_text(_snapshot(1.0, {}, {}) + "".join(json.dumps(line) + "\n" for line in lines))
    assert step_timers.window_durations([path], "Sampler.forward", 3.0, 5.0) == {9: 100, 11: 3}
    assert step_timers.window_durations([path], "Sampler.forward", 0.0, 3.0) == {9: 5, 11: 1}
    results = {"methods": [{"label": "graft", "status": "ok", "round_numbers": [1],
                            "levels": {"16": {"rounds_window": [[3.0, 5.0]]}}}]}
    lines = load_script("step_split").served_durations(tmp_path, results, "Sampler.forward")
    assert lines == ["== 16 requests: Sampler.forward, calls by time (rounds)",
                     "  graft r1: <0.512 ms: 100, <2.048 ms: 3"]


def test_the_step_s_big_functions_count_their_time_off_a_cpu_and_a_window_reads_it_back(timed_module, monkeypatch,
                                                                                        tmp_path):
    class Waits:
        def sleep(self):  # off a CPU: waits
            time.sleep(0.05)

        def spin(self):  # on a CPU
            until = time.perf_counter() + 0.05
            while time.perf_counter() < until:
                pass

    timed_module.Waits = Waits
    monkeypatch.setattr(step_timers, "OFF_CPU_TIMED", frozenset({"Waits.sleep", "Waits.spin"}))
    monkeypatch.setattr(step_timers, "SNAPSHOT_SECONDS", 0.0)
    sink = io.StringIO()
    timers = step_timers.StepTimers(sink=sink, entries=[(timed_module.__name__, "Waits", "sleep"),
                                                        (timed_module.__name__, "Waits", "spin"),
                                                        (timed_module.__name__, "Engine", "step")])
    timers.install()
    timers.uninstall_gc()
    waits = timed_module.Waits()
    waits.sleep()
    waits.spin()
    assert timed_module.Engine().step(2) == 4
    assert timers.off_cpu["Waits.sleep"][0] >= 0.04
    assert timers.off_cpu["Waits.spin"][0] < 0.03  # another process may preempt it: not nothing, but not all
    assert "Engine.step" not in timers.off_cpu and timers.calls["Waits.sleep"] == 1

    path = tmp_path / "timers-graft-r1.jsonl.7"
    step = step_timers.STEP_KEY
    path.write_text(_snapshot(1.0, {step: 0.0}, {step: 0})
                    + json.dumps({"time": 4.0, "seconds": {step: 2.0, "Sampler.forward": 0.04},
                                  "calls": {step: 100, "Sampler.forward": 100},
                                  "off_cpu": {"Sampler.forward": [0.01, 30]}}) + "\n")
    seconds, calls = step_timers.window_totals([path], 0.5, 5.0)
    assert seconds["Sampler.forward off-CPU"] == pytest.approx(0.01)
    assert calls["Sampler.forward off-CPU"] == 100 and calls["Sampler.forward switches"] == 30
    entry = {"label": "graft", "status": "ok", "levels": {"16": {}}}
    bench_serve.add_step_timers(entry, [path], {"16": (0.5, 5.0)})
    timed = entry["levels"]["16"]["step_timers"]
    assert timed["ms_per_step"]["Sampler.forward off-CPU"] == pytest.approx(0.1)
    assert timed["switches_per_step"] == {"Sampler.forward": 0.3}
    entry["levels"]["16"]["rounds_step_timers"] = [timed]
    lines = load_script("step_split").served_split({"methods": [entry]})
    assert "  involuntary switches per step in Sampler.forward (median over rounds): graft 0.300" in lines
    assert any(line.split()[:3] == ["Sampler.forward", "off-CPU", "0.100"] for line in lines)
