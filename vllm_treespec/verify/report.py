"""The verifier's own host time and counters (for the overhead benchmark)."""

from __future__ import annotations

from typing import Any

from vllm_treespec.attn import plan


class StepTimer:
    """Accumulates the verifier's own host time per phase (for the overhead benchmark)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def verifier_report(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: the verifier's host-time breakdown and counters on this worker."""
    verifier = getattr(worker.model_runner, "_treespec_verifier", None)
    if verifier is None:
        return {}
    seconds = dict(verifier.timer.seconds)
    seconds["mask_build"] = plan.build_seconds[0]
    return {"seconds": seconds, "steps": verifier.timer.steps, **verifier.stats}
