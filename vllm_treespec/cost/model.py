"""The step-cost model: seconds per forward step as a function of the tokens in the step and the requests sharing it.

    t(T, R, E, E_R) = f(T) + c * (R - 1) + a * E + b * E_R,  then times an online correction g(T)

* ``f`` is piecewise linear through the median time at each measured token count (the knots), flat below the
  first knot and extended beyond the last with the slope of its upper knots. It is not forced to be monotone: on CPUs
  the GEMM path changes with the row count (SmolLM2-135M fp32, one thread, 2-core EPYC: 1 token 42 ms, 2 tokens 48 ms,
  4 tokens 33 ms), and the allocator handles any shape; ``monotone=True`` fits the closest non-decreasing curve
  (isotonic regression) instead;
* ``c >= 0`` is a per-request term (attention and bookkeeping per sequence), a least-squares fit of the multi-request
  samples' residuals;
* ``a * E`` prices the context: every row of a step attends to its request's whole sequence, so a row costs more
  the longer that sequence is (on one AVX2 thread, fp32, SmolLM2-135M: a 32-token step took ~7x a plain step at
  1,900 tokens of context, ~3.7x at 256). ``E`` is the step's rows times their sequence lengths beyond the sweep's context
  (:func:`context_excess`; 0 at the sweep's own context), and ``a >= 0`` a least-squares fit of the residuals of
  samples timed at a longer context;
* ``b * E_R`` prices reading each request's sequence once, whatever its rows: ``E_R`` is the step's requests' sequence
  lengths beyond the sweep's context, summed (one row each in :func:`context_excess`). A request's first row pays
  ``a + b`` a position, its tree rows ``a`` (2-core Zen 1 EPYC, fp32: one request at 2,048 positions read 37 ms
  beyond the curve, 8 and 16 of its rows 98 and 164 ms: ~20 us a position for the first row, ~4.8 for each other;
  one slope for all rows, 6 us, priced a decode step's context at a third of what it took). ``a`` and ``b`` are fit
  together where the long-context samples have more than one row per request; else ``b`` is 0. A caller that does not
  know ``E_R`` gets ``E * R / T``, exact when every request has the same sequence length;
* ``g`` is learnt from the engine's own step times (:meth:`StepCostModel.observe`): an exponentially weighted mean of
  log(observed / predicted) per power-of-two token bucket, interpolated in log2(T) between the buckets seen so far,
  so that drift, other load and costs the sweep cannot see (the tree-attention path) are followed. Plain steps and
  steps that verify drafts learn apart (``correction``, ``draft_correction``; a prediction names the step's tokens
  without drafts, ``plain_tokens``): the sweep times one request's tree rows, and eight requests' decode rows cost
  less than one request's eight tree rows, so a table shared by both kinds priced a plain step by its last verifying
  steps of about as many tokens (fp32, 7 requests: plain steps predicted at ~97 ms, measured ~70). Verifying steps
  also learn, per power-of-two bucket of requests, what their bucket takes beyond the table of all verifying steps
  (``draft_by_requests``): a step of 16 requests verifying 10 drafts and one of 4 requests verifying 22 share a token
  bucket but not a cost (bf16, served: the shared table priced the first 11-14% below its measured time).

Nothing here is specific to a device: a GPU's measured points give a flat ``f`` and so a flat curve. The fitted points
are cached on disk per engine (:class:`CostCache`, keyed by :class:`CostKey`); a corrupt or foreign file is ignored
with one log line. Imports numpy and msgspec only; predictions take :mod:`.fast_predict`'s compiled kernel where Numba
is installed.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Sequence

import msgspec
import numpy as np

from vllm_treespec.cost.online import log2_bucket
from vllm_treespec.settings import default_cache_dir, write_json_atomically

logger = logging.getLogger("vllm.treespec")

#: bump when the meaning of a cached record changes; records of other versions are foreign (2: samples at a longer
#: context, the context term)
FORMAT_VERSION = 2
#: the sequence length of the sweep's timed requests (its curve f holds rows attending to this many positions)
DEFAULT_CONTEXT_LEN = 256
CACHE_SUBDIR = "cost_models"
DEFAULT_ALPHA = 0.1
#: one observation counts as at most this factor off the bucket's current correction (a GC pause is not a trend)
MAX_OBSERVED_RATIO = 4.0
#: a sweep with fewer single-request token counts than this (its grid ended early: the machine was busy) is used
#: for the engine that measured it but not cached
MIN_CACHED_POINTS = 4
#: nor is a sweep whose rounds disagree: the median over its points of (slowest - fastest) / median above this. A
#: busy machine's start-up sweep (bf16, 2-core EPYC: 0.34, single points 0.14-0.66; quiet sweeps 0.06-0.15) priced 24
#: tokens below 16, and every later engine of the machine verified at that price (16-request verifying steps 21-26%
#: above their predictions)
MAX_CACHED_SPREAD = 0.25


class StepSample(msgspec.Struct, frozen=True):
    """One timed step: ``num_tokens`` tokens of ``num_reqs`` requests took ``seconds``; ``context_len``: the
    sequence length of its requests, 0 for the sweep's own (the record's ``context_len``)."""

    num_tokens: int
    num_reqs: int
    seconds: float
    context_len: int = 0


def context_excess(rows: np.ndarray | float, seq_lens: np.ndarray | float, reference: int) -> float:
    """The context term's ``E`` of a step: each request's rows times how far its sequence length at the end of the
    step is beyond ``reference`` (the sweep's context), summed (negative below it: shorter rows cost less)."""
    return float(np.sum(np.asarray(rows, np.float64) * (np.asarray(seq_lens, np.float64) - reference)))


def fit_context_slopes(excess: np.ndarray, request_excess: np.ndarray, residual: np.ndarray) -> tuple[float, float]:
    """(a, b) of the context terms (module docstring) by least squares on the residuals of samples timed at other
    contexts, both at least 0; b is 0 (one slope for every row) where the samples cannot tell the terms apart (one
    row per request in all of them) or the joint fit gives either a negative slope."""
    single = max(float(np.dot(excess, residual) / np.dot(excess, excess)), 0.0) if np.dot(excess, excess) > 0 else 0.0
    design = np.stack([excess, request_excess], axis=1)
    if np.linalg.matrix_rank(design) < 2:
        return single, 0.0
    (a, b), *_ = np.linalg.lstsq(design, residual, rcond=None)
    if a <= 0 or b < 0:
        return single, 0.0
    return float(a), float(b)


def isotonic(y: Sequence[float], weights: Sequence[float] | None = None) -> np.ndarray:
    """The non-decreasing sequence closest to ``y`` in weighted least squares (pool adjacent violators)."""
    y = np.asarray(y, np.float64)
    w = np.ones_like(y) if weights is None else np.asarray(weights, np.float64)
    blocks: list[list[float]] = []  # [weighted mean, weight, length]
    for value, weight in zip(y.tolist(), w.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return np.concatenate([np.full(n, v) for v, _, n in blocks]) if blocks else y


class PiecewiseLinear:
    """Piecewise-linear curve through ``(x, y)`` knots; flat below the first knot, extended beyond the last one
    with the least-squares slope of the knots in the upper half of the range (at least the last two; floored at 0;
    flat with a single knot): one noisy knot at the end of a short sweep (fp32 on an AVX2 CPU: 107.6 ms at 8
    tokens, 111.2 at 12, a last segment of 0.9 ms per token where rows cost ~4) must not price every large tree.
    ``monotone``: through the closest non-decreasing values instead (weighted by ``weights``)."""

    def __init__(self, x: Sequence[float], y: Sequence[float], weights: Sequence[float] | None = None,
                 monotone: bool = False) -> None:
        x = np.asarray(x, np.float64)
        y = np.asarray(y, np.float64)
        if x.size == 0 or x.shape != y.shape:
            raise ValueError("a curve needs at least one knot and as many values as knots")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(y >= 0)):
            raise ValueError("knots must be finite and values non-negative")
        order = np.argsort(x, kind="stable")
        x, y = x[order], y[order]
        if np.any(np.diff(x) <= 0):
            raise ValueError("knots must be distinct")
        self.x = x
        self.y = isotonic(y, None if weights is None else np.asarray(weights, np.float64)[order]) if monotone else y
        self.tail_slope = _tail_slope(x, self.y)
        self._knots: tuple[list[float], list[float]] | None = None

    def __call__(self, x: float | np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        inside = np.interp(x, self.x, self.y)
        return np.where(x > self.x[-1], self.y[-1] + self.tail_slope * (x - self.x[-1]), inside)

    def at(self, x: float) -> float:
        """The curve at one point, without numpy (what the engine prices once per step)."""
        if self._knots is None:
            self._knots = (self.x.tolist(), self.y.tolist())
        xs, ys = self._knots
        if x > xs[-1]:
            return ys[-1] + self.tail_slope * (x - xs[-1])
        if x <= xs[0]:
            return ys[0]
        j = bisect.bisect_right(xs, x) - 1
        if xs[j] == x:
            return ys[j]
        return ys[j] + (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (x - xs[j])


def _tail_slope(x: np.ndarray, y: np.ndarray) -> float:
    """The least-squares slope of the knots with ``x >= x[-1] / 2`` (at least the last two), floored at 0."""
    if x.size < 2:
        return 0.0
    upper = max(int(np.count_nonzero(x >= x[-1] / 2)), 2)
    xs, ys = x[-upper:], y[-upper:]
    dx = xs - xs.mean()
    return max(float(np.dot(dx, ys - ys.mean()) / np.dot(dx, dx)), 0.0)


class OnlineCorrection:
    """Multiplicative correction from observed / predicted ratios.

    Each observation updates the bucket ``round(log2(x))`` with an exponentially weighted mean of the log ratio,
    clipped to within ``max_ratio`` of the bucket's current value (bias-corrected, with a prior worth one
    observation of ratio 1, so one step cannot swing a bucket fully, while a lasting change of any size is followed),
    and of log2(x) itself, with the same weights: the bucket's knot. :meth:`factor` interpolates the knots in log2(x)
    and is flat beyond them (1 before any observation). A knot sits where its bucket's steps are: a batch-1 step
    verifying 5 drafts has 6 tokens, and with the knot at 8 tokens its correction was interpolated with the 4-token
    bucket's, which few steps reach (12% low on a held-out run).
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA, max_ratio: float = MAX_OBSERVED_RATIO) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.max_log = math.log(max_ratio)
        self._mean: dict[int, float] = {}
        self._weight: dict[int, float] = {}
        #: per bucket, the exponentially weighted sum of its observations' log2(x), and of their weights
        self._position: dict[int, tuple[float, float]] = {}
        self._table: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def observed(self) -> bool:
        """Whether any observation was folded in."""
        return bool(self._mean)

    @staticmethod
    def bucket(x: float) -> int:
        """The bucket an observation at ``x`` updates."""
        return log2_bucket(x)

    def observe(self, x: float, ratio: float) -> None:
        if not (math.isfinite(ratio) and ratio > 0 and x >= 1):
            return
        bucket = self.bucket(x)
        a = self.alpha
        current = self._mean[bucket] / self._weight[bucket] if bucket in self._mean else 0.0
        e = min(max(math.log(ratio), current - self.max_log), current + self.max_log)
        self._mean[bucket] = (1 - a) * self._mean.get(bucket, 0.0) + a * e
        position, weight = self._position.get(bucket, (0.0, 0.0))
        self._position[bucket] = ((1 - a) * position + a * math.log2(x), (1 - a) * weight + a)
        self._weight[bucket] = (1 - a) * self._weight.get(bucket, a) + a
        self._table = None

    @property
    def buckets(self) -> dict[int, float]:
        """Bucket (log2 of tokens) -> current factor."""
        return {b: math.exp(self._mean[b] / self._weight[b]) for b in sorted(self._mean)}

    def factor(self, x: float | np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        if not self._mean:
            return np.ones_like(x)
        return factor_at_knots(x, *self.knots())

    def knots(self) -> tuple[np.ndarray, np.ndarray]:
        """(log2 of tokens, log of the factor) at each bucket's knot, in bucket order; empty before any observation.
        Kept until the next observation."""
        if self._table is None:
            keys = sorted(self._mean)
            self._table = (np.array([self._knot(b) for b in keys], np.float64),
                           np.array([self._mean[b] / self._weight[b] for b in keys], np.float64))
        return self._table

    def _knot(self, bucket: int) -> float:
        """Where bucket ``bucket``'s correction applies: the weighted mean log2(x) of its observations."""
        position, weight = self._position[bucket]
        return position / weight

    def reset(self) -> None:
        self._mean.clear()
        self._weight.clear()
        self._position.clear()
        self._table = None


def factor_at_knots(x: np.ndarray, anchors: np.ndarray, logs: np.ndarray) -> np.ndarray:
    """A correction's factor at ``x``: its knots' logs interpolated in log2(x), flat beyond them."""
    return np.exp(np.interp(np.log2(np.maximum(x, 1.0)), anchors, logs))


_KERNEL: list = []  # [the compiled prediction, or None where Numba is missing], imported at the first prediction


def _predict_kernel() -> Callable | None:
    if not _KERNEL:
        try:
            from vllm_treespec.cost.fast_predict import predict_kernel
        except ImportError:  # standalone scripts on a machine without Numba: the NumPy path
            predict_kernel = None
        _KERNEL.append(predict_kernel)
    return _KERNEL[0]


def _medians(samples: Iterable[StepSample]) -> dict[tuple[int, int], tuple[float, int]]:
    """(tokens, requests) -> (median seconds, count), ignoring non-positive or non-finite timings."""
    groups: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        if s.num_tokens >= 1 and s.num_reqs >= 1 and math.isfinite(s.seconds) and s.seconds > 0:
            groups.setdefault((int(s.num_tokens), int(s.num_reqs)), []).append(float(s.seconds))
    return {k: (float(np.median(v)), len(v)) for k, v in groups.items()}


class StepCostModel:
    """Predicted seconds of a forward step; see the module docstring for the form."""

    def __init__(self, curve: PiecewiseLinear, per_request: float = 0.0, alpha: float = DEFAULT_ALPHA,
                 per_context: float = 0.0, reference_context: int = DEFAULT_CONTEXT_LEN,
                 per_request_context: float = 0.0) -> None:
        self.curve = curve
        self.per_request = max(float(per_request), 0.0)
        self.per_context = max(float(per_context), 0.0)  # a: seconds per row and position of context beyond
        #: b: seconds per request and position of context beyond the reference, on top of its rows' ``a``
        self.per_request_context = max(float(per_request_context), 0.0) if self.per_context else 0.0
        self.reference_context = int(reference_context)
        self.correction = OnlineCorrection(alpha)  # plain steps'
        self.draft_correction = OnlineCorrection(alpha)  # steps that verify drafts, at every request count
        #: log2 bucket of requests -> what that bucket's verifying steps take beyond ``draft_correction``
        self.draft_by_requests: dict[int, OnlineCorrection] = {}
        self._draft_knots: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per request bucket, until an observation

    @classmethod
    def fit(cls, samples: Iterable[StepSample], alpha: float = DEFAULT_ALPHA, monotone: bool = False,
            reference_context: int = DEFAULT_CONTEXT_LEN) -> StepCostModel:
        """Knots from the single-request samples at the sweep's context (median per token count), the per-request
        term from the other samples there, the context term from the samples at other contexts."""
        samples = list(samples)
        medians = _medians(s for s in samples if s.context_len in (0, reference_context))
        single = sorted((t, m, n) for (t, r), (m, n) in medians.items() if r == 1)
        if not single:
            raise ValueError("a step-cost fit needs timed single-request steps")
        curve = PiecewiseLinear([t for t, _, _ in single], [m for _, m, _ in single], [n for _, _, n in single],
                                monotone)
        multi = [(t, r, m) for (t, r), (m, _) in medians.items() if r > 1]
        per_request = 0.0
        if multi:
            extra = np.array([r - 1 for _, r, _ in multi], np.float64)
            residual = np.array([m for _, _, m in multi]) - curve(np.array([t for t, _, _ in multi], np.float64))
            per_request = float(max(np.dot(extra, residual) / np.dot(extra, extra), 0.0))
        model = cls(curve, per_request, alpha, 0.0, reference_context)
        longer = [(t, r, c, m) for c in sorted({s.context_len for s in samples} - {0, reference_context})
                  for (t, r), (m, _) in _medians(s for s in samples if s.context_len == c).items()]
        if longer:
            excess = np.array([context_excess(t, c, reference_context) for t, _, c, _ in longer], np.float64)
            request_excess = np.array([context_excess(r, c, reference_context) for _, r, c, _ in longer], np.float64)
            residual = np.array([m - float(model.base(t, r)) for t, r, _, m in longer])
            model.per_context, model.per_request_context = fit_context_slopes(excess, request_excess, residual)
        return model

    # --- prediction ----------------------------------------------------------------------------------------------
    def base(self, num_tokens: float | np.ndarray, num_reqs: int = 1, excess: float | np.ndarray = 0.0,
             request_excess: float | np.ndarray | None = None) -> np.ndarray:
        """The fitted curve without the online correction (``excess``, ``request_excess``: the context terms' E and
        E_R, see the module; E_R None: ``E * R / T``)."""
        seconds = self.curve(num_tokens) + self.per_request * max(int(num_reqs) - 1, 0)
        if self.per_context:
            seconds = np.maximum(seconds + self.context_seconds(num_tokens, num_reqs, excess, request_excess),
                                 0.5 * seconds)
        return seconds

    def context_seconds(self, num_tokens: float | np.ndarray, num_reqs: int, excess: float | np.ndarray,
                        request_excess: float | np.ndarray | None = None) -> np.ndarray:
        """The context terms ``a * E + b * E_R`` (E_R None: ``E * R / T``)."""
        excess = np.asarray(excess, np.float64)
        if not self.per_request_context:
            return self.per_context * excess
        if request_excess is None:
            request_excess = excess * int(num_reqs) / np.maximum(np.asarray(num_tokens, np.float64), 1.0)
        return self.per_context * excess + self.per_request_context * np.asarray(request_excess, np.float64)

    def factor(self, num_tokens: float | np.ndarray, plain_tokens: float | None = None,
               num_reqs: int = 1) -> np.ndarray:
        """The online correction at each token count: plain steps' up to ``plain_tokens`` (None: at every count),
        that of steps verifying drafts among ``num_reqs`` requests above it; a table with no observation yet
        borrows the other's."""
        tokens = np.asarray(num_tokens, np.float64)
        plain_table = self.correction if self.correction.observed else self.draft_correction
        plain = plain_table.factor(tokens)
        if plain_tokens is None:
            return plain
        anchors, logs = self.draft_knots(num_reqs)
        draft = factor_at_knots(tokens, anchors, logs) if len(anchors) else np.ones_like(tokens)
        return np.where(tokens > plain_tokens, draft, plain)

    def draft_knots(self, num_reqs: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(log2 of tokens, log of the factor) of verifying steps among ``num_reqs`` requests: the table of all
        verifying steps (the plain steps' before any) times their request bucket's own, summed knot by knot (both
        are piecewise linear in log2(tokens) and flat beyond their knots, and so is their sum on the union of the
        knots)."""
        pooled = self.draft_correction if self.draft_correction.observed else (
            self.correction if self.correction.observed else self.draft_correction)
        bucket = log2_bucket(num_reqs)
        own = self.draft_by_requests.get(bucket)
        if own is None or not own.observed:
            return pooled.knots()
        knots = self._draft_knots.get(bucket)
        if knots is None:
            (pooled_x, pooled_y), (own_x, own_y) = pooled.knots(), own.knots()
            anchors = np.union1d(pooled_x, own_x)
            logs = np.interp(anchors, own_x, own_y) + (np.interp(anchors, pooled_x, pooled_y) if len(pooled_x) else 0.0)
            knots = self._draft_knots[bucket] = (anchors, logs)
        return knots

    def predict_many(self, num_tokens: float | np.ndarray, num_reqs: int = 1, excess: float | np.ndarray = 0.0,
                     plain_tokens: float | None = None, request_excess: float | None = None) -> np.ndarray:
        """``plain_tokens``: the step's tokens without drafts; counts above it are priced as steps that verify
        drafts (None: every count as a plain step). ``request_excess``: the context term's E_R, the same at every
        count (drafts add rows, not requests; None: ``E * R / T`` at each)."""
        tokens = np.asarray(num_tokens, np.float64)
        kernel = _predict_kernel()
        if kernel is None:
            return self.base(tokens, num_reqs, excess, request_excess) * self.factor(tokens, plain_tokens, num_reqs)
        flat = tokens if tokens.ndim == 1 and tokens.flags.c_contiguous else np.ascontiguousarray(tokens.reshape(-1))
        if not self.per_context:
            excess = flat  # not read
        elif isinstance(excess, np.ndarray) and excess.shape == flat.shape and excess.dtype == np.float64 \
                and excess.flags.c_contiguous:
            pass
        else:
            excess = np.ascontiguousarray(np.broadcast_to(np.asarray(excess, np.float64), tokens.shape).reshape(-1))
        plain_table = self.correction if self.correction.observed else self.draft_correction
        plain_anchors, plain_logs = plain_table.knots()
        draft_anchors, draft_logs = self.draft_knots(num_reqs)
        seconds = kernel(flat, excess, int(num_reqs), 0.0 if plain_tokens is None else float(plain_tokens),
                         plain_tokens is not None, self.curve.x, self.curve.y, float(self.curve.tail_slope),
                         self.per_request, self.per_context, self.per_request_context,
                         0.0 if request_excess is None else float(request_excess), request_excess is not None,
                         plain_anchors, plain_logs, draft_anchors, draft_logs)
        return seconds if seconds.shape == tokens.shape else seconds.reshape(tokens.shape)

    def predict(self, num_tokens: float, num_reqs: int = 1, excess: float = 0.0,
                plain_tokens: float | None = None, request_excess: float | None = None) -> float:
        """Seconds of a step with ``num_tokens`` tokens from ``num_reqs`` requests (``excess``, ``request_excess``:
        its context terms' E and E_R, :func:`context_excess`; ``plain_tokens``: as :meth:`predict_many`)."""
        return float(self.predict_many(num_tokens, num_reqs, excess, plain_tokens, request_excess))

    def marginal(self, num_tokens: float, num_reqs: int = 1, extra: int = 1) -> float:
        """Seconds added by ``extra`` more tokens (drafts) in a step that has ``num_tokens`` (per added token if
        extra > 1: the mean)."""
        return (self.predict(num_tokens + extra, num_reqs, plain_tokens=num_tokens)
                - self.predict(num_tokens, num_reqs, plain_tokens=num_tokens)) / extra

    # --- online refinement -----------------------------------------------------------------------------------------
    def observe(self, num_tokens: int, num_reqs: int, seconds: float, excess: float = 0.0, drafts: int = 0,
                request_excess: float | None = None) -> None:
        """Fold one observed step time into the correction of its token bucket: the plain steps' table, or with
        ``drafts`` > 0 (draft tokens verified in the step) that of steps verifying drafts."""
        base = self.curve.at(float(num_tokens)) + self.per_request * max(int(num_reqs) - 1, 0)
        if self.per_context:  # as base()
            base = max(base + float(self.context_seconds(num_tokens, num_reqs, excess, request_excess)), 0.5 * base)
        if base <= 0:
            return
        if drafts <= 0:
            self.correction.observe(num_tokens, seconds / base)
            return
        # the request bucket's own table learns what the shared one, as it was, left over
        shared = float(self.draft_correction.factor(float(num_tokens))) if self.draft_correction.observed else 1.0
        self.draft_correction.observe(num_tokens, seconds / base)
        own = self.draft_by_requests.setdefault(log2_bucket(num_reqs), OnlineCorrection(self.draft_correction.alpha))
        own.observe(num_tokens, seconds / (base * shared))
        self._draft_knots.clear()

    def table(self, tokens: Sequence[int], num_reqs: int = 1) -> list[tuple[int, int, float, float]]:
        """(tokens, requests, seconds, marginal seconds per token) for each token count."""
        return [(int(t), num_reqs, self.predict(t, num_reqs), self.marginal(t, num_reqs)) for t in tokens]


class CurveModel:
    """A one-argument cost (a drafter's seconds as a function of the requests it drafts for): the same
    piecewise-linear fit and online correction as :class:`StepCostModel`, on samples' ``num_reqs``."""

    def __init__(self, curve: PiecewiseLinear, alpha: float = DEFAULT_ALPHA) -> None:
        self.curve = curve
        self.correction = OnlineCorrection(alpha)  # plain steps'
        self.draft_correction = OnlineCorrection(alpha)  # steps that verify drafts

    @classmethod
    def fit(cls, samples: Iterable[StepSample], alpha: float = DEFAULT_ALPHA, monotone: bool = False) -> CurveModel:
        medians = _medians(samples)
        by_reqs: dict[int, list[tuple[float, int]]] = {}
        for (_, r), (m, n) in medians.items():
            by_reqs.setdefault(r, []).append((m, n))
        if not by_reqs:
            raise ValueError("a cost fit needs timed samples")
        xs = sorted(by_reqs)
        ys = [float(np.median([m for m, _ in by_reqs[x]])) for x in xs]
        return cls(PiecewiseLinear(xs, ys, [sum(n for _, n in by_reqs[x]) for x in xs], monotone), alpha)

    def predict(self, x: float) -> float:
        return float(self.curve(x) * self.correction.factor(x))

    def observe(self, x: float, seconds: float) -> None:
        base = float(self.curve(x))
        if base > 0:
            self.correction.observe(x, seconds / base)


# ------------------------------------------------------------------------------------------------------------------
# Disk cache


class CostKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a measured curve depends on."""

    model: str
    dtype: str
    device: str
    vllm_version: str
    torch_threads: int
    linear: str = "vllm"  # the CPU dense linear the layers use (vllm_treespec.patches.cpu_gemm.kernel_summary)
    tree_attention: str = ""  # the CPU tree-row kernel (vllm_treespec.attn.cpu_kernel.kernel_summary); "" elsewhere
    #: how the engine runs its forward (vllm_treespec.cost.measure.execution_summary): a compiled model, or captured
    #: CUDA graphs, spends far less per step outside its matmuls than an eager one (on a 2-core CPU, a 1-token step
    #: of 19.5 ms compiled against 27 eager), so their curves differ in shape, not by a factor
    execution: str = ""

    def digest(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]

    def file_name(self) -> str:
        stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(self.model.rstrip("/")).name or "model")[:48]
        return f"{stem}-{self.dtype}-{self.digest()}.json"


class CostRecord(msgspec.Struct, forbid_unknown_fields=True):
    """A cached measurement: the engine it was made on and its timed steps (drafter probes by drafter name)."""

    format_version: int
    key: CostKey
    samples: list[StepSample]
    drafters: dict[str, list[StepSample]] = {}
    measured_at: float = 0.0
    context_len: int = DEFAULT_CONTEXT_LEN  # the sequence length of the samples whose context_len is 0

    def step_model(self, alpha: float = DEFAULT_ALPHA) -> StepCostModel:
        return StepCostModel.fit(self.samples, alpha, reference_context=self.context_len)

    @property
    def single_request_points(self) -> int:
        return len({s.num_tokens for s in self.samples if s.num_reqs == 1 and s.context_len in (0, self.context_len)})

    def not_cacheable(self) -> str | None:
        """Why this record must not become the machine's cached curve (None: it may): a grid that ended early or
        rounds that disagree (the machine was busy?)."""
        if self.single_request_points < MIN_CACHED_POINTS:
            return f"the sweep covered {self.single_request_points} token counts (the machine was busy?)"
        spread = self.round_spread
        if spread is not None and spread > MAX_CACHED_SPREAD:
            return (f"the sweep's rounds disagree by {100 * spread:.0f}% at a median point, more than "
                    f"{100 * MAX_CACHED_SPREAD:.0f}% (the machine was busy?)")
        return None

    @property
    def round_spread(self) -> float | None:
        """How far the sweep's rounds disagree: the median over its points timed at least three times of (slowest -
        fastest) / median; None when no point was."""
        times: dict[tuple[int, int, int], list[float]] = {}
        for s in self.samples:
            times.setdefault((s.num_tokens, s.num_reqs, s.context_len), []).append(s.seconds)
        spreads = [(max(v) - min(v)) / float(np.median(v)) for v in times.values() if len(v) >= 3 and np.median(v) > 0]
        return float(np.median(spreads)) if spreads else None


def _key_difference(found: CostKey, wanted: CostKey) -> str:
    fields = [f for f in CostKey.__struct_fields__ if getattr(found, f) != getattr(wanted, f)]
    return ", ".join(f"{f}={getattr(found, f)!r} (this engine: {getattr(wanted, f)!r})" for f in fields)


class CostCache:
    """``<cache>/cost_models/<model>-<dtype>-<key digest>.json``: one :class:`CostRecord` per engine key."""

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_cache_dir() / CACHE_SUBDIR

    def path(self, key: CostKey) -> Path:
        return self.root / key.file_name()

    def load(self, key: CostKey) -> CostRecord | None:
        """The cached record for ``key``; None (and one log line) when it is unreadable, corrupt or another
        engine's; None silently when there is none."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            logger.warning("vllm_treespec: cannot read the cost-model cache %s (%s); measuring again", path, e)
            return None
        try:
            record = msgspec.json.decode(data, type=CostRecord)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            version = _format_version_of(data)
            if version is not None and version != FORMAT_VERSION:
                logger.warning("vllm_treespec: ignoring the cost-model cache %s (format %s, this version reads %d); "
                               "measuring again", path, version, FORMAT_VERSION)
            else:
                logger.warning("vllm_treespec: ignoring the corrupt cost-model cache %s (%s); measuring again",
                               path, e)
            return None
        if record.format_version != FORMAT_VERSION or record.key != key:
            why = (f"format {record.format_version}, this version reads {FORMAT_VERSION}"
                   if record.format_version != FORMAT_VERSION else _key_difference(record.key, key))
            logger.warning("vllm_treespec: ignoring the cost-model cache %s made for another engine (%s); "
                           "measuring again", path, why)
            return None
        try:
            record.step_model()
        except ValueError as e:
            logger.warning("vllm_treespec: ignoring the corrupt cost-model cache %s (%s); measuring again", path, e)
            return None
        return record

    def save(self, record: CostRecord) -> Path | None:
        """Write atomically (temporary file renamed into place); None and one log line if the folder is not
        writable."""
        path = self.path(record.key)
        try:
            write_json_atomically(path, record)
        except OSError as e:
            logger.warning("vllm_treespec: cannot write the cost-model cache %s (%s)", path, e)
            return None
        return path


def _format_version_of(data: bytes) -> int | None:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    version = value.get("format_version") if isinstance(value, dict) else None
    return version if isinstance(version, int) else None


def load_or_measure(key: CostKey, measure: Callable[[], CostRecord], cache: CostCache | None = None,
                    refresh: bool = False, check: Callable[[CostRecord], str | None] | None = None
                    ) -> tuple[CostRecord, bool]:
    """The cached record for ``key`` or a fresh ``measure()``; returns (record, came from cache). ``check``: a
    spot check of a cached record against the engine as it runs now (None when it holds, else why not: then one
    log line and a fresh measurement). A fresh record is saved when it covers at least ``MIN_CACHED_POINTS``
    token counts and its rounds agree (``MAX_CACHED_SPREAD``); else only this engine uses it, and a cached record
    it was to replace stays for the next engine to check. A cached record whose rounds agreed better than such a
    sweep's is kept for this engine too: the online correction follows a level that moved, not a shape measured on
    a busy machine."""
    cache = cache or CostCache()
    cached = None if refresh else cache.load(key)
    if cached is not None:
        stale = check(cached) if check is not None else None
        if stale is None:
            return cached, True
        logger.warning("vllm_treespec: the cached step-cost curve %s no longer fits this engine (%s); measuring "
                       "again", cache.path(key), stale)
    record = measure()
    reason = record.not_cacheable()
    if reason is None:
        cache.save(record)
        return record, False
    spread, before = record.round_spread, cached.round_spread if cached is not None else None
    if spread is not None and before is not None and before < spread:
        logger.warning("vllm_treespec: %s; the cached curve's rounds disagreed by %.0f%%: keeping the cached curve",
                       reason, 100 * before)
        return cached, True
    logger.warning("vllm_treespec: %s; using it for this engine, not caching it", reason)
    return record, False
