"""The step-cost model's prediction in one compiled call (:meth:`StepCostModel.predict_many`).

The drafter gate and the allocator price a few token counts several times a step; the same arithmetic as NumPy
array operations (two interpolations, an exponential, the context term's floor, the plain/verifying split) took
~50 us a call at any size, almost all of it per-operation overhead. Imported lazily by :mod:`.model`, which keeps
its NumPy path where Numba is missing (the GPU machine's standalone scripts import the model without it).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


@njit(cache=True)
def _interp(x, xp, fp):
    """``np.interp(x, xp, fp)`` for one point (``xp`` increasing): flat outside the knots."""
    n = xp.shape[0]
    if x <= xp[0]:
        return fp[0]
    if x >= xp[n - 1]:
        return fp[n - 1]
    lo, hi = 0, n - 1
    while hi - lo > 1:  # xp[lo] < x < xp[hi]
        mid = (lo + hi) // 2
        if xp[mid] <= x:
            lo = mid
        else:
            hi = mid
    if xp[lo] == x:
        return fp[lo]
    return fp[lo] + (fp[hi] - fp[lo]) / (xp[hi] - xp[lo]) * (x - xp[lo])


@njit(cache=True)
def _correction(x, anchors, logs):
    """:meth:`OnlineCorrection.factor` at one point (1 with no knots)."""
    if anchors.shape[0] == 0:
        return 1.0
    return math.exp(_interp(math.log2(max(x, 1.0)), anchors, logs))


@njit(cache=True)
def predict_kernel(tokens, excess, num_reqs, plain_tokens, split, curve_x, curve_y, tail_slope, per_request,
                   per_context, per_request_context, request_excess, request_excess_known, plain_anchors, plain_logs,
                   draft_anchors, draft_logs):
    """Seconds at each of ``tokens`` (``excess``: the context term's E of each; ``request_excess``: E_R of every
    one if ``request_excess_known``, else ``E * R / T`` each). ``split``: counts above ``plain_tokens`` take the
    verifying steps' correction (``draft_*``), the others the plain steps'."""
    out = np.empty(tokens.shape[0])
    last = curve_x.shape[0] - 1
    request_term = per_request * max(num_reqs - 1, 0)
    for i in range(tokens.shape[0]):
        t = tokens[i]
        if t > curve_x[last]:
            seconds = curve_y[last] + tail_slope * (t - curve_x[last])
        else:
            seconds = _interp(t, curve_x, curve_y)
        seconds += request_term
        if per_context != 0.0:
            context = per_context * excess[i]
            if per_request_context != 0.0:
                by_request = request_excess if request_excess_known else excess[i] * num_reqs / max(t, 1.0)
                context += per_request_context * by_request
            seconds = max(seconds + context, 0.5 * seconds)
        if split and t > plain_tokens:
            seconds *= _correction(t, draft_anchors, draft_logs)
        else:
            seconds *= _correction(t, plain_anchors, plain_logs)
        out[i] = seconds
    return out
