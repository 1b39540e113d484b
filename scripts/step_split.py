"""Where an engine step's time goes, per function, for one method against another: exact timers, not sampling.

    python scripts/step_split.py --methods 'none;graft' --dtype bfloat16
    python scripts/step_split.py --methods 'none;graft:{"num_speculative_tokens":16}' --prompts "sharegpt[2200:2202]"
    python scripts/step_split.py --batch-size 16 --prompts "sharegpt[2200:2216]" --max-tokens 64
    python scripts/step_split.py --batch-size 4 --methods 'none;graft' --plain graft --repeats 4
    python scripts/step_split.py --methods 'graft' --enforce-eager --profile 40
    python scripts/step_split.py --served bench_out/serve   # a `bench serve --step-timers` run's split
    python scripts/step_split.py --served bench_out/serve --durations Sampler.forward

Each method runs in its own child process: an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the
worker's functions can be wrapped; torch on one thread, as vLLM's CPU worker runs here), greedy, ``--batch-size``
prompts per generate call (default 1: one prompt at a time), ``--max-tokens`` each, compiled as vLLM's default
(``--enforce-eager`` for the eager forward). After a warm-up request, the functions of
:data:`vllm_treespec.patches.step_timers.TIMED` are wrapped with ``perf_counter`` timers. Printed per method: tok/s,
engine steps, ms per step, the model forward's median per token count, and each timed function's milliseconds per
engine step (inclusive; nested functions count in both). The wrappers cost about a microsecond per call, so
functions called per layer read a little high. ``profile_worker.py`` (py-spy) shows the same worker under sampling,
with the engine core in its own process. Never run it beside another torch job.

``--served OUT`` runs no engine: it prints the same split from the servers of a ``vllm-treespec bench serve
--step-timers --out OUT`` run (engine core and worker, in their own processes beside the API server), per level,
each function's median over the rounds for every method and its difference from no speculation's; with
``--durations FUNCTION``, also how that function's calls spread over call times, per round.

``--plain LABELS``: those methods' tree verifiers never draft (the path of a step whose gate says drafting does not
pay: the proposer only observes), to measure what a speculative engine's plain steps cost against no speculation's.
``--profile N`` also runs cProfile over the timed generation and prints this project's N costliest functions by own and
inclusive time, in ms per engine step (cProfile slows Python code by itself: compare shares, and take the timers above
for milliseconds). ``--repeats N`` runs the methods N times, in reverse order every other time (A B, B A, ...: this
machine drifts by 10-20% over minutes, and a fixed order would charge the drift to one method), and ends with each
method's medians over the repeats.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

def run_child(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.never_draft:
        from vllm_treespec.settings import NEVER_DRAFT_ENV

        os.environ[NEVER_DRAFT_ENV] = "1"  # read when the engine's tree verifier is built
    import torch

    # one thread before the engine loads, as in vLLM's CPU worker here: the CPU linear's saved choice is keyed by the
    # thread count at load (with two, an fp32 model keeps oneDNN, which the worker's one-thread engines do not)
    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams

    from vllm_treespec.tools.bench import load_questions
    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2
    from vllm_treespec.patches.step_timers import StepTimers

    cpu_memory_defaults()
    llm = LLM(model=args.model or str(ensure_smollm2()), dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.batch_size,
              enforce_eager=args.enforce_eager, seed=0, speculative_config=json.loads(args.child))
    tokenizer = llm.get_tokenizer()
    questions = [q for qs in load_questions(args.prompts.split(","), None).values() for q in qs]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    forwards: list[tuple[int, float]] = []
    timers = StepTimers(on_forward=lambda tokens, seconds: forwards.append((tokens, seconds)))
    timers.install()
    totals, calls = timers.totals, timers.calls
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    started, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), args.batch_size):
        outputs = llm.generate(prompts[first:first + args.batch_size], params, use_tqdm=False)
        tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
    elapsed = time.perf_counter() - started
    if profiler is not None:
        profiler.disable()
    steps = max(calls["LLMEngine.step"], 1)
    print(f"  {tokens} tokens in {elapsed:.2f} s: {tokens / elapsed:.2f} tok/s, {steps} engine steps, "
          f"{elapsed / steps * 1e3:.2f} ms per step")
    by_tokens: dict[int, list[float]] = collections.defaultdict(list)
    for num_tokens, seconds in forwards:
        by_tokens[num_tokens].append(seconds)
    print("  model forward, median ms by tokens in the step: " + ", ".join(
        f"{t}: {statistics.median(v) * 1e3:.1f} (x{len(v)})" for t, v in sorted(by_tokens.items())))
    common = max(by_tokens, key=lambda t: len(by_tokens[t]))
    print("  SUMMARY " + json.dumps({"tok_per_s": tokens / elapsed, "ms_per_step": elapsed / steps * 1e3,
                                     "common_tokens": common,
                                     "forward_ms": statistics.median(by_tokens[common]) * 1e3}))
    for key in sorted(totals, key=lambda k: -totals[k]):
        print(f"  {key:42s} {totals[key] / steps * 1e3:8.3f} ms per step  ({calls[key]} calls)")
    if profiler is not None:
        print_own_profile(profiler, steps, args.profile)


def print_own_profile(profiler, steps: int, count: int) -> None:
    """cProfile's costliest functions of this project (own time, and inclusive), in ms per engine step. cProfile
    slows Python-heavy code by itself, so read the shares, not the absolute milliseconds."""
    import pstats

    stats = pstats.Stats(profiler).stats
    own = [(key, entry) for key, entry in stats.items()
           if "vllm_treespec" in key[0] or "/proposers/" in key[0] or "/retrieval/" in key[0]]
    for title, column in (("own time", 2), ("inclusive", 3)):
        print(f"  profile, this project's functions by {title} (ms per engine step, calls):")
        for (path, line, name), entry in sorted(own, key=lambda item: -item[1][column])[:count]:
            short = path.split("vllm_treespec/", 1)[-1] if "vllm_treespec/" in path else path.rsplit("/", 2)[-1]
            print(f"    {entry[column] / steps * 1e3:8.3f}  {entry[1]:7d}  {short}:{line}({name})")


def served_split(results: dict, min_ms: float = 0.005) -> list[str]:
    """The lines ``--served`` prints from a ``bench serve --step-timers`` results.json: per level, each timed
    function's milliseconds per engine step for every method (the median over its rounds) and each method's
    difference from no speculation's (a function's time off a CPU as its own row, ``FUNCTION off-CPU``, where it was
    counted, with its involuntary context switches per step above the table); functions under ``min_ms`` for every
    method are left out."""
    lines = []
    methods = [m for m in results["methods"] if m.get("status") == "ok"]
    levels = sorted({level for m in methods for level in m["levels"]}, key=int)
    for level in levels:
        medians, steps, faults, switches = {}, {}, {}, {}
        for m in methods:
            rounds = [r for r in (m["levels"].get(level) or {}).get("rounds_step_timers") or [] if r]
            if rounds:
                keys = {key for r in rounds for key in r["ms_per_step"]}
                medians[m["label"]] = {key: statistics.median(r["ms_per_step"].get(key, 0.0) for r in rounds)
                                       for key in keys}
                steps[m["label"]] = [r["steps"] for r in rounds]
                faults[m["label"]] = [r.get("minor_faults_per_step") for r in rounds]
                switches[m["label"]] = {key: statistics.median(r.get("switches_per_step", {}).get(key, 0.0)
                                                               for r in rounds)
                                        for key in {key for r in rounds for key in r.get("switches_per_step", {})}}
        if not medians:
            continue
        labels = list(medians)
        base = medians.get("none")
        lines.append(f"== {level} requests: ms per engine step, median over rounds (steps a round: "
                     + "; ".join(f"{label} {' / '.join(map(str, steps[label]))}" for label in labels) + ")")
        if any(f is not None for per_round in faults.values() for f in per_round):
            lines.append("  minor page faults per step (rounds): " + "; ".join(
                f"{label} {' / '.join('-' if f is None else f'{f:.0f}' for f in faults[label])}" for label in labels))
        for key in sorted({key for table in switches.values() for key in table}):
            lines.append(f"  involuntary switches per step in {key} (median over rounds): " + "; ".join(
                f"{label} {switches[label].get(key, 0.0):.3f}" for label in labels))
        header = "".join(f"{label:>12s}" for label in labels)
        others = [label for label in labels if label != "none"] if base is not None else []
        lines.append(f"  {'function':44s}{header}" + "".join(f"{label + ' - none':>16s}" for label in others))
        keys = sorted({key for table in medians.values() for key in table},
                      key=lambda key: -max(table.get(key, 0.0) for table in medians.values()))
        for key in keys:
            values = [medians[label].get(key, 0.0) for label in labels]
            if max(values) < min_ms:
                continue
            lines.append(f"  {key:44s}" + "".join(f"{v:12.3f}" for v in values)
                         + "".join(f"{medians[label].get(key, 0.0) - base.get(key, 0.0):+16.3f}" for label in others))
    return lines


def served_durations(out_dir: Path, results: dict, key: str) -> list[str]:
    """The lines ``--served OUT --durations KEY`` adds: per level, method and round, how ``KEY``'s calls spread over
    call times (each bucket named by its upper end; calls under it and at least half of it), from the servers' timer
    files in ``out_dir``: whether a function that reads dear in a round is dear at every call or at a few."""
    from vllm_treespec.cost import trace
    from vllm_treespec.patches import step_timers
    from vllm_treespec.tools.bench_serve import timers_file

    lines = []
    methods = [m for m in results["methods"] if m.get("status") == "ok"]
    for level in sorted({level for m in methods for level in m["levels"]}, key=int):
        lines.append(f"== {level} requests: {key}, calls by time (rounds)")
        for m in methods:
            stats = m["levels"].get(level) or {}
            for number, window in zip(m.get("round_numbers", []), stats.get("rounds_window") or []):
                files = trace.files(timers_file(out_dir, m["label"], number))
                counts = step_timers.window_durations(files, key, *window) if window else {}
                spread = ", ".join(f"<{2 ** b / 1000:g} ms: {n}" for b, n in counts.items()) or "no calls"
                lines.append(f"  {m['label']} r{number}: {spread}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="none;graft",
                        help="as vllm-treespec bench takes them: [LABEL=]METHOD[:JSON];... (no speculation runs too)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default="sharegpt[2200:2202]",
                        help="prompt sets as vllm-treespec bench takes them (default: ShareGPT 2200-2201, outside the shipped head's training prompts)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-model-len", type=int, default=4096, help="the engine's (bench serve's default)")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts per generate call (the engine's max_num_seqs)")
    parser.add_argument("--plain", default="",
                        help="comma-separated labels of methods whose tree verifier never drafts (plain steps only)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the methods this many times, in reverse order every other time; medians at the end")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip torch.compile, as vllm-treespec bench's option (default: vLLM's default, compiled; "
                        "an engine then starts in ~1.5 min instead of ~30 s here)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also run cProfile over the timed generation and print this project's N costliest "
                        "functions (own and inclusive time; cProfile slows Python code, so read shares)")
    parser.add_argument("--served", default=None, metavar="OUT",
                        help="instead of running engines, print the per-function split of a `vllm-treespec bench "
                        "serve --step-timers --out OUT` run, per level, each method beside no speculation")
    parser.add_argument("--durations", default=None, metavar="FUNCTION",
                        help="with --served: also how that function's calls (e.g. Sampler.forward) spread over call "
                        "times, per level, method and round")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--never-draft", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if args.child is not None:
        run_child(args)
        return 0
    if args.served is not None:
        results = json.loads((Path(args.served) / "results.json").read_text())
        lines = served_split(results)
        if lines and args.durations:
            lines += served_durations(Path(args.served), results, args.durations)
        print("\n".join(lines) if lines else f"step_split: no step timers in {args.served}/results.json "
              "(run bench serve with --step-timers)")
        return 0
    from vllm_treespec.tools.bench import BenchError, load_questions, never_drafting_labels, parse_methods, round_order

    try:
        specs = parse_methods(args.methods)
        plain = never_drafting_labels(args.plain, specs)
        load_questions(args.prompts.split(","), None)  # here, not after each child's engine has started
    except BenchError as e:
        raise SystemExit(f"step_split: {e}") from None
    summaries: dict[str, list[dict]] = collections.defaultdict(list)
    for repeat in range(args.repeats):
        for spec in round_order(specs, repeat):
            never = spec.label in plain
            print(f"== {spec.label} ({args.dtype}, {'eager' if args.enforce_eager else 'compiled'}"
                  f"{', never drafts' if never else ''}"
                  f"{f', repeat {repeat + 1}' if args.repeats > 1 else ''})", flush=True)
            command = [sys.executable, __file__, "--child", json.dumps(spec.speculative_config()),
                       "--dtype", args.dtype, "--prompts", args.prompts, "--max-tokens", str(args.max_tokens),
                       "--max-model-len", str(args.max_model_len),
                       "--batch-size", str(args.batch_size), "--profile", str(args.profile)] + (
                           ["--enforce-eager"] if args.enforce_eager else []) + (
                           ["--model", args.model] if args.model else []) + (["--never-draft"] if never else [])
            result = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in result.stdout.splitlines() if line.startswith("  ")]
            for line in lines:
                if line.startswith("  SUMMARY "):
                    summaries[spec.label].append(json.loads(line[len("  SUMMARY "):]))
            print("\n".join(line for line in lines if not line.startswith("  SUMMARY ")) if lines
                  else result.stderr[-3000:], flush=True)
    if args.repeats > 1:
        print(f"== medians over {args.repeats} repeats")
        for label, runs in summaries.items():
            forwards = [r["forward_ms"] for r in runs]
            print(f"  {label:12s} {statistics.median(r['tok_per_s'] for r in runs):7.2f} tok/s, "
                  f"{statistics.median(r['ms_per_step'] for r in runs):7.2f} ms per step, forward at "
                  f"{runs[0]['common_tokens']} tokens {statistics.median(forwards):6.1f} ms "
                  f"(runs: {' / '.join(f'{ms:.1f}' for ms in forwards)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
