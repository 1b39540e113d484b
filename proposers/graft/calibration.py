"""graft's calibration file: what ``vllm-treespec graft calibrate`` (:mod:`vllm_treespec.tools.graft_calibrate`)
writes and the ``calibration_path`` option reads — pruning checkpoints and thresholds, and the budget-by-batch table
— with the checks that checkpoints and thresholds pass, from the file or from the options."""

from __future__ import annotations

import os
from typing import Any, Sequence

import msgspec

CALIBRATION_VERSION = 1


class GraftCalibration(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What ``calibrate`` writes: the proposer reads checkpoints, thresholds and the budget table; ``report`` is for
    people (coverage per threshold, graft positions, measured step costs)."""

    version: int
    checkpoints: tuple[int, ...]
    thresholds: tuple[float, ...]
    #: batch size -> nodes per request (non-increasing); sizes between entries use the entry below
    budget_by_batch: dict[int, int] = {}
    #: measured tokens-per-forward knee (informational when budget_by_batch is given)
    knee_tokens: int | None = None
    report: dict[str, Any] = {}


def load_calibration(path: str | os.PathLike) -> GraftCalibration:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        cal = msgspec.json.decode(raw, type=GraftCalibration)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a graft calibration file ({e})") from e
    except msgspec.DecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if cal.version != CALIBRATION_VERSION:
        raise ValueError(f"{path}: calibration version {cal.version}, this build reads {CALIBRATION_VERSION}")
    check_checkpoints(f"{path}: checkpoints", cal.checkpoints)
    check_thresholds(f"{path}: thresholds", cal.thresholds)
    if len(cal.checkpoints) != len(cal.thresholds):
        raise ValueError(f"{path}: checkpoints and thresholds differ in length")
    if any(b < 1 for b in cal.budget_by_batch) or any(v < 0 for v in cal.budget_by_batch.values()):
        raise ValueError(f"{path}: budget_by_batch needs batch sizes >= 1 and budgets >= 0")
    return cal


def check_checkpoints(what: str, checkpoints: Sequence[int]) -> None:
    if any(d < 1 for d in checkpoints) or list(checkpoints) != sorted(set(checkpoints)):
        raise ValueError(f"{what} must be strictly increasing depths >= 1, got {list(checkpoints)}")


def check_thresholds(what: str, thresholds: Sequence[float]) -> None:
    if any(not 0.0 <= t <= 1.0 for t in thresholds):
        raise ValueError(f"{what} must be confidences in [0, 1], got {list(thresholds)}")
