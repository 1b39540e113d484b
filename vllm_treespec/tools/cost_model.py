"""``vllm-treespec cost-model``: measure an engine's step-cost curve, print it, plot it, cache it.

Starts an engine on the model (default: the embedded SmolLM2-135M-Instruct), runs the start-up sweep of
:mod:`vllm_treespec.cost.measure` in its worker, fits :class:`~vllm_treespec.cost.model.StepCostModel` and prints
tokens, requests, measured and fitted ms per step and the marginal ms per added token; writes a matplotlib plot and
the engine's cost-model cache (what every tree-method engine of the same model, dtype, device, vLLM, thread count,
linear kernel and compile mode loads at start-up instead of running its own shorter sweep), unless the sweep's
rounds disagree as a busy machine's do (:meth:`~vllm_treespec.cost.model.CostRecord.not_cacheable`).
``--held-out`` also times points outside the fit grid in the same rounds and prints predicted vs measured.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Sequence

import msgspec
import numpy as np

HELD_OUT = ((5, 1), (7, 1), (10, 1), (20, 1), (40, 1), (56, 1), (10, 2), (20, 4), (40, 8))


def parse_points(text: str) -> list[tuple[int, int]]:
    """``"3,6,12x1,24x8"`` -> [(3, 1), (6, 1), (12, 1), (24, 8)]: tokens, optionally ``x`` requests."""
    points = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        tokens, _, reqs = item.partition("x")
        points.append((int(tokens), int(reqs or 1)))
    return points


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-treespec cost-model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder or name (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, auto")
    parser.add_argument("--points", type=parse_points, default=None,
                        help="fit points as TOKENS[xREQUESTS],… (default: 1-4, 6, 8, 12 … 64 tokens at 1 request, "
                             "2/4/8 requests at 1 and 4 tokens each)")
    parser.add_argument("--held-out", nargs="?", const=HELD_OUT, type=parse_points, default=(),
                        help="also time points outside the fit (default set: "
                             + ",".join(f"{t}x{r}" for t, r in HELD_OUT) + ") and print predicted vs measured")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median per point)")
    parser.add_argument("--context-len", type=int, default=256, help="context length of the timed requests")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds the timed rounds may take")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="time the eager forward, as engines started with enforce_eager run (by default vLLM "
                        "compiles the model; the two curves are cached apart)")
    # a str, not a Path: Path("") is "." and the plot would be written to a file named ".png"
    parser.add_argument("--plot", default="cost_model.png", help="plot file ('' for none)")
    parser.add_argument("--json", type=Path, default=None, help="also write the measurement as JSON here")
    parser.add_argument("--no-cache", action="store_true",
                        help="do not write the engine's cost-model cache (tree-method engines load it at start-up)")
    return parser


def format_table(model: Any, samples: Sequence[Any]) -> str:
    from vllm_treespec.cost.measure import relative_errors

    lines = [f"{'tokens':>6} {'reqs':>4} {'measured ms':>11} {'fitted ms':>9} {'marginal ms/token':>17}"]
    for t, r, measured, predicted, _ in relative_errors(model, samples):
        lines.append(f"{t:>6} {r:>4} {measured * 1e3:>11.2f} {predicted * 1e3:>9.2f} "
                     f"{model.marginal(t, r) * 1e3:>17.3f}")
    return "\n".join(lines)


def format_context(model: Any, samples: Sequence[Any]) -> str:
    """The context term and the points it was fitted on (timed at a longer context than the curve's)."""
    from vllm_treespec.cost.measure import context_errors

    lines = [f"context term: {model.per_context * 1e6:.3f} ms per row and 1000 positions of context beyond "
             f"{model.reference_context}, and {model.per_request_context * 1e6:.3f} ms more per request (its "
             f"sequence read once, whatever its rows)"]
    for t, r, c, measured, predicted, err in context_errors(model, samples):
        lines.append(f"  {t} tokens x {r} requests at context {c}: {measured * 1e3:.2f} ms measured, "
                     f"{predicted * 1e3:.2f} ms fitted ({err * 100:+.1f}%)")
    return "\n".join(lines)


def format_held_out(model: Any, samples: Sequence[Any]) -> tuple[str, float]:
    from vllm_treespec.cost.measure import relative_errors

    rows = relative_errors(model, samples)
    lines = [f"{'tokens':>6} {'reqs':>4} {'measured ms':>11} {'predicted ms':>12} {'error':>7}"]
    for t, r, measured, predicted, err in rows:
        lines.append(f"{t:>6} {r:>4} {measured * 1e3:>11.2f} {predicted * 1e3:>12.2f} {err * 100:>6.1f}%")
    worst = max((abs(e) for *_, e in rows), default=0.0)
    lines.append(f"max |error| {worst * 100:.1f}% over {len(rows)} held-out points")
    return "\n".join(lines), worst


def plot(model: Any, samples: Sequence[Any], held_out: Sequence[Any], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    reqs = sorted({s.num_reqs for s in samples} | {s.num_reqs for s in held_out})
    top = max(s.num_tokens for s in [*samples, *held_out])
    for i, r in enumerate(reqs):
        color = f"C{i}"
        xs = np.arange(r, top + 1, r)
        ax.plot(xs, model.predict_many(xs, r) * 1e3, color=color, lw=1, label=f"fit, {r} req")
        fit = [s for s in samples if s.num_reqs == r]
        ax.scatter([s.num_tokens for s in fit], [s.seconds * 1e3 for s in fit], color=color, s=10, alpha=0.5)
        out = [s for s in held_out if s.num_reqs == r]
        ax.scatter([s.num_tokens for s in out], [s.seconds * 1e3 for s in out], color=color, marker="x", s=30)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("ms per step")
    ax.set_title("step time (dots: fit points, x: held out)")
    ax.legend(fontsize=8)
    xs = np.arange(1, top + 1)
    ax2.plot(xs, [model.marginal(int(x)) * 1e3 for x in xs], color="C0")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("tokens in the step (1 request)")
    ax2.set_ylabel("marginal ms per added token")
    ax2.set_title("marginal cost")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2

    cpu_memory_defaults()
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships the sweep by pickle
    model_path = args.model or str(ensure_smollm2())
    from vllm import LLM

    from vllm_treespec.cost.measure import measure_worker
    from vllm_treespec.cost.model import CostCache, CostRecord, StepSample

    llm = LLM(model=model_path, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.max_num_seqs, seed=0,
              enforce_eager=args.enforce_eager)
    result = llm.collective_rpc(measure_worker, kwargs=dict(
        points=args.points, held_out=list(args.held_out), repeats=args.repeats, context_len=args.context_len,
        budget_s=args.budget))[0]
    held_out = msgspec.convert(result.pop("held_out"), list[StepSample])
    seconds = result.pop("seconds")
    record = msgspec.convert(result, CostRecord)
    model = record.step_model()
    key = record.key
    print(f"step-cost curve: {key.model} {key.dtype} on {key.device}, vLLM {key.vllm_version}, "
          f"{key.torch_threads} torch thread(s), {key.execution}, context {args.context_len}; sweep {seconds:.1f} s")
    print(format_table(model, record.samples))
    print(f"per-request term: {model.per_request * 1e3:.3f} ms per extra request")
    print(format_context(model, record.samples))
    worst = None
    if held_out:
        text, worst = format_held_out(model, held_out)
        print(text)
    if (spread := record.round_spread) is not None:
        print(f"rounds {100 * spread:.0f}% apart at a median point")
    if not args.no_cache:
        if (reason := record.not_cacheable()) is not None:
            print(f"cost-model cache: not written: {reason}; every later engine would price its steps by this curve, "
                  "so measure again when the machine is quiet")
        elif (path := CostCache().save(record)) is not None:
            print(f"cost-model cache: {path}")
    if args.plot:
        title = f"{Path(key.model).name} {key.dtype}, {key.device}"
        print(f"plot: {plot(model, record.samples, held_out, Path(args.plot), title)}")
    if args.json:
        args.json.write_bytes(msgspec.json.encode({**msgspec.to_builtins(record), "held_out": held_out,
                                                   "sweep_seconds": seconds, "max_held_out_error": worst}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
