"""Costs learnt only from the engine's own steps, which no start-up sweep can see: the host time of a step outside
the forward (scheduler, sampler, output processing, the verifier's tree work) and a drafter's seconds per call.
numpy only."""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

#: host-time samples kept; the median of a window ignores the odd idle gap between two batches of requests
HOST_WINDOW = 64
#: exponential weight of a new drafter timing (its first 1 / CALL_ALPHA timings of a bucket are averaged alike)
CALL_ALPHA = 0.2
#: timings a bucket of requests needs before it prices a drafter's calls (before that the drafter counts as not timed,
#: so the gate lets it draft and be timed): one timing taken while the machine was busy priced eagle_tree's head at
#: 11.4 ms a call where its other engines' read 7.8, the gate then skipped its drafts, only its probes (every 16-128
#: steps) timed it again, and 78% of that batch-1 run went plain where drafting paid 1.4x its plain steps (slice CP,
#: 2026-12-06, docs/benchmarks.md)
MIN_TIMED_CALLS = 3


#: first timings dropped: a first call compiles kernels (numba, torch) and allocates, and can take seconds; kept, it
#: would make drafting look too dear to ever try again
WARMUP_SAMPLES = 1


class RunningMedian:
    """Median of the last ``window`` finite, non-negative samples after the first ``warmup``; ``default`` before
    the first one."""

    def __init__(self, window: int = HOST_WINDOW, default: float = 0.0, warmup: int = WARMUP_SAMPLES) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self.default = default
        self.warmup = warmup
        self._median: float | None = None

    def add(self, value: float) -> None:
        if self.warmup > 0:
            self.warmup -= 1
            return
        if math.isfinite(value) and value >= 0:
            self.samples.append(float(value))
            self._median = None

    @property
    def seconds(self) -> float:
        if not self.samples:
            return self.default
        if self._median is None:
            self._median = float(statistics.median(self.samples))  # np.median of a deque: ~30 us, every step
        return self._median

    def __len__(self) -> int:
        return len(self.samples)


def log2_bucket(x: float) -> int:
    """The power-of-two bucket of ``x`` (tokens, requests): log2 of ``x`` rounded to the nearest integer (11 -> 3,
    12 -> 4). One bucketing for everything the cost model learns per size: the step-time correction, a drafter's
    call cost, a drafter gate's saving."""
    return int(round(math.log2(max(x, 1.0))))


class CallCost:
    """Seconds per call of a drafter as a function of the requests it drafts for: a running mean per power-of-two
    bucket of requests (the plain mean of its first ``1 / alpha`` timings, then exponentially weighted), interpolated
    in log2 between the buckets seen; below the smallest, that bucket's; above the largest, its seconds per request
    times the requests (a drafter's work is mostly per request: graft's call for 16 requests took 31 ms where its
    calls for one had taken 2.5, and a flat estimate let the gate draft at 16 on a call it priced at 2.5 ms). The
    first ``warmup`` calls of a bucket are not counted, and a bucket prices calls from its ``min_calls``-th counted
    one (:data:`MIN_TIMED_CALLS`); None before any bucket does."""

    def __init__(self, alpha: float = CALL_ALPHA, warmup: int = WARMUP_SAMPLES,
                 min_calls: int = MIN_TIMED_CALLS) -> None:
        self.alpha = alpha
        self.warmup = warmup
        self.min_calls = max(1, min_calls)
        #: the buckets that price calls: seconds per call by bucket
        self.buckets: dict[int, float] = {}
        self._seen: dict[int, int] = {}
        self._means: dict[int, tuple[float, int]] = {}  # by bucket: (running mean, counted timings)

    def observe(self, num_reqs: int, seconds: float) -> None:
        if num_reqs < 1 or not (math.isfinite(seconds) and seconds >= 0):
            return
        bucket = log2_bucket(num_reqs)
        self._seen[bucket] = self._seen.get(bucket, 0) + 1
        if self._seen[bucket] <= self.warmup:
            return
        mean, count = self._means.get(bucket, (0.0, 0))
        if bucket in self.buckets:  # the running mean goes on from the bucket's price (a price set directly: settled)
            mean, count = self.buckets[bucket], count if bucket in self._means else round(1 / self.alpha)
        count += 1
        mean += max(self.alpha, 1.0 / count) * (seconds - mean)
        self._means[bucket] = (mean, count)
        if count >= self.min_calls or bucket in self.buckets:
            self.buckets[bucket] = mean

    def predict(self, num_reqs: float) -> float | None:
        if not self.buckets:
            return None
        keys = sorted(self.buckets)
        largest = keys[-1]
        if num_reqs > 2 ** largest:
            return self.buckets[largest] * num_reqs / 2 ** largest
        return float(np.interp(math.log2(max(num_reqs, 1)), keys, [self.buckets[k] for k in keys]))


class RequestsMedian:
    """Seconds of host work that grows with the requests it covers (what a step verifying drafts runs beyond a plain
    step: the verifier's tree work, and vLLM's sampler, scheduler and input preparation on the draft rows): a running
    median of the last ``window`` samples per power-of-two bucket of
    requests (:func:`log2_bucket`), interpolated in log2 between the buckets with ``min_samples`` samples; below the
    smallest, that bucket's; above the largest, a line through the two largest (work per request plus a fixed
    part), never below the largest's. Before any bucket has enough samples, the median of all of them, else
    ``default``. The first ``warmup`` samples are dropped (the first tree step compiles its kernels).

    Served in bf16 (2026-12-07), the steps that verified drafts ran beyond their priced host time and tree work by
    ~0.1 ms a step at one request, ~0.4 at 4 and ~0.9-1.0 at 8 and 16: one median over every step priced them all
    alike."""

    def __init__(self, window: int = HOST_WINDOW, default: float = 0.0, warmup: int = WARMUP_SAMPLES,
                 min_samples: int = MIN_TIMED_CALLS) -> None:
        self.window = window
        self.default = default
        self.warmup = warmup
        self.min_samples = max(1, min_samples)
        self._buckets: dict[int, RunningMedian] = {}
        self._all = RunningMedian(window, default, warmup=0)
        self._prices: tuple[np.ndarray, np.ndarray] | None = None  # (log2 buckets, seconds) of the priced buckets

    def add(self, seconds: float, num_reqs: int = 1) -> None:
        if self.warmup > 0:
            self.warmup -= 1
            return
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        bucket = log2_bucket(num_reqs)
        self._buckets.setdefault(bucket, RunningMedian(self.window, warmup=0)).add(seconds)
        self._all.add(seconds)
        self._prices = None

    @property
    def seconds(self) -> float:
        """The median over every bucket's recent samples (what one step of tree work costs at the mix seen)."""
        return self._all.seconds

    @property
    def buckets(self) -> dict[int, float]:
        """Requests (a power of two) -> seconds, of the buckets that price."""
        keys, seconds = self._priced()
        return {2 ** int(k): float(s) for k, s in zip(keys, seconds)}

    def _priced(self) -> tuple[np.ndarray, np.ndarray]:
        if self._prices is None:
            keys = sorted(b for b, median in self._buckets.items() if len(median) >= self.min_samples)
            self._prices = (np.array(keys, np.float64),
                            np.array([self._buckets[k].seconds for k in keys], np.float64))
        return self._prices

    def predict(self, num_reqs: float) -> float:
        keys, seconds = self._priced()
        if not keys.size:
            return self._all.seconds if len(self._all) else self.default
        x = math.log2(max(num_reqs, 1.0))
        if x <= keys[-1] or keys.size == 1:
            return float(np.interp(x, keys, seconds))
        low, high = 2.0 ** keys[-2], 2.0 ** keys[-1]
        per_request = max((seconds[-1] - seconds[-2]) / (high - low), 0.0)
        return float(seconds[-1] + per_request * (num_reqs - high))

    def __len__(self) -> int:
        return len(self._all)
