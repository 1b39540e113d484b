"""Where a speculative method's worker time goes, against no speculation: py-spy of vLLM's worker process.

    python scripts/profile_worker.py --methods 'none;graft' --dtype bfloat16
    python scripts/profile_worker.py --methods 'none;suffix_tree:{"num_speculative_tokens":32}' --seconds 60
    python scripts/profile_worker.py --methods 'none;graft' --dtype float32 --batch 8

Each method runs in its own child process (a fresh engine, greedy, chat-templated prompts ``--batch`` at a time);
once it has warmed up, ``py-spy record`` samples its worker for ``--seconds``. Printed per method: tok/s of the whole
generation (sampling slows it a little, alike for all), then the functions whose share of the worker's busy loop
differs most from the first method's (inclusive time; a share times the seconds per step is milliseconds per step).
Raw stacks are kept in ``--out`` (py-spy's collapsed format, for flame graphs). Never run it beside another torch job.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
READY = "PROFILE_WORKER_PID"
BUSY_LOOP = "worker_busy_loop"


def run_child(args: argparse.Namespace) -> None:
    """Generate with one method, --batch prompts at a time; print the worker's pid once warm, then the throughput."""
    import psutil
    from vllm import LLM, SamplingParams

    from vllm_treespec.tools.bench import load_questions
    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2

    cpu_memory_defaults()
    model = args.model or str(ensure_smollm2())
    llm = LLM(model=model, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.batch, enforce_eager=True,
              seed=0, speculative_config=json.loads(args.child))
    tokenizer = llm.get_tokenizer()
    questions = [q for qs in load_questions(args.prompts.split(","), args.limit).values() for q in qs]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    workers = [p for p in psutil.Process().children(recursive=True) if "Worker" in " ".join(p.cmdline())]
    print(READY, workers[0].pid if workers else os.getpid(), flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    started, tokens, first = time.perf_counter(), 0, 0
    # 4 x --batch prompts per call with --batch running at once, so that requests join as others finish (prefills
    # among decode steps, as in serving); round and round the list until py-spy is done
    while first < len(prompts) or time.perf_counter() - started < args.seconds + 5:
        group = [prompts[(first + i) % len(prompts)] for i in range(4 * args.batch)]
        first += len(group)
        tokens += sum(len(out.outputs[0].token_ids) for out in llm.generate(group, params, use_tqdm=False))
    elapsed = time.perf_counter() - started
    print("PROFILE_WORKER_RESULT", json.dumps({"tokens": tokens, "seconds": elapsed}), flush=True)


def profile(config: dict | None, args: argparse.Namespace, out: Path, label: str) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(config), "--dtype", args.dtype, "--prompts", args.prompts,
           "--limit", str(args.limit), "--max-tokens", str(args.max_tokens), "--batch", str(args.batch),
           "--seconds", str(args.seconds)] + (["--model", args.model] if args.model else [])
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    raw = out / f"{label}.raw"
    result: dict = {}
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(READY):
            pid = line.split()[1]
            py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
            subprocess.run([py_spy, "record", "-p", pid, "-d", str(args.seconds), "-r", str(args.rate),
                            "--format", "raw", "-o", str(raw)], check=True, capture_output=True)
        elif line.startswith("PROFILE_WORKER_RESULT"):
            result = json.loads(line.split(" ", 1)[1])
    if child.wait() != 0 or not raw.exists():
        raise SystemExit(f"{label}: the child failed (exit {child.returncode}); run it alone: {' '.join(cmd)}")
    return result


def shares(raw: Path) -> tuple[collections.Counter, int]:
    """Inclusive samples per function (file:name, no line numbers) among the worker's busy-loop samples."""
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if BUSY_LOOP not in stack:
            continue
        total += int(count)
        seen = set()
        for frame in stack.split(";"):
            name = re.sub(r":\d+\)?$", "", frame)
            name = re.sub(rf" \(.*?(site-packages/|{re.escape(str(ROOT))}/)", " (", name)  # package-relative paths
            if name not in seen:
                seen.add(name)
                inclusive[name] += int(count)
    return inclusive, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none;graft", help="';'-separated, as vllm-treespec bench's --methods")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", default="mt_bench", help="prompt sets, as vllm-treespec bench's --prompts")
    parser.add_argument("--limit", type=int, default=2, help="questions per category")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--batch", type=int, default=1, help="requests running at once (max_num_seqs)")
    parser.add_argument("--seconds", type=int, default=45, help="py-spy sampling time (generation must outlast it)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--model")
    parser.add_argument("--out", default="bench_out/profile_worker")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # a method's speculative_config as JSON (null: none)
    args = parser.parse_args()
    if args.child:
        return run_child(args)
    from vllm_treespec.tools.bench import parse_methods

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = {}
    for spec in parse_methods(args.methods):
        result = profile(spec.speculative_config(), args, out, spec.label)
        profiles[spec.label] = shares(out / f"{spec.label}.raw")
        print(f"{spec.label}: {result['tokens']} tokens in {result['seconds']:.1f} s, "
              f"{result['tokens'] / result['seconds']:.2f} tok/s", flush=True)
    base_label, *others = profiles
    base, base_total = profiles[base_label]
    for label in others:
        mine, total = profiles[label]
        names = ({k for k, v in mine.items() if v > 0.002 * total}
                 | {k for k, v in base.items() if v > 0.002 * base_total})
        rows = sorted(names, key=lambda k: -abs(mine[k] / total - base[k] / base_total))[:args.top]
        print(f"\n{label} vs {base_label}: share of the worker's busy loop (inclusive)")
        print(f"{label:>10} {base_label:>10}   diff  function")
        for k in rows:
            a, b = 100 * mine[k] / total, 100 * base[k] / base_total
            print(f"{a:9.2f}% {b:9.2f}% {a - b:+6.2f}  {k[:110]}")


if __name__ == "__main__":
    main()
