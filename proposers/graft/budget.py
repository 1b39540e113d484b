"""graft's adaptive node budget (ECHO, arXiv 2604.09603): nodes per request shrink as the batch grows, from a
measured table or a hinge cost model."""

from __future__ import annotations

import numpy as np

from vllm_treespec.device_defaults import DEFAULT_CPU_BUDGET_TABLE, DEFAULT_KNEE_TOKENS
from vllm_treespec.proposers.graft.calibration import GraftCalibration
from vllm_treespec.proposers.graft.options import GraftOptions


class BudgetCurve:
    """Nodes per request as a function of the batch size: non-increasing, between ``min_budget`` and ``max_budget``.

    With a measured table (batch size -> budget) a batch uses the entry of the largest calibrated size not above it.
    Otherwise the hinge cost model of ECHO: a forward of up to ``knee_tokens`` tokens costs about one decode step,
    so a batch of n requests gets ``knee_tokens // n - 1`` nodes each.
    """

    def __init__(self, max_budget: int, *, adaptive: bool = True, knee_tokens: int = 32, min_budget: int = 0,
                 table: dict[int, int] | None = None) -> None:
        self.max_budget, self.adaptive = int(max_budget), adaptive
        self.knee_tokens, self.min_budget = int(knee_tokens), int(min_budget)
        self.sizes = np.array(sorted(table), np.int64) if table else None
        if table:
            # enforce monotonicity: a larger batch never gets more than a smaller one
            self.budgets = np.minimum.accumulate(np.array([table[s] for s in sorted(table)], np.int64))

    def __call__(self, batch_size: int) -> int:
        if not self.adaptive:
            return self.max_budget
        n = max(1, int(batch_size))
        if self.sizes is not None:
            k = int(np.searchsorted(self.sizes, n, side="right")) - 1
            b = int(self.budgets[max(k, 0)])
        else:
            b = self.knee_tokens // n - 1
        return max(min(b, self.max_budget), min(self.min_budget, self.max_budget))


def budget_curve(opts: GraftOptions, calibration: GraftCalibration | None, kind: str, max_budget: int) -> BudgetCurve:
    """The curve the options ask for: an explicit ``knee_tokens`` is a hinge; otherwise the calibration file's
    measured table, else on CPU the table measured there, else a hinge at the calibrated or the device's knee."""
    knee = opts.knee_tokens or (calibration.knee_tokens if calibration and calibration.knee_tokens else
                                DEFAULT_KNEE_TOKENS[kind])
    table = None
    if opts.knee_tokens is None:
        if calibration is not None:
            table = calibration.budget_by_batch
        elif kind == "cpu":
            table = DEFAULT_CPU_BUDGET_TABLE
    return BudgetCurve(max_budget or 1, adaptive=opts.adaptive_budget, knee_tokens=knee, min_budget=opts.min_budget,
                       table=table)
