"""The start-up sweep's logic without an engine: interleaved rounds, the stop ratio and the time budget, the drafter
probe, the dummy-step driver on a stand-in runner, and the cost-model CLI's formatting and plot."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_treespec.cost.measure import (StepDriver, default_points, measure_drafter, relative_errors, sweep,
                                        time_callable, time_rounds)
from vllm_treespec.cost.model import StepCostModel, StepSample


def test_rounds_are_interleaved_and_expensive_points_dropped():
    calls = []

    def run(t, r):
        calls.append((t, r))
        return 0.01 * t

    points = [(1, 1), (2, 1), (4, 1), (16, 1), (32, 1)]
    samples = time_rounds(run, points, repeats=3, budget_s=100, stop_ratio=8.0)
    assert {(s.num_tokens, s.num_reqs) for s in samples} == {(1, 1), (2, 1), (4, 1)}
    # after the warm-ups, each round times every kept point once, in a shuffled order
    rounds = calls[-9:]
    assert sorted(rounds[:3]) == sorted(rounds[3:6]) == sorted(rounds[6:]) == [(1, 1), (2, 1), (4, 1)]
    # a point past the limit is not warmed up twice, and larger ones with as many requests are not run at all
    assert calls.count((16, 1)) == 1 and calls.count((32, 1)) == 0 and calls.count((4, 1)) == 2 + 3


def test_warm_ups_stop_when_they_have_used_the_budget():
    calls = []

    def run(t, r):
        calls.append((t, r))
        return 0.5

    samples = time_rounds(run, [(t, 1) for t in (1, 2, 3, 4, 6, 8)], repeats=1, budget_s=1.5, stop_ratio=8.0,
                          keep=[(8, 1)])
    # two warm-ups of 1 token and of 2 tokens use 2 s: no more warm-ups, except the kept point's
    assert sorted(set(calls)) == [(1, 1), (2, 1), (8, 1)]
    assert {(s.num_tokens, s.num_reqs) for s in samples} == {(8, 1), (1, 1), (2, 1)}  # 1.5 s of rounds


def test_budget_and_kept_points():
    samples = time_rounds(lambda t, r: 0.1 * t, [(1, 1), (2, 1), (4, 1), (8, 1)], repeats=2, budget_s=2.0,
                          stop_ratio=100, keep=[(8, 1)])
    # kept points are never dropped and are paid first (1.6 s), then the cheapest that still fit (1 token: 0.2 s)
    assert {(s.num_tokens, s.num_reqs) for s in samples} == {(8, 1), (1, 1)}


def test_drafter_probe_and_callable_timing():
    assert time_callable(lambda: None, repeats=3) < 0.01
    samples = measure_drafter(lambda r: (lambda: None) if r <= 2 else None, reqs=(1, 2, 4))
    assert [(s.num_tokens, s.num_reqs) for s in samples] == [(1, 1), (2, 2)]


class FakeRunner:
    """What StepDriver touches on a model runner."""

    def __init__(self):
        import torch

        self.uniform_decode_query_len = 17
        self.max_num_tokens = 40
        self.max_model_len = 600
        self.scheduler_config = SimpleNamespace(max_num_seqs=4)
        self.kv_cache_config = SimpleNamespace(num_blocks=6)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="fake", dtype=torch.float32),
                                           compilation_config=SimpleNamespace(mode=None, backend="",
                                                                              cudagraph_mode=None))
        table = SimpleNamespace(block_size=16, block_table=SimpleNamespace(np=np.zeros((4, 38), np.int32)))
        self.input_batch = SimpleNamespace(block_table=[table])
        self.runs = []
        self.tables = []  # the block table rows each dummy run saw
        self.model = SimpleNamespace(compute_logits=lambda h: h @ torch.ones(h.shape[1], 5))

    def _sync_device(self):
        pass

    def _dummy_run(self, num_tokens, **kwargs):
        import torch

        self.runs.append((num_tokens, self.uniform_decode_query_len, kwargs))
        self.tables.append(self.input_batch.block_table[0].block_table.np.copy())
        hidden = torch.zeros(num_tokens, 3)
        return hidden, hidden[-1:]


def test_step_driver_sets_the_query_length_and_restores_it():
    runner = FakeRunner()
    seconds = StepDriver(runner, context_len=64)(12, 4)
    assert seconds >= 0 and runner.uniform_decode_query_len == 17
    (tokens, query_len, kwargs), = runner.runs
    assert (tokens, query_len) == (12, 3)
    assert kwargs["uniform_decode"] and kwargs["force_attention"] and kwargs["profile_seq_lens"] == 64
    with pytest.raises(ValueError):
        StepDriver(runner)(5, 2)


def test_step_driver_gives_each_request_distinct_blocks_and_restores_the_table():
    """vLLM's dummy run leaves every block id 0: its attention would read one cached block again and again."""
    runner = FakeRunner()
    StepDriver(runner, context_len=40)(8, 2)
    seen = runner.tables[-1]
    assert seen[:2, :3].tolist() == [[1, 2, 3], [4, 5, 1]]  # ceil(40 / 16) blocks each, block 0 never, wrapped
    assert not seen[:, 3:].any() and not seen[2:].any()
    assert not runner.input_batch.block_table[0].block_table.np.any()  # restored


def test_the_sweep_times_a_few_points_again_at_a_longer_context():
    runner = FakeRunner()
    # the fake steps take microseconds: a stop ratio on their noise (or a busy moment) would drop points at random
    record, _ = sweep(runner, points=[(1, 1), (2, 1), (8, 1)], repeats=2, context_len=64, budget_s=1e6,
                      stop_ratio=1e9)
    assert record.context_len == 64
    longer = [s for s in record.samples if s.context_len]
    assert {(s.num_tokens, s.num_reqs, s.context_len) for s in longer} == {(1, 1, 512), (8, 1, 512), (16, 1, 512)}
    assert {kw["profile_seq_lens"] for _, _, kw in runner.runs} == {64, 512}
    assert record.step_model().reference_context == 64


def test_a_sweep_whose_long_context_steps_fail_keeps_its_curve(caplog):
    runner = FakeRunner()
    dummy_run = runner._dummy_run

    def failing_when_long(num_tokens, **kwargs):
        if kwargs["profile_seq_lens"] > 64:
            raise RuntimeError("no such context here")
        return dummy_run(num_tokens, **kwargs)

    runner._dummy_run = failing_when_long
    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        record, _ = sweep(runner, points=[(1, 1), (2, 1), (8, 1)], repeats=1, context_len=64, budget_s=5.0)
    assert {s.context_len for s in record.samples} == {0} and record.step_model().per_context == 0.0
    assert "512 tokens of context" in caplog.text and "no such context here" in caplog.text


def test_default_points_respect_the_runner_limits():
    points = default_points(FakeRunner())
    assert (32, 1) in points and (64, 1) not in points
    assert (16, 4) in points and all(r <= 4 and t <= 40 for t, r in points)
    assert (8, 8) not in points


def test_relative_errors_and_cli_output(tmp_path):
    from vllm_treespec.tools.cost_model import build_parser, format_held_out, format_table, parse_points, plot

    assert not build_parser().parse_args(["--plot", ""]).plot  # no plot (not one written to a file named ".png")
    assert build_parser().parse_args([]).plot == "cost_model.png"

    assert parse_points("3, 6,12x1,24x8") == [(3, 1), (6, 1), (12, 1), (24, 8)]
    samples = [StepSample(t, 1, 0.05 + 0.001 * t) for t in (1, 2, 4, 8, 16)] + [StepSample(8, 4, 0.07)]
    model = StepCostModel.fit(samples)
    held = [StepSample(6, 1, 0.0562), StepSample(6, 1, 0.0558)]
    rows = relative_errors(model, held)
    assert rows[0][:2] == (6, 1) and rows[0][2] == pytest.approx(0.056) and abs(rows[0][4]) < 1e-9
    text, worst = format_held_out(model, held)
    assert "max |error| 0.0%" in text and worst < 1e-9
    assert "marginal ms/token" in format_table(model, samples).splitlines()[0]
    pytest.importorskip("matplotlib")
    path = plot(model, samples, held, tmp_path / "curve.png", "test")
    assert path.stat().st_size > 1000
    assert np.isfinite(model.marginal(100))
