"""Whether a run's drafting steps paid at the gate's own prices: per method, load level and round, the steps that
verified drafts (split by whether the proposer's self-gated drafter ran: graft's head) against the plain rate the
gate weighed them against.

    python scripts/drafting_steps.py OUT [--requests 5-8]

``OUT`` is a ``vllm-treespec bench serve --out OUT`` folder (each level's rounds are cut from the servers' budget
traces by the windows in ``results.json``) or any folder of ``budget-METHOD-rN.jsonl.PID`` traces (``bench --out``:
each trace whole). Per kind of drafting step: how many, their mean own time (from the step's drafting call through
its forward to the next step's call), the verifier's gate's price of them (``expected / best``: it leaves a
self-gated drafter out, whose own gate prices it), and ``vs plain``: the tokens they committed over what the gate's
plain rate for each step commits in its time (:func:`vllm_treespec.cost.trace.drafting_against_gate`). Below 1, the
gate drafted steps that lost against the plain step it weighed them against.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from vllm_treespec.cost import trace


def request_range(text: str) -> tuple[int, int | None]:
    """``"5-8"`` -> (5, 8); ``"9-"`` -> (9, None); ``"4"`` -> (4, 4)."""
    match = re.fullmatch(r"(\d+)(-(\d*))?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"--requests {text!r}: give N, N-M or N- (e.g. 5-8)")
    low = int(match.group(1))
    if match.group(2) is None:
        return low, low
    return low, int(match.group(3)) if match.group(3) else None


def describe(kinds: dict[str, dict[str, float]]) -> str:
    if not kinds:
        return "no drafting step"
    return "  ".join(f"{kind}: {k['steps']} steps, {k['ms']:.1f} ms (priced {k['priced_ms']:.1f}), "
                     f"vs plain {k['vs_plain']:.3f}" for kind, k in kinds.items())


def served_lines(out: Path, results: dict, low: int, high: int | None) -> list[str]:
    lines = []
    for method in results.get("methods", []):
        rounds: dict[int, list[dict]] = {}  # each round's trace, read once for all its levels
        for level, stats in sorted(method.get("levels", {}).items(), key=lambda item: int(item[0])):
            windows = stats.get("rounds_window") or []
            for number, window in zip(method.get("round_numbers", range(1, len(windows) + 1)), windows):
                if number not in rounds:
                    rounds[number] = trace.read(trace.files(out / f"budget-{method['label']}-r{number}.jsonl"))
                if not rounds[number] or not window:
                    continue
                steps = [s for s in rounds[number] if window[0] <= s.get("t", 0.0) <= window[1]]
                kinds = trace.drafting_against_gate(steps, low, high)
                lines.append(f"{method['label']} at {level} requests, round {number}: {describe(kinds)}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a bench serve --out folder, or a folder of budget traces")
    parser.add_argument("--requests", type=request_range, default=(1, None),
                        help="only steps of this many requests: N, N-M or N- (default: all)")
    args = parser.parse_args(argv)
    low, high = args.requests
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    lines = served_lines(args.out, results, low, high) if any(
        m.get("levels") for m in results.get("methods", []) if isinstance(m, dict)) else []
    if not lines:  # a batch-1 run (or traces alone): each trace whole
        bases = sorted({p.name.rsplit(".", 1)[0] for p in args.out.glob("budget-*.jsonl.*")
                        if not p.name.endswith(trace.RECORD_SUFFIX)})
        lines = [f"{base}: {describe(trace.drafting_against_gate(trace.read(trace.files(args.out / base)), low, high))}"
                 for base in bases]
    if not lines:
        raise SystemExit(f"{args.out}: no budget trace (budget-*.jsonl.*) found")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
