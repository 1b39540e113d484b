"""Soak test of the OpenAI server with a speculative method: a bounded mix of requests at fixed concurrency.

The mix (:data:`KINDS`) covers greedy and sampled decoding, top-p/top-k, stop strings, max_tokens edges, logprobs,
presence/frequency/repetition penalties, structured output (JSON schema), streaming, n > 1 and client aborts
mid-stream, over the completions and chat endpoints. Every request is checked:

* lost: a request that did not end with HTTP 200 and a finish reason (aborts excepted: the client hung up on
  purpose), or whose reply is malformed for its kind (logprobs missing, JSON-schema output that does not parse);
* crash: the server process gone or ``/health`` failing at the end;
* mismatch: a greedy request (temperature 0, no logprobs) whose tokens differ from those of a no-speculation
  server that replays the same greedy requests afterwards;
* memory: RSS of the server's own processes (API server, engine core, workers), sampled every second across the
  soak (start/mid/end/max); short-lived helpers such as inductor's C++ compiler are reported apart.

``python -m vllm_treespec.tools.soak --requests 500`` (or ``scripts/soak.sh``) runs the long version; the tests run a short
one. Everything talks to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from vllm_treespec.tools.serving import Reply, RssSampler, ServerProcess, client_session, request

SERVED_NAME = "soak"

CHAT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system in order.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Explain what a hash map is in two sentences.",
    "Give three tips for writing readable code.",
    "Translate 'good morning, how are you?' into French and Spanish.",
]
COMPLETION_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "import numpy as np\n\ndef normalize(x):\n",
    "Once upon a time, in a small village by the sea,",
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@dataclass
class SoakRequest:
    index: int
    kind: str
    endpoint: str  # "/v1/completions" or "/v1/chat/completions"
    payload: dict[str, Any]
    #: compared token for token with the no-speculation server
    greedy: bool = False
    #: the client hangs up after this many streamed chunks
    abort_after: int | None = None
    check: Callable[[Reply], str | None] | None = None


def _completion(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": prompt, **kw}


def _chat(prompt: str, **kw: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], **kw}


def _check_completion_logprobs(reply: Reply) -> str | None:
    lp = reply.body["choices"][0].get("logprobs") or {}
    tokens, top = lp.get("tokens") or [], lp.get("top_logprobs") or []
    n = reply.completion_tokens
    if len(tokens) != n or len(top) != n or any(len(t) < 1 for t in top):
        return f"logprobs for {len(tokens)} tokens ({len(top)} top lists) but {n} tokens generated"
    return None


def _check_chat_logprobs(reply: Reply) -> str | None:
    content = (reply.body["choices"][0].get("logprobs") or {}).get("content") or []
    if len(content) != reply.completion_tokens or any(len(c.get("top_logprobs") or []) != 2 for c in content):
        return f"chat logprobs for {len(content)} tokens but {reply.completion_tokens} generated"
    return None


def _check_json_schema(reply: Reply) -> str | None:
    if reply.finish_reason != "stop":
        return None  # cut by max_tokens: the prefix need not parse
    try:
        obj = json.loads(reply.text)
    except json.JSONDecodeError as e:
        return f"structured output is not JSON ({e.msg}): {reply.text[:120]!r}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("age"), int):
        return f"structured output does not match the schema: {reply.text[:120]!r}"
    return None


def _check_stop(stop: list[str]) -> Callable[[Reply], str | None]:
    def check(reply: Reply) -> str | None:
        hit = [s for s in stop if s in reply.text]
        return f"stop string {hit[0]!r} in the output" if hit else None

    return check


def _check_n(n: int) -> Callable[[Reply], str | None]:
    def check(reply: Reply) -> str | None:
        got = len(reply.body.get("choices") or [])
        return None if got == n else f"n={n} but {got} choices"

    return check


def _make(kind: str, i: int, rng: random.Random) -> SoakRequest:
    cp, chp = rng.choice(COMPLETION_PROMPTS), rng.choice(CHAT_PROMPTS)
    comp, chat = "/v1/completions", "/v1/chat/completions"
    if kind == "greedy":
        return SoakRequest(i, kind, comp, _completion(cp, temperature=0, max_tokens=rng.randint(8, 48),
                                                      return_token_ids=True), greedy=True)
    if kind == "greedy_chat_stream":
        return SoakRequest(i, kind, chat, _chat(chp, temperature=0, max_tokens=rng.randint(8, 48), stream=True,
                                                return_token_ids=True), greedy=True)
    if kind == "max_tokens_edge":
        return SoakRequest(i, kind, comp, _completion(cp, temperature=0, max_tokens=rng.choice([1, 2]),
                                                      return_token_ids=True), greedy=True)
    if kind == "stop":
        stop = rng.choice([["\n"], [".", ","], ["the"]])
        return SoakRequest(i, kind, comp, _completion(cp, temperature=0, max_tokens=40, stop=stop,
                                                      return_token_ids=True), greedy=True, check=_check_stop(stop))
    if kind == "sampled":
        return SoakRequest(i, kind, chat, _chat(chp, temperature=rng.choice([0.6, 1.0]), top_p=0.9, top_k=40,
                                                seed=rng.randint(0, 1 << 20), max_tokens=rng.randint(8, 40)))
    if kind == "sampled_stream":
        return SoakRequest(i, kind, comp, _completion(cp, temperature=0.8, top_k=20, max_tokens=32, stream=True,
                                                      stream_options={"include_usage": True}))
    if kind == "penalties":
        return SoakRequest(i, kind, comp, _completion(cp, temperature=rng.choice([0, 0.7]), presence_penalty=0.6,
                                                      frequency_penalty=0.4, repetition_penalty=1.1, max_tokens=32))
    if kind == "logprobs":
        return SoakRequest(i, kind, comp, _completion(cp, temperature=0, max_tokens=24, logprobs=3),
                           check=_check_completion_logprobs)
    if kind == "chat_logprobs":
        return SoakRequest(i, kind, chat, _chat(chp, temperature=0.5, max_tokens=16, logprobs=True, top_logprobs=2),
                           check=_check_chat_logprobs)
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
        return SoakRequest(i, kind, chat, _chat("Invent a person and give their name and age as JSON.",
                                                temperature=0, max_tokens=48, response_format=fmt),
                           check=_check_json_schema)
    if kind == "n2":
        return SoakRequest(i, kind, comp, _completion(cp, temperature=0.9, n=2, max_tokens=16), check=_check_n(2))
    if kind == "abort_stream":
        return SoakRequest(i, kind, chat, _chat(chp, temperature=0, max_tokens=96, stream=True),
                           abort_after=rng.randint(1, 4))
    raise ValueError(f"unknown soak request kind {kind!r}")


#: kind → relative weight in the mix
KINDS = {"greedy": 4, "greedy_chat_stream": 3, "max_tokens_edge": 1, "stop": 2, "sampled": 2, "sampled_stream": 1,
         "penalties": 1, "logprobs": 1, "chat_logprobs": 1, "json_schema": 1, "n2": 1, "abort_stream": 2}


def make_requests(n: int, seed: int = 0, exclude: Sequence[str] = ()) -> list[SoakRequest]:
    """``n`` requests drawn from :data:`KINDS` less ``exclude`` (every kind at least once when there are enough
    requests), seeded."""
    unknown = sorted(set(exclude) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown soak request kind(s) {unknown}; kinds: {sorted(KINDS)}")
    weights = {k: w for k, w in KINDS.items() if k not in exclude}
    rng = random.Random(seed)
    kinds = list(weights) if n >= len(weights) else []
    kinds += rng.choices(list(weights), weights=list(weights.values()), k=n - len(kinds))
    rng.shuffle(kinds)
    return [_make(kind, i, rng) for i, kind in enumerate(kinds)]


async def send_all(url: str, requests: Sequence[SoakRequest], concurrency: int,
                   timeout_s: float = 300.0) -> list[Reply]:
    """Send every request once with at most ``concurrency`` in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session, req: SoakRequest) -> Reply:
        async with gate:
            return await request(session, url + req.endpoint, req.payload, abort_after_chunks=req.abort_after,
                                 timeout_s=timeout_s)

    async with client_session(concurrency) as session:
        return list(await asyncio.gather(*(one(session, r) for r in requests)))


@dataclass
class SoakReport:
    sent: int = 0
    completed: int = 0
    aborted_by_client: int = 0
    lost: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)
    greedy_compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    server_alive: bool = True
    server_healthy: bool = True
    rss: dict[str, Any] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def passed(self) -> bool:
        return (not self.lost and not self.invalid and not self.mismatches and self.server_alive
                and self.server_healthy and self.completed + self.aborted_by_client == self.sent)

    def summary(self) -> str:
        rss = self.rss
        mem = (f"RSS start {rss['start_mib']:.0f} MiB, mid {rss['mid_mib']:.0f} MiB, end {rss['end_mib']:.0f} MiB, "
               f"max {rss['max_mib']:.0f} MiB ({rss['samples']} samples); helpers at most "
               f"{rss['helpers_max_mib']:.0f} MiB {rss['helpers']}") if rss.get("samples") else "RSS not sampled"
        return (f"sent {self.sent}, completed {self.completed}, aborted by client {self.aborted_by_client}, "
                f"lost {len(self.lost)}, invalid {len(self.invalid)}, greedy compared {self.greedy_compared}, "
                f"mismatches {len(self.mismatches)}, server alive {self.server_alive}, healthy "
                f"{self.server_healthy}, {self.wall_s:.0f} s; {mem}")


def check_replies(requests: Sequence[SoakRequest], replies: Sequence[Reply], report: SoakReport) -> None:
    for req, reply in zip(requests, replies):
        report.sent += 1
        report.by_kind[req.kind] = report.by_kind.get(req.kind, 0) + 1
        if req.abort_after is not None and reply.aborted:
            report.aborted_by_client += 1
            continue
        if not reply.ok or not reply.finish_reason:
            detail = reply.error or str(reply.body)[:300]
            report.lost.append(f"#{req.index} {req.kind}: status {reply.status}, {detail}")
            continue
        report.completed += 1
        problem = req.check(reply) if req.check else None
        if problem:
            report.invalid.append(f"#{req.index} {req.kind}: {problem}")


def compare_greedy(requests: Sequence[SoakRequest], replies: Sequence[Reply], reference: Sequence[Reply],
                   report: SoakReport) -> None:
    """``reference[k]`` answers the k-th greedy request of ``requests`` on the no-speculation server."""
    greedy = [(req, rep) for req, rep in zip(requests, replies) if req.greedy]
    for (req, ours), ref in zip(greedy, reference):
        if not ours.ok or not ref.ok:
            continue  # counted as lost where it happened
        report.greedy_compared += 1
        same = ours.token_ids == ref.token_ids if ours.token_ids or ref.token_ids else ours.text == ref.text
        if not same:
            report.mismatches.append(f"#{req.index} {req.kind}: {ours.text[:60]!r} != {ref.text[:60]!r} (no spec)")


def server_args(dtype: str, max_model_len: int, concurrency: int, seed: int = 0,
                enforce_eager: bool = False) -> list[str]:
    return ["--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(concurrency),
            "--served-model-name", SERVED_NAME, "--seed", str(seed)] + (["--enforce-eager"] if enforce_eager else [])


def run_soak(server: ServerProcess, requests: Sequence[SoakRequest], concurrency: int,
             report: SoakReport | None = None) -> tuple[SoakReport, list[Reply]]:
    """Drive a started server with ``requests``, sampling its RSS; fills ``report`` (all but the greedy comparison)."""
    report = report or SoakReport()
    started = time.perf_counter()
    with RssSampler(server) as rss:
        replies = asyncio.run(send_all(server.url, requests, concurrency))
    report.wall_s = time.perf_counter() - started
    report.rss = rss.summary()
    check_replies(requests, replies, report)
    report.server_alive = server.alive()
    report.server_healthy = server.healthy()
    return report, replies


def replay_greedy(server: ServerProcess, requests: Sequence[SoakRequest], concurrency: int) -> list[Reply]:
    return asyncio.run(send_all(server.url, [r for r in requests if r.greedy], concurrency))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_treespec.tools.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--speculative-config", default='{"method": "suffix_tree", "num_speculative_tokens": 32}',
                        help="JSON speculative config of the server under test")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="float32 makes greedy outputs exactly comparable")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="skip torch.compile in the servers")
    parser.add_argument("--exclude-kinds", default="", help=f"comma-separated kinds to leave out of the mix "
                        f"(to bisect a failure); kinds: {', '.join(KINDS)}")
    parser.add_argument("--no-compare", action="store_true", help="skip the no-speculation greedy replay")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args(argv)
    if args.model is None:
        from vllm_treespec.tools.models import ensure_smollm2

        args.model = str(ensure_smollm2())
    spec = json.loads(args.speculative_config)
    requests = make_requests(args.requests, args.seed, [k for k in args.exclude_kinds.split(",") if k])
    extra = server_args(args.dtype, args.max_model_len, args.concurrency, args.seed, args.enforce_eager)
    print(f"soak: {len(requests)} requests at concurrency {args.concurrency}, speculative config {spec}",
          file=sys.stderr)
    with ServerProcess(args.model, spec, extra) as server:
        report, replies = run_soak(server, requests, args.concurrency)
    print(f"soak: spec server done in {report.wall_s:.0f} s; replaying greedy requests without speculation",
          file=sys.stderr)
    if not args.no_compare:
        with ServerProcess(args.model, None, extra) as baseline:
            reference = replay_greedy(baseline, requests, args.concurrency)
        compare_greedy(requests, replies, reference, report)
    print(report.summary())
    for label, items in (("lost", report.lost), ("invalid", report.invalid), ("mismatch", report.mismatches)):
        for item in items[:20]:
            print(f"  {label}: {item}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**report.__dict__, "passed": report.passed, "speculative_config": spec,
                       "concurrency": args.concurrency}, fh, indent=2)
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
