"""Tree-verification overhead: mask build + acceptance + KV compaction vs the target forward step, one run.

Runs the embedded SmolLM2 model at batch 8 with random 64-node trees (a fixed-size load; tokens come from each
request's own text so some are accepted) and reads the verifier's host-time breakdown from the worker. The step
time is the engine's wall time per verify step in the same run. Goal (issue 3): overhead <= 5% of the step.

    .venv/bin/python scripts/bench_overhead.py [--nodes 64] [--batch 8] [--max-tokens 96] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    # collective_rpc ships verifier_report to the worker by pickle (local benchmark only).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from engine_helpers import chat_prompts, close, make_llm  # also puts tests/helpers on the workers' PYTHONPATH
    from vllm import SamplingParams

    from vllm_treespec.tools.models import ensure_smollm2

    model = str(ensure_smollm2())
    prompts = chat_prompts(model, limit_mt=args.batch, limit_he=0)[: args.batch]
    llm = make_llm(model, {"method": "testing_proposers.RandomTreeProposer", "num_speculative_tokens": args.nodes,
                           "num_nodes": args.nodes}, dtype=args.dtype, max_num_seqs=args.batch,
                   max_num_batched_tokens=8192)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        from vllm_treespec.verify.report import verifier_report

        before = llm.collective_rpc(verifier_report)[0]
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - started
        after = llm.collective_rpc(verifier_report)[0]
    finally:
        close(llm)
    steps = after["tree_steps"] - before["tree_steps"]
    rows = after["tree_rows"] - before["tree_rows"]
    seconds = {k: after["seconds"].get(k, 0.0) - before["seconds"].get(k, 0.0) for k in after["seconds"]}
    step = wall / steps
    overhead = seconds["mask_build"] + seconds["attach"] + seconds["accept"] + seconds["compact"]
    print(f"{args.nodes}-node trees, batch {args.batch}, {args.dtype}: {steps} verify steps, {rows / steps:.1f} tree "
          f"rows/step, mean accepted {(after['accepted'] - before['accepted']) / rows:.2f}")
    print(f"step (engine wall time / verify steps): {step * 1e3:.1f} ms")
    for name in ("attach", "mask_build", "accept", "compact"):
        print(f"  {name:10s} {seconds[name] / steps * 1e3:7.3f} ms/step  {seconds[name] / steps / step:6.2%}")
    print(f"overhead (mask build + acceptance + compaction): {overhead / steps * 1e3:.2f} ms/step = "
          f"{overhead / wall:.2%} of the step (goal <= 5%)")


if __name__ == "__main__":
    main()
