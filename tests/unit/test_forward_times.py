"""The benchmark's forward timer (vllm_treespec/patches/forward_times.py): plain decode forwards only, on CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

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


def test_the_timer_is_off_unless_a_benchmark_asks(monkeypatch):
    monkeypatch.delenv(forward_times.FORWARD_TIMES_ENV, raising=False)
    assert not forward_times.enabled()
    monkeypatch.setenv(forward_times.FORWARD_TIMES_ENV, "1")
    assert forward_times.enabled()
