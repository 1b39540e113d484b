"""Graft's pruning rule, the one definition: a draft stops growing at the first confidence checkpoint its best path
falls below (Graft, "Draft Less, Retrieve More", arXiv 2605.20104).

Checkpoints are ``{depth: threshold}``: after the draft reaches ``depth`` levels below the root, the best path
confidence there, ``exp(max cumulative log-prob at that depth)``, is compared with the threshold. Graft applies the
rule to every draft it grows (:mod:`vllm_treespec.proposers.graft.growth`); the EAGLE drafter applies it while it
expands (:mod:`vllm_treespec.eagle.drafter`), so that levels graft would prune are never drafted. Imports neither
vLLM nor torch.
"""

from __future__ import annotations

import math


def below_checkpoint(checkpoints: dict[int, float] | None, depth: int, best_log_score: float) -> bool:
    """Whether the best path at ``depth`` (cumulative log-prob) falls below that depth's checkpoint threshold (graft's
    pruning rule; the drafter stops where graft would prune)."""
    threshold = (checkpoints or {}).get(depth)
    return threshold is not None and math.exp(best_log_score) < threshold
