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
#: exponential weight of a new drafter timing
CALL_ALPHA = 0.2


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
    """Seconds per call of a drafter as a function of the requests it drafts for: an exponentially weighted mean
    per power-of-two bucket of requests, interpolated in log2 between the buckets seen; below the smallest, that
    bucket's; above the largest, its seconds per request times the requests (a drafter's work is mostly per
    request: graft's call for 16 requests took 31 ms where its calls for one had taken 2.5, and a flat estimate
    let the gate draft at 16 on a call it priced at 2.5 ms). The first ``warmup`` calls of a bucket are not
    counted; None before the first counted call."""

    def __init__(self, alpha: float = CALL_ALPHA, warmup: int = WARMUP_SAMPLES) -> None:
        self.alpha = alpha
        self.warmup = warmup
        self.buckets: dict[int, float] = {}
        self._seen: dict[int, int] = {}

    def observe(self, num_reqs: int, seconds: float) -> None:
        if num_reqs < 1 or not (math.isfinite(seconds) and seconds >= 0):
            return
        bucket = log2_bucket(num_reqs)
        self._seen[bucket] = self._seen.get(bucket, 0) + 1
        if self._seen[bucket] <= self.warmup:
            return
        old = self.buckets.get(bucket)
        self.buckets[bucket] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def predict(self, num_reqs: float) -> float | None:
        if not self.buckets:
            return None
        keys = sorted(self.buckets)
        largest = keys[-1]
        if num_reqs > 2 ** largest:
            return self.buckets[largest] * num_reqs / 2 ** largest
        return float(np.interp(math.log2(max(num_reqs, 1)), keys, [self.buckets[k] for k in keys]))
