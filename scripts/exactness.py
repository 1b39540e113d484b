"""Greedy exactness sweep: tree speculation vs no speculation on real prompts, fp32, one run.

    .venv/bin/python scripts/exactness.py [--methods static_tree,suffix_tree,graft] [--mt-bench 80] [--humaneval 40]
                                          [--max-tokens 64] [--batch-sizes 8,1] [--compile] [--options JSON]

``--compile``: engines as vLLM starts them by default, the model compiled (torch.compile, inductor), instead of eager
(each engine then starts in ~1.5 min on a 2-core CPU, against ~15 s).

Prints, per method and batch size, how many outputs are token-identical to no speculation, and the mean accepted
length per verify step; exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "helpers"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="static_tree,suffix_tree,graft")
    parser.add_argument("--mt-bench", type=int, default=80)
    parser.add_argument("--humaneval", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="8,1")
    parser.add_argument("--num-speculative-tokens", type=int, default=32)
    parser.add_argument("--options", type=json.loads, default={},
                        help="speculative-config keys added to every method's, e.g. '{\"mode\": \"hidden\"}' for "
                        "kv_aware on the shipped EAGLE-3 head")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model, vLLM's default (default here: eager, as the tests run)")
    args = parser.parse_args()

    from engine_helpers import chat_prompts, close, make_llm, spec_counters, token_ids
    from vllm import SamplingParams

    from vllm_treespec.tools.models import ensure_smollm2

    model = str(ensure_smollm2())
    prompts = chat_prompts(model, args.mt_bench, args.humaneval)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    def run(llm, batch):
        out = []
        for i in range(0, len(prompts), batch):
            out += token_ids(llm.generate(prompts[i: i + batch], params, use_tqdm=False))
        return out

    engine_options = {"enforce_eager": not args.compile}
    llm = make_llm(model, **engine_options)
    reference = run(llm, 8)
    close(llm)
    failures = 0
    report = []
    for method in args.methods.split(","):
        llm = make_llm(model, {"method": method, "num_speculative_tokens": args.num_speculative_tokens,
                               **args.options}, **engine_options)
        try:
            for batch in batch_sizes:
                before = spec_counters(llm)
                started = time.perf_counter()
                got = run(llm, batch)
                elapsed = time.perf_counter() - started
                after = spec_counters(llm)
                drafts = after["num_drafts"] - before["num_drafts"]
                accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                same = sum(a == b for a, b in zip(got, reference))
                failures += len(prompts) - same
                row = {"method": method, "compiled": args.compile, "batch": batch, "identical": same,
                       "prompts": len(prompts),
                       "tau": 1 + accepted / drafts if drafts else None, "seconds": round(elapsed, 1)}
                report.append(row)
                print(json.dumps(row), flush=True)
        finally:
            close(llm)
    print(f"{'OK' if failures == 0 else 'MISMATCH'}: {failures} non-identical outputs")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
