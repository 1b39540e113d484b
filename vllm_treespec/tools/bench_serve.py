"""``vllm-treespec bench serve``: the OpenAI server under load, per speculative method.

For each method (same ``--methods`` syntax as ``vllm-treespec bench``; no speculation always included) it starts
``python -m vllm_treespec.tools.cli serve`` on 127.0.0.1, waits for ``/health``, warms it up, and drives it with streamed
chat completions from a bounded asyncio client at each concurrency level (default 1,4,8,16): ``--requests-per-level``
requests (at least the concurrency) with at most ``concurrency`` in flight. Reported per method and level: output
tokens/s, requests/s, TTFT and inter-token latency (gap between streamed chunks; a chunk can carry several tokens
when drafts are accepted) percentiles, and time per output token. The server is always stopped, its whole process
group, whatever happens. Output: a table, results.json and PNG plots (throughput, TTFT p50 and ITL p50 per level);
results.json and table.txt are written after every round, so a run stopped part way keeps its finished rounds.

This machine's speed drifts over minutes, so ``--repeats R`` runs R rounds, every method once per round, in
reverse order every other round (a fresh server each time, the same prompts), and reports per method and level the
round with the median output tok/s, every round's figure, the ratio to no speculation's median, and the median of
the per-round ratios (each round against no speculation's same round, run next to it: the drift between rounds
cancels, and the alternating order charges neither the drift within a round nor what a server leaves behind to one
method). Where the run has vLLM's own methods (``ngram``, ...), every other method is also paired, level by level
and round by round, with whichever of them did best at that level (``vs_builtin``). With ``--interleave`` a round starts every method's server at once and runs them level by level in turn
(the order reversed at every level): the servers still start fresh each round, but a method's level and no
speculation's same level run a minute or two apart instead of a whole sweep apart. Each of them then gets the KV
cache the run's busiest level needs (:mod:`vllm_treespec.tools.server_memory`; ``VLLM_CPU_KVCACHE_SPACE`` if set),
and a run whose servers would not fit in memory together is refused before any starts.

Each server's worker also writes the time of every plain decode forward
(:mod:`vllm_treespec.patches.forward_times`, ``VLLM_TREESPEC_FORWARD_TIMES_FILE``), and each level reports its
server's median plain forward at the level's usual request count and, with rounds, the paired ratio at equal engine
speed: each round's ratio times how much longer the method's plain forward took than no speculation's in that round
(servers of one configuration started minutes apart run at different speeds for their whole life; the raw paired
ratio stays the figure of record). The forwards record their requests' summed sequence lengths, and the two servers
are compared at one context (each server's line of ms in context, read at no speculation's median context, only
where that lies within the method's own plain forwards' contexts): a gate that prices rows by their context leaves
the long-context steps plain, and the servers' medians then compared different steps (graft's plain forwards at 8
requests read 3-11 ms slower than no speculation's while a graft engine that never drafts ran at its speed).
``equal_speed_by`` says which was used: ``context``, or ``median`` for forwards files without contexts; a level
whose servers' plain forwards ran at contexts too far apart has no figure at equal speed.

The load generator drives every level at real-time priority (:func:`~vllm_treespec.tools.serving.client_priority`):
on the CPUs vLLM reserves it shares a core with the engine core, which polls for its worker's reply, and at normal
priority it was starved for seconds at a time. Each level records every request's timings (``replies``), the CPU
seconds of each process and each core's busy time over the level (``cpu``), and the priority it ran at.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from vllm_treespec.cost import trace
from vllm_treespec.cost.trace import TRACE_ENV
from vllm_treespec.patches import forward_times, step_timers
from vllm_treespec.settings import NEVER_DRAFT_ENV
from vllm_treespec.tools.bench import BenchError, DEFAULT_METHODS, METHODS_HELP, WARMUP_PROMPT, MethodSpec, check_method
from vllm_treespec.tools.bench import (ALLOW_TRAINING_PROMPTS_HELP, check_held_out, check_prompt_lengths,
                                       load_questions, load_tokenizer)
from vllm_treespec.tools.bench import never_drafting_labels, parse_methods, round_order
from vllm_treespec.tools.bench import unavailable_reason
from vllm_treespec.tools.serving import (CpuUse, Reply, RssSampler, ServerProcess, ServerStartError, client_session,
                                         percentiles)
from vllm_treespec.tools.serving import client_priority, off_the_workers_cpus
from vllm_treespec.tools.serving import request
from vllm_treespec.tools.server_memory import (DEFAULT_KV_GIB, ServerMemoryError, available_memory_bytes,
                                               check_servers_fit, kv_bytes_per_token, kv_cache_gib)

SERVED_NAME = "bench"
#: vLLM's CPU KV cache size, whole GiB
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: plain forwards a level's window must hold for its server's speed to count: a level runs hundreds, and their line
#: against context (window_fit) needs more of them than a batch-1 engine's median (bench.MIN_PLAIN_FORWARDS)
MIN_WINDOW_FORWARDS = 20
#: --interleave's wait before a turn that follows another server's: a server's processes keep one core busy for
#: 1.0 s after its last response (measured, 2026-12-04), which delayed the next server's prefill by 0.6-1.0 s
TURN_PAUSE_S = 1.5


def interleaved_kv_cache_gib(args: argparse.Namespace, longest_prompt: int, labels: list[str]) -> int:
    """The KV cache (whole GiB) each of the servers ``--interleave`` keeps up together gets: VLLM_CPU_KVCACHE_SPACE if
    set, else what the busiest level needs (:func:`kv_cache_gib`); refused, with the numbers, when they would not
    all fit in the memory available now."""
    user = os.environ.get(KV_CACHE_ENV)
    if user:
        try:
            kv_gib = int(user)
        except ValueError:
            raise ServerMemoryError(f"{KV_CACHE_ENV}={user!r}: must be whole GiB (vLLM reads an integer)") from None
    else:
        per_token = kv_bytes_per_token(args.model, args.dtype)
        kv_gib = DEFAULT_KV_GIB if per_token is None else kv_cache_gib(
            per_token, max(args.concurrency), longest_prompt, args.max_tokens, args.max_model_len)
    check_servers_fit(labels, kv_gib, available_memory_bytes(), kv_from_user=bool(user))
    return kv_gib


def server_args(args: argparse.Namespace) -> list[str]:
    return ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--max-num-seqs",
            str(max(args.concurrency)), "--served-model-name", SERVED_NAME, "--seed", str(args.seed)] + (
                ["--enforce-eager"] if args.enforce_eager else [])


async def run_level(url: str, prompts: list[str], concurrency: int, max_tokens: int,
                    temperature: float) -> tuple[list[Reply], float]:
    """Send every prompt once, at most ``concurrency`` in flight; returns the replies and the wall time."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session, prompt: str) -> Reply:
        async with gate:
            payload = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                       "stream_options": {"include_usage": True}}
            return await request(session, f"{url}/v1/chat/completions", payload)

    async with client_session(concurrency) as session:
        started = time.perf_counter()
        replies = await asyncio.gather(*(one(session, p) for p in prompts))
        return list(replies), time.perf_counter() - started


def level_stats(replies: list[Reply], wall_s: float) -> dict[str, Any]:
    ok = [r for r in replies if r.ok and r.finish_reason]
    tokens = sum(r.completion_tokens for r in ok)
    tpot = [(r.elapsed_s - r.first_token_s) / (r.completion_tokens - 1)
            for r in ok if r.first_token_s is not None and r.completion_tokens > 1]
    return {
        "requests": len(replies), "succeeded": len(ok),
        "errors": [f"{r.status}: {(r.error or str(r.body))[:200]}" for r in replies if r not in ok][:5],
        "wall_s": wall_s, "output_tokens": tokens,
        "output_tok_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_s": percentiles([r.first_token_s for r in ok if r.first_token_s is not None]),
        "itl_s": percentiles([g for r in ok for g in r.chunk_gaps_s]),
        "tpot_s": percentiles(tpot),
        "tokens_per_chunk": tokens / max(sum(r.chunks for r in ok), 1),
        "replies": reply_records(replies),
    }


def reply_records(replies: list[Reply]) -> list[dict[str, Any]]:
    """Each request's own timings, in the order sent (seconds; ``sent_s`` from the level's first request): the
    percentiles alone cannot tell one slow prefill from a server that held every first token back."""
    first = min((r.started for r in replies), default=0.0)
    return [{"sent_s": round(r.started - first, 4), "ok": r.ok and bool(r.finish_reason),
             "ttft_s": None if r.first_token_s is None else round(r.first_token_s, 4),
             "elapsed_s": round(r.elapsed_s, 4), "output_tokens": r.completion_tokens, "chunks": r.chunks,
             "prompt_tokens": (r.usage or {}).get("prompt_tokens")} for r in replies]


_warned_priority: list[str] = []  # the load generator's priority was said once this run


class MethodRound:
    """One method's server for one round: :meth:`start`, then :meth:`run_level` per concurrency level, then
    :meth:`finish`, which stops it and returns its results.json entry (with the level windows' budget trace and plain
    forwards). A server that fails to start is recorded as failed and its levels are skipped."""

    def __init__(self, spec: MethodSpec, args: argparse.Namespace, out_dir: Path, round_index: int = 0) -> None:
        self.spec = spec
        self.args = args
        self.entry: dict[str, Any] = {"label": spec.label, "method": spec.method, "round": round_index + 1,
                                      "speculative_config": spec.speculative_config(), "levels": {}}
        # one log per round: a server that crashes in one round keeps its traceback when the next round starts
        self.log_path = out_dir / f"server-{spec.label}-r{round_index + 1}.log"
        self.trace_path = out_dir / f"budget-{spec.label}-r{round_index + 1}.jsonl"
        trace.clear(self.trace_path)
        self.forwards_path = out_dir / f"forwards-{spec.label}-r{round_index + 1}.txt"
        trace.clear(self.forwards_path)  # workers append to <path>.<pid>, as the budget trace's
        env = {TRACE_ENV: str(self.trace_path), forward_times.FORWARD_TIMES_FILE_ENV: str(self.forwards_path)}
        self.timers_path = timers_file(out_dir, spec.label, round_index + 1)
        trace.clear(self.timers_path)
        if args.step_timers:
            env[step_timers.STEP_TIMERS_FILE_ENV] = str(self.timers_path)
        if spec.label in args.plain:
            env[NEVER_DRAFT_ENV] = "1"
        if args.kv_cache_gib is not None:
            env[KV_CACHE_ENV] = str(args.kv_cache_gib)
        self.server = ServerProcess(args.model, spec.speculative_config(), server_args(args), log_path=self.log_path,
                                    env=env)
        self.entry["port"] = self.server.port
        self.rss: RssSampler | None = None
        self.up = False

    def start(self) -> bool:
        """Start the server (unpinned: vLLM places its worker itself); False, with the entry failed, if it did not."""
        started = time.perf_counter()
        try:
            self.server.start()
        except ServerStartError as e:
            self.entry.update(status="failed", reason=str(e).splitlines()[0], log=str(self.log_path))
            self.server.stop()
            return False
        self.entry["server_pid"] = self.server.process.pid
        self.entry["startup_s"] = time.perf_counter() - started
        self.up = True
        return True

    def placement(self) -> contextlib.AbstractContextManager[set[int] | None]:
        """The API server, the engine core, this load generator and the worker's helper threads (gloo, ZeroMQ) on
        the CPUs vLLM reserved for them, off the worker's: what a deployment on a dedicated machine does (taskset),
        and steadier figures."""
        if self.args.cpu_affinity != "reserved":
            return contextlib.nullcontext()
        return off_the_workers_cpus(self.server.process.pid)

    def warm_up(self, pinned: set[int] | None) -> None:
        if pinned is not None:
            self.entry["pinned_cpus"] = sorted(pinned)
        asyncio.run(run_level(self.server.url, [WARMUP_PROMPT], 1, 16, 0.0))  # not reported
        self.rss = RssSampler(self.server).__enter__()

    def run_level(self, concurrency: int, batch: list[str]) -> None:
        opened = time.time()
        cpu = CpuUse(self.server.process.pid).start()
        with client_priority() as priority:
            replies, wall = asyncio.run(run_level(self.server.url, batch, concurrency, self.args.max_tokens,
                                                  self.args.temperature))
        if priority != "fifo" and not _warned_priority:
            _warned_priority.append(priority)
            print("bench serve: the load generator runs at normal priority (no CAP_SYS_NICE): a server's engine core "
                  "polling beside it can starve it, and a level's figures with it; run as root for steady figures",
                  file=sys.stderr)
        # the level's wall-clock window: its part of the traces, now and for a later analysis of results.json
        self.entry["levels"][str(concurrency)] = {**level_stats(replies, wall), "window": [opened, time.time()],
                                                  "cpu": cpu.stop(), "client_priority": priority}

    def finish(self) -> dict[str, Any]:
        if self.up:
            if self.rss is not None:
                self.rss.__exit__(None, None, None)
                self.entry["rss"] = self.rss.summary()
            if self.server.alive():
                self.entry["status"] = "ok"
            else:
                self.entry.update(status="crashed", reason=crash_reason(self.server.log_tail(20000)),
                                  log=str(self.log_path))
            self.server.stop()
            self.up = False
        windows = {level: tuple(stats["window"]) for level, stats in self.entry["levels"].items()}
        add_budget_trace(self.entry, trace.files(self.trace_path), windows)
        add_forward_times(self.entry, forward_times.read_trace(trace.files(self.forwards_path)), windows)
        add_step_timers(self.entry, trace.files(self.timers_path), windows)
        return self.entry


def timers_file(out_dir: Path, label: str, round_number: int) -> Path:
    """The base name of a method's round's step-timer files (``--step-timers``; each process appends to
    ``<base>.<pid>``, :func:`vllm_treespec.cost.trace.files` lists them)."""
    return out_dir / f"timers-{label}-r{round_number}.jsonl"


def crash_reason(log: str) -> str:
    """The last exception a server's log names (``Error: ...`` / ``Exception: ...`` line of its last traceback),
    else its last line: what results.json and the table say of a server that died during a round."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        text = line.split("] ", 1)[-1]  # vLLM's log prefix: "(Process pid=N) LEVEL date [file.py:line] "
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*:", text) and "EngineDeadError" not in text:
            return text[:300]
    return lines[-1][:300] if lines else "the server exited (empty log)"


def level_requests(concurrency: int, args: argparse.Namespace) -> int:
    """Requests sent at a level: ``--requests-per-level``, and at least ``--waves`` times the concurrency."""
    return max(args.requests_per_level, args.waves * concurrency, concurrency)


def level_batches(prompts: list[str], args: argparse.Namespace) -> list[tuple[int, list[str]]]:
    """(concurrency, its prompts) per level: fresh prompts at every level, so that a method that remembers finished
    outputs (suffix_tree's global store) is not scored on answers it has already produced (main() checked there are
    enough: no prompt is sent twice)."""
    batches, sent = [], 0
    for concurrency in args.concurrency:
        n = level_requests(concurrency, args)
        batches.append((concurrency, prompts[sent: sent + n]))
        sent += n
    return batches


def run_method(spec: MethodSpec, prompts: list[str], args: argparse.Namespace, out_dir: Path,
               round_index: int = 0) -> dict[str, Any]:
    """One method's round on its own: its server up, every level, its server down."""
    from tqdm import tqdm

    run = MethodRound(spec, args, out_dir, round_index)
    try:
        if run.start():
            with run.placement() as pinned:
                run.warm_up(pinned)
                for concurrency, batch in tqdm(level_batches(prompts, args), desc=f"{spec.label:>12}",
                                               unit="level", file=sys.stderr):
                    run.run_level(concurrency, batch)
    finally:
        entry = run.finish()
    return entry


def run_interleaved(specs: list[MethodSpec], prompts: list[str], args: argparse.Namespace, out_dir: Path,
                    round_index: int = 0) -> dict[str, dict[str, Any]]:
    """One round of every method with their servers up together, taking turns level by level (the order reversed at
    every level, and ``specs`` already in the round's order): a method's level runs a minute or two from no
    speculation's same level, not a whole sweep, so the machine's drift over minutes mostly cancels in the paired
    ratios. Only one server works at a time (the others wait idle); it needs the memory of every server at once."""
    from tqdm import tqdm

    runs = [MethodRound(spec, args, out_dir, round_index) for spec in specs]
    try:
        live = [run for run in runs if run.start()]
        previous: MethodRound | None = None  # the server that ran the last level (or warmed up last)

        def take_turn(run: MethodRound) -> None:
            """Before ``run`` works after another server: let that one's worker and engine core go idle first (a
            level after another's started late; a warm-up beside one ran 2x slow, and its engine's step-cost
            corrections learnt from those steps)."""
            nonlocal previous
            if previous is not None and previous is not run and args.turn_pause > 0:
                time.sleep(args.turn_pause)
            previous = run

        with contextlib.ExitStack() as placements:
            for run in live:
                take_turn(run)
                run.warm_up(placements.enter_context(run.placement()))
            for level, (concurrency, batch) in enumerate(tqdm(level_batches(prompts, args), desc="levels",
                                                              unit="level", file=sys.stderr)):
                for run in round_order(live, level):
                    if run.server.alive():
                        take_turn(run)
                        run.run_level(concurrency, batch)
                    else:  # what is left of a crashed server (a worker spinning on) must not slow the others
                        run.server.stop()
    finally:
        entries = {run.spec.label: run.finish() for run in runs}
    return entries


def add_forward_times(entry: dict[str, Any], records: list[tuple[float, int, float, int | None]],
                      windows: dict[str, tuple[float, float]]) -> None:
    """Each level's ``plain_forward``: the server's median plain forward at the level's usual request count
    (``{"ms", "reqs", "count"}``), and where the forwards recorded their context, the line they follow in it
    (``"fit"``: ms at no context and per 1000 tokens of context,
    :func:`~vllm_treespec.patches.forward_times.window_fit`), their median context (``"context"``) and its 10th to
    90th percentiles (``"context_range"``); the median host time between two consecutive plain forwards
    (``"between_ms"``, over ``"between_count"`` pairs, :func:`~vllm_treespec.patches.forward_times.window_gap`);
    None where it ran fewer than :data:`MIN_WINDOW_FORWARDS` of them."""
    for level, (start, end) in windows.items():
        if level in entry["levels"]:
            reading = forward_times.window_reading(records, start, end, MIN_WINDOW_FORWARDS)
            plain = None if reading is None else {"ms": reading[0], "reqs": reading[1], "count": reading[2]}
            fit = None if reading is None else forward_times.window_fit(records, start, end, reading[1],
                                                                        MIN_WINDOW_FORWARDS)
            if fit is not None:
                plain.update(fit=[fit[0], fit[1]], context=fit[3], context_range=[fit[2], fit[4]])
            gap = None if reading is None else forward_times.window_gap(records, start, end, reading[1],
                                                                         MIN_WINDOW_FORWARDS)
            if gap is not None:
                plain.update(between_ms=gap[0], between_count=gap[1])
            entry["levels"][level]["plain_forward"] = plain


def add_step_timers(entry: dict[str, Any], paths: list[Path], windows: dict[str, tuple[float, float]]) -> None:
    """Each level's ``step_timers`` (``--step-timers``): the server's engine steps in the level's window
    (``"steps"``), each timed function's milliseconds per step (``"ms_per_step"``,
    :mod:`vllm_treespec.patches.step_timers`) and the processes' minor page faults per step
    (``"minor_faults_per_step"``: memory touched for the first time), engine core and worker together, and the
    involuntary context switches per step within each function that counts them (``"switches_per_step"``; its time
    off a CPU is in ``ms_per_step`` as ``"FUNCTION off-CPU"``); nothing without timer files."""
    if not paths:
        return
    for level, (start, end) in windows.items():
        if level in entry["levels"]:
            seconds, calls = step_timers.window_totals(paths, start, end)
            per_step = step_timers.per_step(seconds, calls)
            steps = calls.get(step_timers.STEP_KEY, 0)
            entry["levels"][level]["step_timers"] = (None if per_step is None else {
                "steps": steps, "ms_per_step": per_step,
                "minor_faults_per_step": calls.get(step_timers.FAULTS_KEY, 0) / steps,
                "switches_per_step": {key.removesuffix(step_timers.SWITCHES_SUFFIX): n / steps
                                      for key, n in calls.items() if key.endswith(step_timers.SWITCHES_SUFFIX)}})


def add_budget_trace(entry: dict[str, Any], paths: list[Path], windows: dict[str, tuple[float, float]]) -> None:
    """Each level's summary of the server's budget trace (:mod:`vllm_treespec.cost.trace`), when it wrote one."""
    if not paths:
        return
    entry["budget_trace"] = [str(p) for p in paths]
    lines = trace.read(paths)
    for level, (start, end) in windows.items():
        if level in entry["levels"]:
            entry["levels"][level]["budget"] = trace.summarize(lines, start, end)


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's entries from several rounds -> one entry: per level the stats of the round with the median
    output tok/s (the lower median for an even count), plus every round's tok/s under ``rounds_tok_per_s`` and the
    rounds' numbers under ``round_numbers``; the per-server fields (startup, RSS) are the first round's. A round whose
    server failed or crashed is left out and listed under ``failed_rounds`` (round, status, reason, log): the rounds
    that completed still count. A method that completed no round is reported failed with its first round's reason."""
    numbered = [(r.get("round", i + 1), r) for i, r in enumerate(rounds)]
    done = [(n, r) for n, r in numbered if r["status"] == "ok"]
    failed = [{"round": n, **{k: r[k] for k in ("status", "reason", "log") if k in r}}
              for n, r in numbered if r["status"] != "ok"]
    if not done:
        return {**rounds[0], "rounds": len(rounds), "failed_rounds": failed}
    first = done[0][1]
    merged = {**first, "levels": {}, "rounds": len(done), "round_numbers": [n for n, _ in done],
              "server_pids": [r["server_pid"] for _, r in done], "ports": [r["port"] for _, r in done]}
    if failed:
        merged["failed_rounds"] = failed
    for level in first["levels"]:
        per_round = [r["levels"][level] for _, r in done]  # a round that completed ran every level
        rates = [s["output_tok_per_s"] for s in per_round]
        median = statistics.median_low(rates)
        merged["levels"][level] = {**per_round[rates.index(median)], "rounds_tok_per_s": rates,
                                   "rounds_plain_forward_ms": [(s.get("plain_forward") or {}).get("ms")
                                                               for s in per_round],
                                   "rounds_plain_forward": [s.get("plain_forward") for s in per_round],
                                   "rounds_vs_own_plain": [own_plain_ratio(s) for s in per_round],
                                   "rounds_window": [s.get("window") for s in per_round],
                                   "rounds_step_timers": [s.get("step_timers") for s in per_round],
                                   "rounds_replies": [s.get("replies") for s in per_round],
                                   "rounds_cpu": [s.get("cpu") for s in per_round]}
    return merged


def paired_rounds(mine: dict[str, Any], theirs: dict[str, Any]) -> list[tuple[int, int]]:
    """(index in ``mine``'s per-round lists, index in ``theirs``') of each round both merged methods completed: a
    round is paired with the baseline's round of the same number, which ran next to it."""
    theirs_at = {number: j for j, number in enumerate(theirs["round_numbers"])}
    return [(i, theirs_at[number]) for i, number in enumerate(mine["round_numbers"]) if number in theirs_at]


def add_ratios(methods: list[dict[str, Any]], baseline: str = "none") -> None:
    """``vs_none`` per level: output tok/s over the baseline's at the same level (both medians with --repeats).
    With rounds, also ``rounds_vs_none`` (each round against the baseline's same round, which ran next to it: the
    machine's drift cancels) and their median ``vs_none_paired``."""
    base = next((m for m in methods if m["label"] == baseline and m["status"] == "ok"), None)
    for m in methods:
        if m["status"] != "ok" or base is None:
            continue
        pairs = paired_rounds(m, base)
        for level, s in m["levels"].items():
            b = base["levels"].get(level)
            if b is None:
                continue
            if b["output_tok_per_s"] > 0:
                s["vs_none"] = s["output_tok_per_s"] / b["output_tok_per_s"]
            mine, theirs = s["rounds_tok_per_s"], b["rounds_tok_per_s"]
            if len(pairs) > 1 and min(theirs[j] for _, j in pairs) > 0:
                s["rounds_vs_none"] = [mine[i] / theirs[j] for i, j in pairs]
                s["vs_none_paired"] = statistics.median(s["rounds_vs_none"])
                speeds = relative_speeds([s["rounds_plain_forward"][i] for i, _ in pairs],
                                         [b["rounds_plain_forward"][j] for _, j in pairs])
                if speeds is not None:
                    # each server's tok/s at the speed of the other: times its plain forward over the other's
                    s["rounds_vs_none_equal_speed"] = [ratio * x for ratio, x in
                                                       zip(s["rounds_vs_none"], speeds[0])]
                    s["vs_none_paired_equal_speed"] = statistics.median(s["rounds_vs_none_equal_speed"])
                    s["equal_speed_by"] = speeds[1]


def is_vllm_method(method: str) -> bool:
    """Whether ``method`` is one of vLLM's own speculative methods (``ngram``, ``suffix``, ...), not no speculation
    nor a tree method of this package or a proposer's dotted path."""
    from vllm_treespec.registry import is_dotted_path, registered_proposers

    return method != "none" and method not in registered_proposers() and not is_dotted_path(method)


def add_builtin_ratios(methods: list[dict[str, Any]]) -> None:
    """``vs_builtin`` per level of every other method, where the run has vLLM's own methods: against the one that
    did best at that level (the highest ``vs_none_paired``), round by round as ``vs_none_paired`` is (each round
    against that method's round of the same number, run next to it), ``{"label", "rounds", "paired"}``."""
    builtins = [m for m in methods if m["status"] == "ok" and is_vllm_method(m["method"])]
    for m in methods:
        if m["status"] != "ok" or m["method"] == "none" or m in builtins:
            continue
        for level, s in m["levels"].items():
            rivals = [b for b in builtins if "vs_none_paired" in b["levels"].get(level, {})]
            if not rivals:
                continue
            best = max(rivals, key=lambda b: b["levels"][level]["vs_none_paired"])
            theirs = best["levels"][level]["rounds_tok_per_s"]
            pairs = [(i, j) for i, j in paired_rounds(m, best) if theirs[j] > 0]
            if len(pairs) > 1:
                rounds = [s["rounds_tok_per_s"][i] / theirs[j] for i, j in pairs]
                s["vs_builtin"] = {"label": best["label"], "rounds": rounds, "paired": statistics.median(rounds)}


def relative_speeds(mine: list[dict[str, Any] | None], theirs: list[dict[str, Any] | None]
                    ) -> tuple[list[float], str] | None:
    """Per paired round, how much longer a plain forward of ``mine``'s server took than one of ``theirs`` (each a
    level's ``plain_forward``), and how they were compared. ``"context"`` where every round of both recorded the
    line its forwards follow in their context: each server's line read at the median context of ``theirs``' plain
    forwards (the same steps, whichever a gate left plain). None where a round has no reading, or where that context
    lies outside the 10th-90th percentiles of ``mine``'s (the line would be extrapolated: graft's plain forwards at 8
    requests once sat at 2,200 tokens of context against no speculation's 5,300, and the two lines read 3,000 tokens
    away from graft's said it ran 0.77x the time of no speculation's). ``"median"`` for forwards files without
    contexts: the servers' median plain forwards, which compare different steps when a gate drafts by context."""
    if any(m is None for m in mine + theirs):
        return None
    if all("fit" in m for m in mine + theirs):
        def at(plain: dict[str, Any], context: float) -> float:
            return plain["fit"][0] + plain["fit"][1] * context / 1000.0

        if any(not m["context_range"][0] <= t["context"] <= m["context_range"][1] for m, t in zip(mine, theirs)):
            return None
        return [at(m, t["context"]) / at(t, t["context"]) for m, t in zip(mine, theirs)], "context"
    if any("fit" in m for m in mine + theirs):
        return None  # some rounds with contexts, some without: no one way to compare them all
    return [m["ms"] / t["ms"] for m, t in zip(mine, theirs)], "median"


def own_plain_ratio(level: dict[str, Any]) -> float | None:
    """A level's decode steps against its server's own plain steps (the budget trace,
    :func:`~vllm_treespec.cost.trace.against_own_plain_steps`); None without a trace or plain steps."""
    own = (level.get("budget") or {}).get("own_plain")
    return None if own is None else own["ratio"]


def own_plain_cell(level: dict[str, Any]) -> str:
    """The median over rounds of :func:`own_plain_ratio`, e.g. ``1.04x``; ``-`` where no round has one."""
    ratios = [r for r in level.get("rounds_vs_own_plain") or [own_plain_ratio(level)] if r is not None]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def verify_share(budget: dict[str, Any] | None) -> str:
    """The share of the level's engine steps that verified drafts (from the budget trace), e.g. ``41%``."""
    share = trace.verifying_share(budget)
    return "-" if share is None else f"{100 * share:.0f}%"


def format_table(methods: list[dict[str, Any]]) -> str:
    header = ["method", "conc", "ok/sent", "out tok/s", "vs none", "paired", "paired, eq. speed", "vs vLLM's best",
              "req/s",
              "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "TPOT p50", "tok/chunk", "verify steps", "vs own plain",
              "rounds tok/s", "plain fwd", "between fwds"]
    table = [header]
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}ms"  # noqa: E731
    for m in methods:
        if m["status"] != "ok":
            table.append([m["label"], "", m["status"], m.get("reason", "")[:50]] + [""] * (len(header) - 4))
            continue
        for level, s in m["levels"].items():
            ratio = f"{s['vs_none']:.2f}x" if "vs_none" in s else "-"
            paired = f"{s['vs_none_paired']:.2f}x" if "vs_none_paired" in s else "-"
            equal = f"{s['vs_none_paired_equal_speed']:.2f}x" if "vs_none_paired_equal_speed" in s else "-"
            builtin = f"{s['vs_builtin']['paired']:.2f}x {s['vs_builtin']['label']}" if "vs_builtin" in s else "-"
            rounds = " / ".join(f"{v:.1f}" for v in s.get("rounds_tok_per_s", []))
            plains = s.get("rounds_plain_forward") or [s.get("plain_forward")]
            forwards = [(p or {}).get("ms") for p in plains]
            between = [(p or {}).get("between_ms") for p in plains]
            table.append([m["label"], level, f"{s['succeeded']}/{s['requests']}", f"{s['output_tok_per_s']:.1f}",
                          ratio, paired, equal, builtin, f"{s['requests_per_s']:.2f}", ms(s["ttft_s"]["p50"]),
                          ms(s["ttft_s"]["p99"]), ms(s["itl_s"]["p50"]), ms(s["itl_s"]["p99"]), ms(s["tpot_s"]["p50"]),
                          f"{s['tokens_per_chunk']:.2f}", verify_share(s.get("budget")), own_plain_cell(s),
                          rounds or "-",
                          " / ".join("-" if v is None else f"{v:.1f}" for v in forwards) + " ms",
                          " / ".join("-" if v is None else f"{v:.1f}" for v in between) + " ms"])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in table]
    lines.insert(1, "-" * len(lines[0]))
    # rounds left out of an ok method's figures (a crash mid-round): the reader must know they are fewer
    lines += [f"{m['label']}: round {f['round']} {f['status']}: {f.get('reason', '')} ({f.get('log', 'no log')}); "
              f"its figures are the other rounds'" for m in methods if m["status"] == "ok"
              for f in m.get("failed_rounds", [])]
    return "\n".join(lines)


def plot(methods: list[dict[str, Any]], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("output tok/s", lambda s: s["output_tok_per_s"]),
              ("TTFT p50 (s)", lambda s: s["ttft_s"]["p50"]),
              ("inter-token latency p50 (s)", lambda s: s["itl_s"]["p50"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, value) in zip(axes, panels):
        for m in methods:
            if m["status"] != "ok":
                continue
            levels = [int(c) for c in m["levels"]]
            ax.plot(levels, [value(s) or 0.0 for s in m["levels"].values()], marker="o", label=m["label"])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / "serve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-treespec bench serve", description=__doc__, epilog=METHODS_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", default="mt_bench,humaneval", help="prompt sets or question.jsonl paths")
    parser.add_argument("--allow-training-prompts", action="store_true", help=ALLOW_TRAINING_PROMPTS_HELP)
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--concurrency", default="1,4,8,16", help="comma-separated concurrency levels")
    parser.add_argument("--requests-per-level", type=int, default=16, help="requests sent at each level")
    parser.add_argument("--waves", type=int, default=1, metavar="N",
                        help="send at least N times a level's concurrency (default 1). With as many requests as "
                        "the concurrency a level is one wave: its time is the prefill and the slowest request, which "
                        "a server cannot tell from steady load; N >= 2 keeps the slots refilled as requests finish")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile in the server")
    parser.add_argument("--repeats", type=int, default=1, help="rounds, every method once per round (fresh "
                        "servers), in reverse order every other round; per level the median round is reported")
    parser.add_argument("--interleave", action="store_true",
                        help="each round starts every method's server at once and runs them level by level in turn "
                        "(the order reversed at every level), so a method's level is paired with no speculation's "
                        "same level a minute or two apart instead of a sweep apart; only one server works at a time, "
                        "but all must fit in memory together: each gets the KV cache the busiest level needs "
                        "(VLLM_CPU_KVCACHE_SPACE if set), and servers that would not fit are refused before any starts")
    parser.add_argument("--turn-pause", type=float, default=TURN_PAUSE_S, metavar="SECONDS",
                        help="with --interleave, wait this long before a server's turn or warm-up when another "
                        "server ran the turn before (default %(default)s; 0: no pause): after its last response a "
                        "server keeps one core fully busy for 1.0 s (vLLM's message queues poll with sched_yield), "
                        "the cores the next server's prefill needs; without the pause a turn after another server's "
                        "reached its first decode step 0.6-1.0 s late (bf16, 16 requests), and a warm-up after "
                        "another's ran 2x slow")
    parser.add_argument("--plain", default="", help="comma-separated labels of methods whose servers never draft "
                        "(VLLM_TREESPEC_NEVER_DRAFT=1: every step as one the gate refuses): what a method's plain "
                        "steps cost against no speculation's; e.g. --methods 'graft;graft_plain=graft' --plain graft_plain")
    parser.add_argument("--step-timers", action="store_true",
                        help="time the engine core's and the worker's functions per step in every server "
                        "(vllm_treespec.patches.step_timers; about a microsecond per timed call): results.json's "
                        "levels get step_timers, printed side by side by scripts/step_split.py --served OUT")
    parser.add_argument("--cpu-affinity", choices=("reserved", "os"), default="reserved",
                        help="CPU server: 'reserved' (default) pins the API server, the engine core and this load "
                        "generator to the CPUs vLLM's worker left free (those vLLM reserves for its engine core), off "
                        "the worker's; 'os' leaves placement to the OS (they then take turns with the worker's thread)")
    parser.add_argument("--out", default="bench_out/serve", help="folder for results.json, serve.png, server logs")
    return parser


def write_report(args: argparse.Namespace, specs: list[MethodSpec], skipped: dict[str, str],
                 rounds: dict[str, list[dict[str, Any]]], rounds_completed: int,
                 out_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """Merge the rounds run so far and write results.json and table.txt. Called after every round: a run stopped
    part way (a session's time, an interrupted client) keeps what its finished rounds measured, marked partial."""
    methods = [{"label": spec.label, "method": spec.method, "status": "skipped", "reason": skipped[spec.label]}
               if skipped[spec.label] else merge_rounds(rounds[spec.label]) for spec in specs]
    add_ratios(methods)
    add_builtin_ratios(methods)
    report = {"config": {k: v for k, v in vars(args).items()}, "rounds_completed": rounds_completed,
              "methods": methods}
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    table = format_table(methods)
    if rounds_completed < args.repeats:
        table = f"partial: {rounds_completed} of {args.repeats} rounds\n" + table
    (out_dir / "table.txt").write_text(table + "\n")
    return methods, table


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not args.concurrency or min(args.concurrency) < 1:
            raise ValueError
    except ValueError:
        print(f"vllm-treespec bench serve: --concurrency must be positive integers, got {args.concurrency!r}",
              file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"vllm-treespec bench serve: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return 2
    if args.waves < 1:
        print(f"vllm-treespec bench serve: --waves must be >= 1, got {args.waves}", file=sys.stderr)
        return 2
    try:
        specs = parse_methods(args.methods)
        for spec in specs:
            check_method(spec)
        args.plain = never_drafting_labels(args.plain, specs)  # a list: results.json records the arguments
        questions = load_questions([p.strip() for p in args.prompts.split(",") if p.strip()], None)
        check_held_out(questions, specs, args.allow_training_prompts)
    except BenchError as e:
        print(f"vllm-treespec bench serve: {e}", file=sys.stderr)
        return 2
    if args.model is None:
        from vllm_treespec.tools.models import ensure_smollm2

        args.model = str(ensure_smollm2())
    # interleave categories so that every level sees a mix
    pools = [[q["turns"][0] for q in qs] for qs in questions.values()]
    prompts = [pool[i] for i in range(max(map(len, pools))) for pool in pools if i < len(pool)]
    needed = sum(level_requests(c, args) for c in args.concurrency)
    if len(prompts) < needed:
        # a reused prompt is scored against an answer the server has already produced (graft's and suffix_tree's
        # stores of finished outputs then predict it whole)
        print(f"vllm-treespec bench serve: --prompts {args.prompts!r} gives {len(prompts)} prompts, but "
              f"--concurrency {','.join(map(str, args.concurrency))} with --requests-per-level "
              f"{args.requests_per_level} and --waves {args.waves} sends {needed} requests per server, each a "
              f"different prompt: give more prompts or send fewer requests", file=sys.stderr)
        return 2
    skipped = {spec.label: unavailable_reason(spec) for spec in specs}
    args.kv_cache_gib = None  # each server's KV cache: the servers' default unless interleaved
    try:
        longest = check_prompt_lengths(load_tokenizer(args.model), questions, args.max_model_len, args.max_tokens)
        if args.interleave:
            labels = [spec.label for spec in specs if not skipped[spec.label]]
            args.kv_cache_gib = interleaved_kv_cache_gib(args, longest, labels)
            print(f"--interleave: {len(labels)} servers up together, {args.kv_cache_gib} GiB of KV cache each",
                  file=sys.stderr)
    except (BenchError, ServerMemoryError) as e:
        print(f"vllm-treespec bench serve: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    rounds: dict[str, list[dict[str, Any]]] = {spec.label: [] for spec in specs}
    for r in range(args.repeats):
        order = [spec for spec in round_order(specs, r) if not skipped[spec.label]]
        if args.interleave:
            if args.repeats > 1:
                print(f"round {r + 1}/{args.repeats}: {', '.join(spec.label for spec in order)} together",
                      file=sys.stderr)
            for label, entry in run_interleaved(order, prompts, args, out_dir, r).items():
                rounds[label].append(entry)
        else:
            for spec in order:
                if args.repeats > 1:
                    print(f"round {r + 1}/{args.repeats}: {spec.label}", file=sys.stderr)
                rounds[spec.label].append(run_method(spec, prompts, args, out_dir, r))
        methods, table = write_report(args, specs, skipped, rounds, r + 1, out_dir)
    print(table)
    path = plot(methods, out_dir)
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'table.txt'}, {path}")
    return 0 if all(m["status"] in ("ok", "skipped") and not m.get("failed_rounds") for m in methods) else 1


if __name__ == "__main__":
    raise SystemExit(main())
