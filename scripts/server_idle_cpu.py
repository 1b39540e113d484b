"""CPU a served engine keeps burning after its last response: why ``bench serve --interleave`` pauses between turns.

    python scripts/server_idle_cpu.py                      # no speculation, bf16, 3 requests
    python scripts/server_idle_cpu.py --speculative-config '{"method": "graft"}' --dtype float32

Starts the project's OpenAI server on the embedded model (or ``--model``), sends one short completion at a time, and
after each response prints the CPU seconds its whole process group used in every ``--bin`` seconds that follow
(1.0 per bin of 1 s = one core fully busy). vLLM's message queues keep polling (``sched_yield``) for a while after
their last message; under ``--interleave`` the next server's turn would share the cores with that. Run it alone:
nothing else should be using the CPUs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request

import psutil

from vllm_treespec.tools.serving import ServerProcess, cpu_seconds_by_process


def process_group_cpu_seconds(root: psutil.Process) -> float:
    return sum(seconds for _, _, seconds in cpu_seconds_by_process(root.pid).values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--speculative-config", default=None, help="JSON, as for vllm serve (default: none)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to watch after each response")
    parser.add_argument("--bin", type=float, default=0.1, help="seconds per printed reading")
    args = parser.parse_args(argv)
    if args.model is None:
        from vllm_treespec.tools.models import ensure_smollm2

        args.model = str(ensure_smollm2())
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    print(f"CPU seconds per {args.bin:g} s after each response (a busy core reads {args.bin:g})")
    with ServerProcess(args.model, spec, ["--dtype", args.dtype]) as server:
        root = psutil.Process(server.process.pid)
        body = json.dumps({"model": args.model, "prompt": "Tell me a story about a cat.", "max_tokens": 64}).encode()
        for trial in range(args.trials):
            request = urllib.request.Request(f"{server.url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as reply:
                reply.read()
            last, start, readings = process_group_cpu_seconds(root), time.monotonic(), []
            while time.monotonic() - start < args.seconds:
                time.sleep(args.bin)
                now = process_group_cpu_seconds(root)
                readings.append(now - last)
                last = now
            busy = next((i for i in range(len(readings)) if all(r < 0.25 * args.bin for r in readings[i:])),
                        len(readings))
            print(f"response {trial + 1}: busy for {busy * args.bin:.1f} s | " + " ".join(f"{r:.2f}" for r in readings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
