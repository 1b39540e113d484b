"""The step-cost model on synthetic timings: fit and predict, online refinement, the disk cache (round trip; a
corrupt or foreign file is ignored with one log line)."""

from __future__ import annotations

import logging
import math

import msgspec
import numpy as np
import pytest

from vllm_treespec.cost.model import (FORMAT_VERSION, CostCache, CostKey, CostRecord, CurveModel, PiecewiseLinear,
                                      MAX_CACHED_SPREAD, StepCostModel, StepSample, context_excess,
                                      fit_context_slopes, isotonic, load_or_measure)

GRID = [1, 2, 4, 8, 16, 32, 64]


def cpu_like(t, r=1):
    """A CPU-ish step: 60 ms + 4 ms per token beyond 4, plus 3 ms per extra request."""
    return 0.060 + 0.004 * np.maximum(np.asarray(t, float) - 4, 0) + 0.003 * (r - 1)


def samples_of(fn, grid=GRID, reqs=(1,), repeats=5, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [StepSample(t * r if r > 1 else t, r, float(fn(t * r if r > 1 else t, r) * (1 + noise * rng.standard_normal())))
            for r in reqs for t in grid for _ in range(repeats)]


KEY = CostKey(model="/models/smollm2", dtype="float32", device="AMD EPYC 7B13", vllm_version="0.32.0+cpu",
              torch_threads=1)


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def log_lines():
    handler = LogLines()
    logger = logging.getLogger("vllm.treespec")
    logger.addHandler(handler)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)


def test_isotonic_pools_violators():
    assert isotonic([1, 3, 2, 4]).tolist() == [1, 2.5, 2.5, 4]
    assert isotonic([5, 4, 3]).tolist() == [4, 4, 4]
    assert isotonic([1, 2, 3]).tolist() == [1, 2, 3]
    assert isotonic([1, 3, 2], [1, 3, 1]).tolist() == [1, 2.75, 2.75]


def test_piecewise_linear_extrapolates_with_last_slope_and_is_flat_below():
    curve = PiecewiseLinear([2, 4, 8], [1.0, 2.0, 4.0])
    assert curve(1.0) == pytest.approx(1.0)
    assert curve(3.0) == pytest.approx(1.5)
    assert curve(16.0) == pytest.approx(8.0)
    assert PiecewiseLinear([4], [2.0])(100.0) == pytest.approx(2.0)
    assert PiecewiseLinear([1, 2], [2.0, 1.0])(10.0) == pytest.approx(1.0)  # a falling tail extends flat
    with pytest.raises(ValueError):
        PiecewiseLinear([1, 1], [1.0, 2.0])


def test_the_tail_follows_the_upper_knots_not_the_last_segment():
    # a short sweep on a busy machine (fp32, AVX2): the last segment is 0.9 ms per token where rows cost ~4-5
    curve = PiecewiseLinear([1, 2, 3, 4, 6, 8, 12], [61.3, 79.0, 76.8, 77.6, 80.3, 107.6, 111.2])
    assert 3.5 < curve.tail_slope < 6.0
    assert curve(96.0) == pytest.approx(111.2 + 84 * curve.tail_slope)
    assert PiecewiseLinear([1, 64], [10.0, 10.0]).tail_slope == 0.0  # flat stays flat (a GPU)


@pytest.mark.parametrize("knots", [([2, 4, 8], [1.0, 2.0, 4.0]), ([1, 2, 4, 8], [0.042, 0.048, 0.033, 0.044]),
                                   ([4], [2.0]), ([1, 2], [2.0, 1.0])])
def test_the_curve_at_one_point_is_the_curve(knots):
    curve = PiecewiseLinear(*knots)
    points = [0.5, 1.0, 1.5, 2.0, 3.0, 3.999, 4.0, 5.0, 7.5, 8.0, 8.5, 16.0, 100.0]
    assert [curve.at(x) for x in points] == pytest.approx(curve(np.array(points)).tolist(), rel=1e-12)


def test_measured_dips_are_kept_unless_monotone_is_asked():
    # the shape measured on this machine (SmolLM2 fp32): 2 tokens cost more than 4
    x, y = [1, 2, 4, 8], [0.042, 0.048, 0.033, 0.044]
    assert PiecewiseLinear(x, y)(3.0) == pytest.approx(0.0405)
    monotone = PiecewiseLinear(x, y, monotone=True)
    assert np.all(np.diff(monotone(np.arange(1, 20))) >= 0)
    assert monotone(1.0) == pytest.approx(0.041)


def test_fit_predicts_held_out_points_of_a_noisy_curve():
    model = StepCostModel.fit(samples_of(cpu_like, reqs=(1, 2, 4), noise=0.03))
    for t in (3, 6, 12, 24, 48, 96):
        assert model.predict(t) == pytest.approx(float(cpu_like(t)), rel=0.05), t
    assert model.per_request == pytest.approx(0.003, rel=0.3)
    assert model.predict(16, 4) == pytest.approx(float(cpu_like(16, 4)), rel=0.05)
    assert model.marginal(32) == pytest.approx(0.004, rel=0.1)
    rows = model.table([1, 8], num_reqs=1)
    assert [r[:2] for r in rows] == [(1, 1), (8, 1)]


@pytest.mark.parametrize("monotone", [False, True])
def test_fit_is_flat_on_a_flat_curve(monotone):
    flat = StepCostModel.fit(samples_of(lambda t, r: 0.010, noise=0.02), monotone=monotone)
    values = flat.predict_many(np.arange(1, 200))
    assert values.max() / values.min() < 1.1
    assert np.all(np.diff(values) >= 0) or not monotone
    assert flat.per_request == 0.0


def test_fit_needs_single_request_samples_and_ignores_bad_timings():
    with pytest.raises(ValueError):
        StepCostModel.fit([StepSample(8, 2, 0.1)])
    model = StepCostModel.fit([StepSample(1, 1, 0.05), StepSample(1, 1, float("nan")), StepSample(2, 1, -1.0),
                               StepSample(4, 1, 0.07)])
    assert model.predict(2) == pytest.approx(0.05 + 0.02 / 3)  # between the knots 1 and 4


def test_online_refinement_follows_a_shifted_curve():
    model = StepCostModel.fit(samples_of(cpu_like))

    def shifted(t, r=1):  # twice as slow, and tree steps pay 20 ms more than the sweep saw
        return 2 * cpu_like(t, r) + 0.020 * (np.asarray(t) > 1)

    rng = np.random.default_rng(1)
    for _ in range(60):
        for t in (1, 5, 17):
            model.observe(t, 1, float(shifted(t)) * (1 + 0.02 * rng.standard_normal()))
    for t in (1, 5, 17):
        assert model.predict(t) == pytest.approx(float(shifted(t)), rel=0.05), t
    # between observed buckets the correction interpolates; beyond them it stays flat
    assert float(cpu_like(9)) * 2 < model.predict(9) < float(shifted(9)) * 1.1
    # one outlier moves a bucket by a bounded amount
    before = model.predict(17)
    model.observe(17, 1, 1000.0)
    assert model.predict(17) < before * 1.2


def test_the_correction_applies_where_its_buckets_steps_are():
    """A batch-1 step verifying 5 drafts has 6 tokens, in the 8-token bucket: its correction applies at 6 tokens
    (the bucket's mean log2 of tokens), not at 8, so steps rarely reaching the 4-token bucket do not pull the
    prediction at 6 tokens toward theirs (a knot at 8 tokens left it 12% low on a held-out run)."""
    model = StepCostModel.fit(samples_of(cpu_like))
    for _ in range(3):
        model.observe(4, 1, float(cpu_like(4)), drafts=3)  # a few early steps at 4 tokens, as the sweep saw
    for _ in range(100):
        model.observe(6, 1, 1.15 * float(cpu_like(6)), drafts=5)
    assert model.predict(6, plain_tokens=1) == pytest.approx(1.15 * float(model.base(6)), rel=1e-3)
    correction = model.draft_correction
    assert correction.factor(6) == pytest.approx(correction.buckets[3], rel=1e-12)
    assert correction.buckets[2] < correction.factor(5) < correction.buckets[3]  # between the knots at 4 and 6
    assert correction.factor(8) == pytest.approx(correction.buckets[3], rel=1e-12)  # flat beyond the last knot
    for _ in range(100):
        model.observe(7, 1, 1.15 * float(cpu_like(7)), drafts=6)
    assert math.log2(6) < correction._knot(3) < math.log2(7)  # the knot follows the bucket's steps


def test_plain_steps_and_verifying_steps_learn_apart():
    """Eight requests' plain decode rows cost less than one request's tree rows of as many tokens (what the sweep
    timed), and tree steps more: each kind's prediction follows its own steps, and a kind not seen yet borrows the
    other's correction."""
    model = StepCostModel.fit(samples_of(cpu_like))
    base = float(cpu_like(8))
    for _ in range(60):
        model.observe(8, 8, 0.7 * base)  # plain
    assert model.predict(8, 8, plain_tokens=8) == pytest.approx(0.7 * base + 7 * model.per_request * 0.7, rel=0.05)
    # no verifying step seen yet: drafts are priced with the plain steps' correction
    assert model.predict(8, 1, plain_tokens=4) == pytest.approx(0.7 * base, rel=0.05)
    for _ in range(60):
        model.observe(8, 1, 1.3 * base, drafts=7)
    assert model.predict(8, 1, plain_tokens=1) == pytest.approx(1.3 * base, rel=0.05)
    assert model.predict(8, 1, plain_tokens=8) == pytest.approx(0.7 * base, rel=0.05)  # plain unchanged
    assert model.predict(8, 1) == pytest.approx(0.7 * base, rel=0.05)  # no plain_tokens: a plain step
    assert model.marginal(4) == pytest.approx((model.predict(5, plain_tokens=4) - model.predict(4, plain_tokens=4)))
    fresh = StepCostModel.fit(samples_of(cpu_like))
    for _ in range(60):
        fresh.observe(8, 1, 1.3 * base, drafts=7)
    assert fresh.predict(8, 8, plain_tokens=8) == pytest.approx(1.3 * float(fresh.base(8, 8)), rel=0.05)


def numpy_prediction(model, tokens, num_reqs=1, excess=0.0, plain_tokens=None, request_excess=None):
    """What :meth:`StepCostModel.predict_many` computes, by the model's NumPy parts (its path without Numba)."""
    tokens = np.asarray(tokens, np.float64)
    return model.base(tokens, num_reqs, excess, request_excess) * model.factor(tokens, plain_tokens, num_reqs)


@pytest.mark.parametrize("per_context, per_request_context", [(0.0, 0.0), (2e-6, 0.0), (2e-6, 9e-6)])
def test_the_compiled_prediction_is_the_numpy_one(per_context, per_request_context):
    """Below, between and beyond the knots, with and without corrections of either kind, plain and verifying counts,
    context terms that hit the floor: the compiled kernel gives the NumPy path's seconds."""
    from vllm_treespec.cost import model as model_module

    assert model_module._predict_kernel() is not None  # Numba is installed here: the kernel is what runs
    model = StepCostModel.fit(samples_of(cpu_like, grid=[2, 4, 8, 16]), reference_context=256)
    model.per_request, model.per_context, model.per_request_context = 0.003, per_context, per_request_context
    rng = np.random.default_rng(0)
    tokens = np.array([0.5, 1, 2, 3, 4, 6, 8, 8.5, 16, 17, 40, 100], np.float64)
    excess = rng.uniform(-60_000, 60_000, tokens.size)
    for observations in range(4):
        for plain_tokens in (None, 1, 4, 8):
            for reqs in (1, 3):
                for request_excess in (None, -5_000.0, 20_000.0):
                    got = model.predict_many(tokens, reqs, excess, plain_tokens, request_excess)
                    np.testing.assert_allclose(
                        got, numpy_prediction(model, tokens, reqs, excess, plain_tokens, request_excess), rtol=1e-12)
        assert model.predict_many(np.array([[4.0, 8.0]]), 1, 0.0, 1).shape == (1, 2)
        assert isinstance(model.predict(4, 1, 0.0, 1), float)
        # plain steps first, then verifying steps: every combination of the two tables
        model.observe(int(rng.integers(1, 40)), int(rng.choice([1, 3, 16])), float(rng.uniform(0.03, 0.2)),
                      drafts=observations % 2)


def test_verifying_steps_learn_per_request_bucket_what_the_shared_table_misses():
    """A step of 16 requests verifying 10 drafts and one of 4 requests verifying 22 share a token bucket, not a
    cost: each request bucket learns its own factor on top of the table of all verifying steps; a bucket not yet seen
    takes that table; plain steps are untouched."""
    model = StepCostModel.fit(samples_of(cpu_like))
    wide, narrow = 1.35 * float(model.base(26, 16)), 0.8 * float(model.base(26, 4))
    for _ in range(80):  # interleaved: the shared table alone settles between the two and misses both
        model.observe(26, 16, wide, drafts=10)
        model.observe(26, 4, narrow, drafts=22)
    assert model.predict(26, 16, plain_tokens=16) == pytest.approx(wide, rel=0.03)
    assert model.predict(26, 4, plain_tokens=4) == pytest.approx(narrow, rel=0.03)
    shared = float(model.base(26, 1)) * float(model.draft_correction.factor(26.0))
    assert model.predict(26, 1, plain_tokens=1) == pytest.approx(shared, rel=1e-9)  # bucket 0: never verified
    assert 0.8 * 1.02 < float(model.draft_correction.factor(26.0)) < 1.35 / 1.02
    # a plain step borrows the shared table (no plain step observed yet), never a request bucket's own
    assert model.predict(16, 16) == pytest.approx(float(model.base(16, 16) * model.draft_correction.factor(16.0)),
                                                  rel=1e-9)
    # flat beyond the knots, as every correction: a count far above the observed ones keeps the bucket's factor
    assert model.predict(200, 16, plain_tokens=16) / float(model.base(200, 16)) == pytest.approx(1.35, rel=0.03)


def test_without_numba_the_prediction_takes_the_numpy_path(monkeypatch):
    """The GPU machine's standalone scripts import the model where Numba is missing."""
    from vllm_treespec.cost import model as model_module

    model = StepCostModel.fit(samples_of(cpu_like))
    model.observe(8, 1, 0.2, drafts=3)
    tokens = np.array([1.0, 4.0, 9.0, 70.0])
    compiled = model.predict_many(tokens, 2, 0.0, 4)
    monkeypatch.setattr(model_module, "_KERNEL", [None])
    np.testing.assert_allclose(model.predict_many(tokens, 2, 0.0, 4), compiled, rtol=1e-12)
    np.testing.assert_allclose(model.predict_many(tokens, 2, 0.0, 4), numpy_prediction(model, tokens, 2, 0.0, 4),
                               rtol=0)


def test_curve_model_for_a_drafter():
    drafter = CurveModel.fit([StepSample(1, r, 0.002 * r) for r in (1, 2, 4, 8) for _ in range(3)])
    assert drafter.predict(6) == pytest.approx(0.012)
    for _ in range(50):
        drafter.observe(4, 0.016)
    assert drafter.predict(4) == pytest.approx(0.016, rel=0.02)


def record_of(key=KEY):
    return CostRecord(format_version=FORMAT_VERSION, key=key, samples=samples_of(cpu_like, reqs=(1, 2), repeats=1),
                      drafters={"graft": [StepSample(1, 1, 0.003)]}, measured_at=1.0)


def test_cache_round_trip(tmp_path, log_lines):
    cache = CostCache(tmp_path)
    assert cache.load(KEY) is None and log_lines == []
    path = cache.save(record_of())
    assert path is not None and path.parent == tmp_path and path.name.startswith("smollm2-float32-")
    loaded = cache.load(KEY)
    assert loaded == record_of()
    assert loaded.step_model().predict(10) == pytest.approx(StepCostModel.fit(record_of().samples).predict(10))
    assert log_lines == []
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_default_cache_folder_is_under_the_settings_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_TREESPEC_CACHE", str(tmp_path))
    assert CostCache().path(KEY).parent == tmp_path / "cost_models"


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"format_version": 1}', b"[1, 2]",
                                     b'{"format_version": 1, "key": {}, "samples": []}'])
def test_corrupt_cache_is_ignored_with_one_log_line(tmp_path, log_lines, content):
    cache = CostCache(tmp_path)
    cache.path(KEY).parent.mkdir(parents=True, exist_ok=True)
    cache.path(KEY).write_bytes(content)
    assert cache.load(KEY) is None
    assert len(log_lines) == 1 and "cost-model cache" in log_lines[0].getMessage()


def test_record_without_single_request_samples_is_corrupt(tmp_path, log_lines):
    cache = CostCache(tmp_path)
    bad = CostRecord(format_version=FORMAT_VERSION, key=KEY, samples=[StepSample(4, 2, 0.1)])
    cache.save(bad)
    assert cache.load(KEY) is None
    assert len(log_lines) == 1 and "corrupt" in log_lines[0].getMessage()


def test_foreign_cache_is_ignored_with_one_log_line(tmp_path, log_lines):
    cache = CostCache(tmp_path)
    other = msgspec.structs.replace(KEY, device="NVIDIA H100")
    cache.path(KEY).parent.mkdir(parents=True, exist_ok=True)
    cache.path(KEY).write_bytes(msgspec.json.encode(record_of(other)))  # another engine's record under our name
    assert cache.load(KEY) is None
    assert len(log_lines) == 1
    assert "another engine" in log_lines[0].getMessage() and "NVIDIA H100" in log_lines[0].getMessage()
    # a future format version
    future = msgspec.json.decode(msgspec.json.encode(record_of()))
    future["format_version"] = FORMAT_VERSION + 1
    future["new_field"] = [1, 2]
    cache.path(KEY).write_bytes(msgspec.json.encode(future))
    assert cache.load(KEY) is None
    assert len(log_lines) == 2 and "format" in log_lines[1].getMessage()


def test_eager_and_compiled_engines_keep_their_own_curves(tmp_path, log_lines):
    """The key names how vLLM runs the forward: a curve timed under enforce_eager is not a compiled engine's."""
    from types import SimpleNamespace

    from vllm.config import CompilationMode, CUDAGraphMode

    from vllm_treespec.cost.measure import execution_summary

    def config(mode, backend, graphs):
        return SimpleNamespace(compilation_config=SimpleNamespace(mode=mode, backend=backend, cudagraph_mode=graphs))

    eager = execution_summary(config(CompilationMode.NONE, "inductor", CUDAGraphMode.NONE))
    compiled = execution_summary(config(CompilationMode.DYNAMO_TRACE_ONCE, "inductor", CUDAGraphMode.NONE))
    graphs = execution_summary(config(CompilationMode.VLLM_COMPILE, "", CUDAGraphMode.FULL_AND_PIECEWISE))
    assert eager == "compile=NONE cudagraph=NONE"
    assert compiled == "compile=DYNAMO_TRACE_ONCE/inductor cudagraph=NONE"
    assert graphs == "compile=VLLM_COMPILE cudagraph=FULL_AND_PIECEWISE"
    cache = CostCache(tmp_path)
    eager_key, compiled_key = (msgspec.structs.replace(KEY, execution=e) for e in (eager, compiled))
    cache.save(record_of(eager_key))
    assert cache.path(eager_key) != cache.path(compiled_key)
    assert cache.load(compiled_key) is None and log_lines == []  # another file: measured, not misread
    cache.path(compiled_key).write_bytes(cache.path(eager_key).read_bytes())  # the eager curve under its name
    assert cache.load(compiled_key) is None
    assert "execution='compile=NONE cudagraph=NONE'" in log_lines[0].getMessage()


def test_load_or_measure_measures_once_then_reads_the_cache(tmp_path, log_lines):
    cache = CostCache(tmp_path)
    calls = []

    def measure():
        calls.append(1)
        return record_of()

    record, cached = load_or_measure(KEY, measure, cache)
    assert not cached and calls == [1]
    record2, cached2 = load_or_measure(KEY, measure, cache)
    assert cached2 and record2 == record and calls == [1]
    cache.path(KEY).write_bytes(b"\x00garbage")
    record3, cached3 = load_or_measure(KEY, measure, cache)
    assert not cached3 and calls == [1, 1] and len(log_lines) == 1
    assert cache.load(KEY) == record  # re-measured and rewritten


def test_a_sweep_whose_rounds_disagree_is_used_but_not_cached(tmp_path, log_lines):
    """A busy machine's start-up sweep (rounds 30-60% apart) must not become every later engine's curve: the engine
    that measured it uses it; the record it was to replace stays cached; a sweep whose rounds agree replaces it."""
    cache = CostCache(tmp_path)
    old = record_of()
    cache.save(old)
    noisy = CostRecord(FORMAT_VERSION, KEY, samples_of(cpu_like, noise=0.2, seed=3))
    assert noisy.round_spread > MAX_CACHED_SPREAD and "disagree" in noisy.not_cacheable()
    record, cached = load_or_measure(KEY, lambda: noisy, cache, refresh=True)
    assert record is noisy and not cached
    assert cache.load(KEY) == old and "disagree" in log_lines[-1].getMessage()
    quiet = CostRecord(FORMAT_VERSION, KEY, samples_of(lambda t, r: 1.1 * cpu_like(t, r), noise=0.02, seed=3))
    assert quiet.round_spread < MAX_CACHED_SPREAD and quiet.not_cacheable() is None
    load_or_measure(KEY, lambda: quiet, cache, refresh=True)
    assert cache.load(KEY) == quiet
    assert CostRecord(FORMAT_VERSION, KEY, samples_of(cpu_like)).round_spread == 0.0  # every round alike
    # a cached curve that fails its spot check on a busy machine: a noisier sweep does not replace it, even for this
    # engine (the online correction follows the level); a sweep as noisy without a quieter cache is used
    record, cached = load_or_measure(KEY, lambda: noisy, cache, check=lambda record: "off by 2x")
    assert record == quiet and cached and "keeping the cached curve" in log_lines[-1].getMessage()
    assert cache.load(KEY) == quiet
    rougher = CostRecord(FORMAT_VERSION, KEY, samples_of(cpu_like, noise=0.3, seed=4))
    cache.save(rougher)
    record, cached = load_or_measure(KEY, lambda: noisy, cache, check=lambda record: "off by 2x")
    assert record is noisy and not cached and cache.load(KEY) == rougher
    assert record_of().round_spread is None  # no point timed three times


def test_unwritable_cache_logs_and_goes_on(tmp_path, log_lines):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert CostCache(blocker / "sub").save(record_of()) is None
    assert len(log_lines) == 1


def test_a_cached_curve_that_fails_its_spot_check_is_measured_again(tmp_path, log_lines):
    from vllm_treespec.cost.measure import spot_check

    cache = CostCache(tmp_path)
    busy = CostRecord(FORMAT_VERSION, KEY, samples_of(lambda t, r: 40 * cpu_like(t, r)))  # measured under load
    cache.save(busy)
    quiet = record_of()
    calls = []

    def measure():
        calls.append(1)
        return quiet

    def engine_now(tokens, reqs):
        return float(cpu_like(tokens, reqs))

    record, cached = load_or_measure(KEY, measure, cache, check=lambda r: spot_check(engine_now, r))
    assert not cached and record == quiet and calls == [1]
    assert len(log_lines) == 1 and "no longer fits" in log_lines[0].getMessage()
    assert cache.load(KEY) == quiet
    # the rewritten curve passes the same check: read from the cache, no sweep
    record, cached = load_or_measure(KEY, measure, cache, check=lambda r: spot_check(engine_now, r))
    assert cached and calls == [1]
    assert spot_check(lambda t, r: 1.3 * engine_now(t, r), quiet) is None  # drift within the tolerance
    assert "8 tokens" in spot_check(lambda t, r: engine_now(t, r) * (3 if t == 8 else 1), quiet)


def test_a_sweep_cut_short_is_used_but_not_cached(tmp_path, log_lines):
    cache = CostCache(tmp_path)
    short = CostRecord(FORMAT_VERSION, KEY, samples_of(cpu_like, grid=[1, 2]))
    record, cached = load_or_measure(KEY, lambda: short, cache)
    assert record == short and not cached
    assert not cache.path(KEY).exists() and "not caching" in log_lines[0].getMessage()


def test_the_context_term_is_fitted_from_samples_at_a_longer_context_and_priced_per_row():
    """A row attends to its request's whole sequence: samples timed at 4x the sweep's context give the seconds per
    row and position beyond it; the curve itself comes from the sweep's context alone."""
    per_position = 3e-6  # 3 ms per row and 1000 positions
    samples = samples_of(cpu_like, reqs=(1, 2))
    samples += [StepSample(t, 1, float(cpu_like(t)) + per_position * t * (1024 - 256), 1024) for t in (1, 8, 16)
                for _ in range(3)]
    model = CostRecord(FORMAT_VERSION, KEY, samples, context_len=256).step_model()
    assert model.per_context == pytest.approx(per_position, rel=1e-6)
    assert model.predict(8, 1) == pytest.approx(cpu_like(8))  # at the sweep's context: the curve
    assert model.predict(8, 1, excess=8 * (2000 - 256)) == pytest.approx(cpu_like(8) + per_position * 8 * 1744)
    assert model.predict(8, 1, excess=-8 * 200) < model.predict(8, 1)  # shorter rows cost less
    # the engine's accounting: each request's rows times how far its sequence ends beyond the sweep's context
    assert context_excess(np.array([1, 9]), np.array([300, 2000]), 256) == 1 * 44 + 9 * 1744
    # a record without such samples has no context term, and its curve is unchanged by the extra samples
    plain = CostRecord(FORMAT_VERSION, KEY, samples_of(cpu_like, reqs=(1, 2)), context_len=256).step_model()
    assert plain.per_context == 0.0 and plain.predict(16, 2) == pytest.approx(model.predict(16, 2))
    assert CostRecord(FORMAT_VERSION, KEY, samples, context_len=256).single_request_points == len(GRID)


def test_a_requests_sequence_is_priced_once_and_its_other_rows_at_the_row_slope():
    """Reading a request's sequence costs its first row more than its other rows (2-core Zen 1, fp32: ~20 us a
    position for one row at 2,048 positions, ~4.8 for each of 7 or 15 more): with samples of one request's 1, 8 and 16
    rows at a longer context, the fit separates the per-request slope from the per-row one, and prices a decode
    step's context (a row of each request) and a tree's extra rows apart; one slope for all rows priced the first
    at a third of its time."""
    per_row, per_request = 4.8e-6, 15e-6
    long = 2048
    samples = samples_of(cpu_like, reqs=(1, 2))
    samples += [StepSample(t, 1, float(cpu_like(t)) + (per_row * t + per_request) * (long - 256), long)
                for t in (1, 8, 16) for _ in range(3)]
    model = CostRecord(FORMAT_VERSION, KEY, samples, context_len=256).step_model()
    assert model.per_context == pytest.approx(per_row, rel=1e-6)
    assert model.per_request_context == pytest.approx(per_request, rel=1e-6)
    # a decode step of 4 requests at 1,256 positions: each row carries both slopes
    assert model.predict(4, 4, excess=4 * 1000) == pytest.approx(
        float(model.base(4, 4)) + (per_row + per_request) * 4000)
    # one request verifying 7 drafts: E_R named, or taken as E * R / T (exact when the requests' lengths agree)
    named = model.predict(8, 1, excess=8 * 1000, request_excess=1000)
    assert named == pytest.approx(float(model.base(8, 1)) + per_row * 8000 + per_request * 1000)
    assert model.predict(8, 1, excess=8 * 1000) == pytest.approx(named)
    # what a draft row adds at that length: the row slope only
    assert model.predict(9, 1, excess=9 * 1000, request_excess=1000) - named == pytest.approx(
        float(model.base(9, 1) - model.base(8, 1)) + per_row * 1000)
    # one slope, as before, where the samples cannot tell them apart (one row per request) ...
    single = samples_of(cpu_like, reqs=(1, 2)) + [StepSample(1, 1, float(cpu_like(1)) + 20e-6 * (long - 256), long)]
    one = CostRecord(FORMAT_VERSION, KEY, single, context_len=256).step_model()
    assert one.per_context == pytest.approx(20e-6, rel=1e-6) and one.per_request_context == 0.0
    # ... or where rows would cost nothing beyond the first (a negative or zero row slope)
    assert fit_context_slopes(np.array([1000.0, 8000.0]), np.array([1000.0, 1000.0]), np.array([0.02, 0.019])) == (
        pytest.approx(172 / 65e6, rel=1e-9), 0.0)


def test_a_cache_of_the_format_before_the_context_term_is_measured_again(tmp_path, caplog):
    cache = CostCache(tmp_path)
    record = CostRecord(FORMAT_VERSION, KEY, samples_of(cpu_like))
    path = cache.save(record)
    old = msgspec.json.decode(path.read_bytes())
    old["format_version"] = 1
    for sample in old["samples"]:
        del sample["context_len"]
    del old["context_len"]
    path.write_bytes(msgspec.json.encode(old))
    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        assert cache.load(KEY) is None
    assert "format 1" in caplog.text


def test_running_median_of_the_host_time_keeps_a_window_after_its_warm_up():
    from vllm_treespec.cost.online import RunningMedian

    host = RunningMedian(window=4, default=0.5, warmup=1)
    assert host.seconds == 0.5
    host.add(9.0)  # the warm-up sample (a first step compiles kernels) is dropped
    assert host.seconds == 0.5
    for value in (3.0, 1.0, float("nan"), -1.0):  # a bad sample is dropped too
        host.add(value)
    assert host.seconds == 2.0 and len(host) == 2  # even count: the mean of the middle two
    for value in (5.0, 7.0, 4.0):
        host.add(value)
    assert host.seconds == 4.5 and len(host) == 4  # 3.0 left the window: median of 1, 5, 7, 4


def test_the_tree_works_price_follows_the_requests_it_covers():
    """The verifier's tree work is priced by the requests a step verifies trees for: per power-of-two bucket,
    interpolated between buckets, flat below the smallest, along the line through the two largest above them, and
    the median of everything before any bucket has its minimum of samples."""
    from vllm_treespec.cost.online import RequestsMedian

    work = RequestsMedian(window=8, default=0.25, warmup=1, min_samples=3)
    assert work.predict(4) == 0.25 and not work.buckets
    work.add(9.0, 1)  # a first tree step compiles kernels: dropped
    work.add(0.001, 1)
    work.add(0.003, 16)
    assert work.predict(16) == pytest.approx(0.002) and not work.buckets  # too few per bucket: all of them
    for _ in range(2):
        work.add(0.001, 1)
        work.add(0.003, 16)
    assert work.buckets == {1: pytest.approx(0.001), 16: pytest.approx(0.003)}
    assert work.predict(1) == pytest.approx(0.001)
    assert work.predict(4) == pytest.approx(0.002)  # halfway in log2
    assert work.predict(12) == pytest.approx(0.001 + 0.002 * math.log2(12) / 4)
    for _ in range(3):
        work.add(0.002, 8)
    # above the largest bucket: 1 ms per 8 more requests, as from 8 to 16
    assert work.predict(32) == pytest.approx(0.003 + 0.001 * 16 / 8)
    assert work.predict(0) == pytest.approx(0.001)  # flat below the smallest
    for value in (float("nan"), -1.0):
        work.add(value, 16)  # a bad sample is dropped
    assert work.predict(16) == pytest.approx(0.003)
    flat = RequestsMedian(warmup=0, min_samples=1)
    for _ in range(3):
        flat.add(0.004, 2)
        flat.add(0.001, 8)
    assert flat.predict(64) == pytest.approx(0.001)  # never below the largest bucket's: work does not shrink
