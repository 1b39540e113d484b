"""Held-out prompts: a benchmark of a draft head on ShareGPT prompts it was trained on is not a held-out figure.

`vllm-treespec train-eagle` draws its prompts from a span of ShareGPT's seeded shuffle (after the benchmark prefix)
and records it in the head's config.json (``treespec_training.sharegpt_positions``: ``[first, stop)``). The head has
learned the target's answers to those prompts, so drafting them is easier than drafting new text; `bench` and
`bench serve` refuse such prompts for methods that draft with a head unless told otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

#: methods that draft with an EAGLE-style head, and the option naming it (a folder; otherwise the default head)
HEAD_OPTIONS = {"graft": "eagle_checkpoint", "eagle_tree": "checkpoint", "kv_aware": "checkpoint",
                "eagle3": "model", "eagle": "model"}
#: graft's ``eagle_checkpoint`` values that draft without a head
NO_HEAD = (None, "none")


@dataclass(frozen=True)
class TrainingOverlap:
    """Benchmark prompts drawn from the span of ShareGPT a head was trained on."""

    head: Path
    span: tuple[int, int]
    positions: tuple[int, ...]

    def describe(self) -> str:
        first, stop = self.span
        return (f"{len(self.positions)} ShareGPT prompts (positions {_ranges(self.positions)} of its seeded shuffle) "
                f"lie in the span the head {self.head} was trained on ({first}-{stop - 1})")


def head_training_span(head: Path) -> tuple[int, int] | None:
    """``[first, stop)`` of ShareGPT's seeded shuffle the head's training prompts came from, or None when its
    config.json does not say (a head trained elsewhere, or by an older trainer)."""
    try:
        config = json.loads((head / "config.json").read_text())
        first, stop = config["treespec_training"]["sharegpt_positions"]
        return int(first), int(stop)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def heads_drafting(methods: Iterable[tuple[str, Mapping[str, Any]]]) -> list[Path]:
    """The head folders the given ``(method, options)`` draft with: the named folder, else the method's default head
    (the KV-aware one of its mode for ``kv_aware`` and graft's ``"kv_aware"``, the EAGLE-3 one otherwise)."""
    from vllm_treespec.proposers.eagle_tree import default_kv_head_path

    heads: list[Path] = []
    for method, options in methods:
        if method not in HEAD_OPTIONS:
            continue
        named = options.get(HEAD_OPTIONS[method], "auto")
        if method == "graft" and named in NO_HEAD:
            continue
        if isinstance(named, str) and Path(named).expanduser().is_dir():
            head = Path(named).expanduser()
        elif method in ("eagle3", "eagle"):
            continue  # vLLM's own methods name their head; no default applies
        elif method == "graft":
            head = default_kv_head_path("hybrid" if named == "kv_aware" else "hidden")
        elif method == "kv_aware":
            head = default_kv_head_path(options.get("mode") or "hybrid")
        else:
            head = default_kv_head_path("hidden")
        if head.is_dir() and head not in heads:
            heads.append(head)
    return heads


def training_overlaps(questions: Iterable[Mapping[str, Any]], heads: Iterable[Path]) -> list[TrainingOverlap]:
    """For each head that records its training span, the benchmark's ShareGPT prompts that fall in it."""
    spans = [(head, span) for head in heads if (span := head_training_span(head)) is not None]
    ids = [q["question_id"] for q in questions if q.get("category") == "sharegpt"]
    if not spans or not ids:
        return []
    from vllm_treespec.tools.data import sharegpt

    position_of = {q["question_id"]: i for i, q in enumerate(sharegpt(seed=0))}
    positions = sorted(position_of[i] for i in ids if i in position_of)
    overlaps = []
    for head, (first, stop) in spans:
        inside = tuple(p for p in positions if first <= p < stop)
        if inside:
            overlaps.append(TrainingOverlap(head, (first, stop), inside))
    return overlaps


def _ranges(positions: Iterable[int]) -> str:
    """1000, 1001, 1002, 1005 -> '1000-1002, 1005'."""
    out: list[str] = []
    for p in positions:
        if out and p == end + 1:
            end = p
            out[-1] = f"{start}-{end}"
        else:
            start = end = p
            out.append(str(p))
    return ", ".join(out) if len(out) <= 6 else ", ".join(out[:6]) + ", ..."
