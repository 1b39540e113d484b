"""The benchmark's forward timer (vllm_treespec/patches/forward_times.py): plain decode forwards only, on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_treespec.cost import trace
from vllm_treespec.patches import forward_times


class FakeRunner:
    def __init__(self, device: str, num_reqs: int) -> None:
        self.device = torch.device(device)
        self.input_batch = SimpleNamespace(num_reqs=num_reqs)


def _forward(runner, tokens, clock, seconds):
    def original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs):
        clock.append(clock[-1] + seconds)  # the forward's duration, read by the next perf_counter
        return input_ids
    return forward_times.model_forward(original, runner, input_ids=torch.zeros(tokens, dtype=torch.long),
                                       positions=None)


def test_only_plain_decode_forwards_on_cpu_are_timed_by_requests(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(forward_times.time, "perf_counter", lambda: clock[-1])
    forward_times.read_forward_times(reset=True)
    one, two = FakeRunner("cpu", 1), FakeRunner("cpu", 2)
    for seconds in (0.030, 0.050, 0.040):
        _forward(one, 1, clock, seconds)  # plain steps of one request
    _forward(one, 9, clock, 0.500)  # a tree step: 8 drafts verified
    _forward(two, 2, clock, 0.060)  # plain, two requests
    _forward(two, 3, clock, 0.070)  # one of them verifies a draft
    _forward(FakeRunner("meta", 1), 1, clock, 0.001)  # not a CPU: its forward returns before it ends
    reading = forward_times.read_forward_times(reset=True)
    assert reading == {1: (pytest.approx(40.0), 3), 2: (pytest.approx(60.0), 1)}
    assert forward_times.read_forward_times() == {}


def test_each_plain_forward_is_read_with_its_context(monkeypatch):
    """``contexts=True``: every plain forward's ms with its requests' summed sequence lengths (positions + 1 each;
    None without 1-D positions), for a bench that compares engines at one context."""
    clock = [0.0]
    monkeypatch.setattr(forward_times.time, "perf_counter", lambda: clock[-1])
    forward_times.read_forward_times(reset=True)
    two = FakeRunner("cpu", 2)

    def original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs):
        clock.append(clock[-1] + 0.020)
        return input_ids

    forward_times.model_forward(original, two, input_ids=torch.zeros(2, dtype=torch.long),
                                positions=torch.tensor([99, 199]))
    _forward(two, 2, clock, 0.030)  # no positions
    reading = forward_times.read_forward_times(reset=True, contexts=True)
    assert reading == {2: [(pytest.approx(20.0), 300), (pytest.approx(30.0), None)]}
    assert forward_times.read_forward_times(contexts=True) == {}


def test_the_timer_is_off_unless_a_benchmark_asks(monkeypatch, tmp_path):
    monkeypatch.delenv(forward_times.FORWARD_TIMES_ENV, raising=False)
    monkeypatch.delenv(forward_times.FORWARD_TIMES_FILE_ENV, raising=False)
    assert not forward_times.enabled()
    monkeypatch.setenv(forward_times.FORWARD_TIMES_ENV, "1")
    assert forward_times.enabled()
    monkeypatch.delenv(forward_times.FORWARD_TIMES_ENV)
    monkeypatch.setenv(forward_times.FORWARD_TIMES_FILE_ENV, str(tmp_path / "forwards.txt"))
    assert forward_times.enabled()


def test_a_server_writes_its_plain_forwards_and_a_level_reads_its_window(monkeypatch, tmp_path):
    """Each worker appends (start, requests, ms) per plain forward to ``<file>.<pid>``; a load level's reading is the
    median at the request count most of its forwards had, within its time window."""
    base = tmp_path / "forwards-graft-r1.txt"
    monkeypatch.setenv(forward_times.FORWARD_TIMES_FILE_ENV, str(base))
    monkeypatch.setattr(forward_times, "_sink", [])
    clock, wall = [0.0], [1000.0]
    monkeypatch.setattr(forward_times.time, "perf_counter", lambda: clock[-1])
    monkeypatch.setattr(forward_times.time, "time", lambda: wall[0] + clock[-1])
    four, two = FakeRunner("cpu", 4), FakeRunner("cpu", 2)
    for seconds in (0.050, 0.070, 0.060):
        _forward(four, 4, clock, seconds)
    _forward(four, 9, clock, 0.300)  # verifies drafts: not a plain forward, not written
    _forward(two, 2, clock, 0.040)  # the level's tail
    forward_times._sink[0].close()
    paths = trace.files(base)
    assert [p.name for p in paths] == [f"forwards-graft-r1.txt.{forward_times.os.getpid()}"]
    records = forward_times.read_trace(paths)
    assert [(r, round(ms, 3), context) for _, r, ms, context in records] == [
        (4, 50.0, None), (4, 70.0, None), (4, 60.0, None), (2, 40.0, None)]  # no positions given: no context
    assert records[0][0] == pytest.approx(1000.0)  # when the forward started, on the client's clock
    assert forward_times.window_reading(records, 999.0, 2000.0, min_count=3) == (pytest.approx(60.0), 4, 3)
    assert forward_times.window_reading(records, 999.0, 2000.0, min_count=4) is None  # too few to count
    assert forward_times.window_reading(records, 1000.04, 2000.0, min_count=1) == (pytest.approx(65.0), 4, 2)
    assert forward_times.window_reading(records, 2000.0, 3000.0, min_count=1) is None
    paths[0].write_text(paths[0].read_text() + "1000.9 4")  # a torn last line (the server was stopped)
    assert len(forward_times.read_trace(paths)) == 4
    trace.clear(base)
    assert trace.files(base) == []


def test_a_plain_forward_records_its_context_and_a_level_fits_its_forwards_to_it(monkeypatch, tmp_path):
    """The fourth field is the requests' summed sequence lengths (positions + 1); a window's forwards of one request
    count fit a line in that context, so two servers compare at one context."""
    base = tmp_path / "forwards-none-r1.txt"
    monkeypatch.setenv(forward_times.FORWARD_TIMES_FILE_ENV, str(base))
    monkeypatch.setattr(forward_times, "_sink", [])
    clock = [0.0]
    monkeypatch.setattr(forward_times.time, "perf_counter", lambda: clock[-1])
    monkeypatch.setattr(forward_times.time, "time", lambda: 1000.0 + clock[-1])

    def original(self, input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs):
        clock.append(clock[-1] + (20.0 + 5.0 * (int(positions.sum()) + 4) / 1000.0) / 1e3)  # 20 ms + 5 per 1000
        return input_ids

    four = FakeRunner("cpu", 4)
    for start in (100, 400, 900, 1500):
        positions = torch.arange(start, start + 4)  # each request's last position: sequence lengths start+1...
        forward_times.model_forward(original, four, input_ids=torch.zeros(4, dtype=torch.long), positions=positions)
    forward_times._sink[0].close()
    records = forward_times.read_trace(trace.files(base))
    assert [context for *_, context in records] == [4 * s + 6 + 4 for s in (100, 400, 900, 1500)]
    intercept, slope, low, median, high = forward_times.window_fit(records, 999.0, 2000.0, reqs=4, min_count=4)
    assert (intercept, slope) == (pytest.approx(20.0, abs=1e-3), pytest.approx(5.0, abs=1e-3))
    assert median == pytest.approx((1610 + 3610) / 2) and 410 < low < 1610 and 3610 < high < 6010
    assert forward_times.window_fit(records, 999.0, 2000.0, reqs=4, min_count=5) is None  # too few
    assert forward_times.window_fit(records, 999.0, 2000.0, reqs=2, min_count=1) is None  # none of 2 requests
    one_context = [(1000.0 + j, 4, 30.0, 500) for j in range(5)]
    assert forward_times.window_fit(one_context, 999.0, 2000.0, reqs=4, min_count=1) is None  # no line through one


def test_the_host_time_between_consecutive_plain_forwards_is_read_per_level():
    """``window_gap``: the next plain forward's start less this one's start and length, for consecutive forwards of
    the level's request count; a pair with a forward's time or more between them had another step in between (a
    prefill, a verifying step) and does not count, nor does a pair with a forward of another request count between
    them, nor forwards outside the window."""
    records = [(1000.000, 4, 50.0, None), (1000.060, 4, 50.0, None),  # 10 ms of host work
               (1000.122, 4, 50.0, None),  # 12 ms
               (1000.300, 4, 50.0, None),  # 128 ms: another step in between
               (1000.356, 4, 50.0, None),  # 6 ms
               (1000.410, 2, 30.0, None), (1000.445, 2, 30.0, None),  # 2 requests: 5 ms, another reading
               (1000.480, 4, 50.0, None),  # 4 requests again: 40 ms after the last 4, but with 2s between
               (2000.000, 4, 50.0, None), (2000.051, 4, 50.0, None)]  # outside the window
    median, count = forward_times.window_gap(records, 999.0, 2000.0, reqs=4, min_count=3)
    assert (median, count) == (pytest.approx(10.0), 3)
    assert forward_times.window_gap(records, 999.0, 2000.0, reqs=2, min_count=1) == (pytest.approx(5.0), 1)
    assert forward_times.window_gap(records, 999.0, 2000.0, reqs=4, min_count=4) is None  # too few pairs
