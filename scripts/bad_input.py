"""Long bad-input check: every bad speculative config as a real ``serve`` startup, then bad requests to a live server.

1. Each entry of ``tests/unit/test_bad_config.py::BAD_CONFIGS`` (plus a corrupt datastore file) is passed to
   ``python -m vllm_treespec.tools.cli serve`` (tiny model, 127.0.0.1); the server must exit non-zero and its output
   must contain the message naming the field.
2. A suffix_tree server on SmolLM2 gets every request of ``tests/tooling/test_server_reliability.py::BAD_REQUESTS``
   ``--rounds`` times, interleaved with good requests at concurrency 8: each bad one must get a 4xx, each good one
   a 200, and the server must be alive and healthy at the end.

Usage: .venv/bin/python scripts/bad_input.py [--only-configs | --only-requests] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "unit"), str(ROOT / "tests" / "tooling"), str(ROOT / "tests" / "helpers")]

from test_bad_config import BAD_CONFIGS  # noqa: E402
from test_server_reliability import BAD_REQUESTS  # noqa: E402

from vllm_treespec.tools import soak  # noqa: E402
from vllm_treespec.tools.serving import ServerProcess, ServerStartError, client_session, request  # noqa: E402


def check_configs(tmp: Path) -> int:
    from vllm_treespec.tools.models import ensure_tiny_llama

    model = str(ensure_tiny_llama())
    corrupt = tmp / "corrupt.vtds"
    corrupt.write_bytes(b"not a datastore" * 10)
    cases = list(BAD_CONFIGS) + [("suffix-datastore-corrupt", {"method": "suffix_tree", "datastore": str(corrupt)},
                                  ["datastore", "not a vllm-treespec datastore"])]
    failures = 0
    for case_id, spec, expected in cases:
        started = time.perf_counter()
        server = ServerProcess(model, spec, ["--enforce-eager"], log_path=tmp / f"{case_id}.log",
                               startup_timeout_s=300)
        try:
            server.start()
        except ServerStartError as e:
            log = server.log_path.read_text(errors="replace")
            missing = [part for part in expected if part not in log]
            line = next((ln.strip() for ln in log.splitlines() if expected[0] in ln and "Error" in ln), "")
            ok = e.returncode not in (None, 0) and not missing
            verdict = "ok" if ok else f"FAIL (exit {e.returncode}, missing {missing})"
        else:
            server.stop()
            ok, verdict, line = False, "FAIL (server started)", ""
        failures += not ok
        print(f"{case_id:32s} {time.perf_counter() - started:5.1f}s  {verdict}  {line[:150]}", flush=True)
    print(f"bad configs: {len(cases) - failures}/{len(cases)} failed at startup with the field named")
    return failures


def check_requests(rounds: int) -> int:
    from vllm_treespec.tools.models import ensure_smollm2

    good = {"model": soak.SERVED_NAME, "prompt": "1, 2, 3,", "max_tokens": 8, "temperature": 0}
    jobs = []
    for _ in range(rounds):
        for payload, endpoint in BAD_REQUESTS:
            jobs.append(("bad", f"/v1/{endpoint}", {"model": soak.SERVED_NAME, **payload}))
            jobs.append(("good", "/v1/completions", good))

    async def go(url: str):
        gate = asyncio.Semaphore(8)

        async def one(session, kind, path, body):
            async with gate:
                return kind, body, await request(session, url + path, body, timeout_s=120)

        async with client_session(8) as session:
            return await asyncio.gather(*(one(session, *job) for job in jobs))

    with ServerProcess(str(ensure_smollm2()), {"method": "suffix_tree", "num_speculative_tokens": 16},
                       soak.server_args("float32", 1024, 16, enforce_eager=True)) as server:
        results = asyncio.run(go(server.url))
        alive, healthy = server.alive(), server.healthy()
    wrong = [(kind, body, reply.status) for kind, body, reply in results
             if (kind == "bad" and not (reply.status and 400 <= reply.status < 500))
             or (kind == "good" and not reply.ok)]
    statuses = sorted({reply.status for kind, _, reply in results if kind == "bad"})
    for kind, body, status in wrong[:20]:
        print(f"  unexpected: {kind} request got {status}: {str(body)[:120]}")
    n_bad = sum(1 for kind, _, _ in results if kind == "bad")
    print(f"bad requests: {n_bad} sent ({len(BAD_REQUESTS)} kinds x {rounds}), statuses {statuses}, "
          f"{len(wrong)} unexpected replies, server alive {alive}, healthy {healthy}")
    return len(wrong) + (not alive) + (not healthy)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--only-configs", action="store_true")
    group.add_argument("--only-requests", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    failures = 0
    with tempfile.TemporaryDirectory(prefix="bad-input-") as tmp:
        if not args.only_requests:
            failures += check_configs(Path(tmp))
        if not args.only_configs:
            failures += check_requests(args.rounds)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
