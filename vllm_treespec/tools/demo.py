"""The README's main job: offline generation on the embedded SmolLM2 model with a tree method of ours.

Runs the same chat prompts at batch 1 with the chosen method (default: graft on the EAGLE-3 head, see
:mod:`vllm_treespec.eagle.default_head`), graft retrieval-only, vLLM's ``ngram`` and no speculation, one engine
each; prints the chosen method's answers, then per configuration tokens/s, the speed-up over no speculation, the mean
accepted length per step and whether greedy outputs are identical to no speculation's. Exits non-zero if a tree
method's fp32 output differs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, then explain it.",
    "List the planets of the solar system in order, with one fact about each.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Explain what a hash map is and give a short Python example.",
]


def spec_decode_summary(llm) -> dict[str, float]:
    """Drafts, draft tokens and accepted tokens from vLLM's own spec-decode metrics."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            totals[metric.name.removeprefix("vllm:spec_decode_")] = float(metric.value)
    return totals


NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


@dataclass
class Run:
    label: str
    spec: dict | None
    #: a tree method of ours: its fp32 outputs must equal no speculation's (the demo fails otherwise)
    exact: bool = True
    outputs: list = field(default_factory=list)
    speed: float = 0.0
    tau: float = float("nan")


def head_for(model: str) -> tuple[str | None, str]:
    """The default EAGLE-3 head if it was trained for ``model`` (else None), and a line saying which head runs."""
    import json
    from pathlib import Path

    from vllm_treespec.eagle.default_head import find_default_head
    from vllm_treespec.eagle.target import identity_from_hf_config, mismatch_message

    head = find_default_head()
    if head is None:
        return None, "no EAGLE-3 head (none shipped or trained): graft drafts retrieval-only trees"
    served = identity_from_hf_config(json.loads((Path(model) / "config.json").read_text()), Path(model).name)
    mismatch = mismatch_message(head, served)
    if mismatch:
        return None, f"{mismatch}: graft drafts retrieval-only trees"
    return str(head), f"EAGLE-3 head {head}"


def runs_for(method: str, budget: int, head: str | None, baselines: bool) -> list[Run]:
    """The configurations the demo compares, the chosen method first and no speculation last."""
    spec = {"method": method, "num_speculative_tokens": budget}
    if method == "graft":
        spec["eagle_checkpoint"] = "auto" if head else "none"
    label = f"{method} (head + retrieval)" if method == "graft" and head else method
    runs = [Run(label, spec)]
    if baselines:
        if method == "graft" and head:
            runs.append(Run("graft retrieval-only", {"method": "graft", "num_speculative_tokens": budget,
                                                     "eagle_checkpoint": "none"}))
        if method != "ngram":
            runs.append(Run("vLLM ngram (k=5)", dict(NGRAM_SPEC), exact=False))
    runs.append(Run("no speculation", None, exact=False))
    return runs


def generate(run: Run, model: str, dtype: str, prompts: list[str], max_tokens: int) -> None:
    """Run ``run``'s engine on ``prompts`` one at a time (batch 1: the latency case speculation is for)."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=8, speculative_config=run.spec,
              disable_log_stats=False, seed=0)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = spec_decode_summary(llm)
    started = time.perf_counter()
    for prompt in prompts:
        run.outputs += llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    after = spec_decode_summary(llm)
    run.speed = sum(len(o.outputs[0].token_ids) for o in run.outputs) / elapsed
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    if drafts:
        run.tau = 1 + (after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)) / drafts
    del llm
    gc.collect()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-treespec demo", description=__doc__)
    parser.add_argument("--method", default="graft", help="tree method (graft, eagle_tree, suffix_tree, ngram_tree…)")
    # 16: on 2 CPU cores the demo measured 0.93x with 16 and 0.83x with 32 before the acceptance calibration (wider
    # verify steps cost more than they win); 1.16x with 16 since
    parser.add_argument("--num-speculative-tokens", type=int, default=16, help="tree node budget per step")
    parser.add_argument("--dtype", default="float32", help="float32 makes greedy output exactly comparable")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="compare with no speculation only (skip graft retrieval-only and vLLM ngram)")
    parser.add_argument("--train-eagle", action="store_true",
                        help="first train your own EAGLE-3 head into the cache folder if there is none (about 50 min "
                             "on 2 CPU cores; it then replaces the shipped head: `vllm-treespec train-eagle --help`)")
    args = parser.parse_args(argv)

    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2

    cpu_memory_defaults()
    model = args.model or str(ensure_smollm2())
    from vllm_treespec.eagle.default_head import is_head_folder, trained_head_path

    if args.train_eagle and args.model is None and not is_head_folder(trained_head_path()):
        from vllm_treespec.training.train import main as train_eagle

        if train_eagle(["-o", str(trained_head_path())]) != 0:
            return 1
    head, head_line = head_for(model)
    if args.method == "eagle_tree" and head is None:
        print(f"eagle_tree needs an EAGLE-3 head trained for {model}: {head_line}", flush=True)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS]
    runs = runs_for(args.method, args.num_speculative_tokens, head, baselines=not args.no_baselines)
    for run in [runs[-1], *runs[:-1]]:  # no speculation first
        generate(run, model, args.dtype, prompts, args.max_tokens)

    main_run = runs[0]
    for prompt, out in zip(PROMPTS, main_run.outputs):
        print(f"\n### {prompt}\n{out.outputs[0].text.strip()}")
    print(f"\nspeculative method: {args.method} (tree verification by vllm_treespec; model {model}, {args.dtype}; "
          f"budget {args.num_speculative_tokens} nodes)")
    if args.method in ("graft", "eagle_tree"):
        print(f"draft head: {head_line}")
    lines, differs = summary(runs)
    print("\n" + "\n".join(lines))
    return 1 if differs and args.dtype == "float32" else 0


def summary(runs: list[Run]) -> tuple[list[str], bool]:
    """The comparison table (no speculation last) and whether a run that must be exact differs from it."""
    base = runs[-1]
    width = max(len(r.label) for r in runs)
    lines = [f"{'':{width}}  tok/s  speed-up  accepted/step  identical to no speculation"]
    differs = False
    for run in runs:
        identical = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(run.outputs, base.outputs))
        tau = "-" if run.spec is None else f"{run.tau:.2f}"
        same = "-" if run.spec is None else f"{identical}/{len(run.outputs)}"
        lines.append(f"{run.label:{width}}  {run.speed:5.1f}  {run.speed / base.speed:7.2f}x  {tau:>13}  {same}")
        differs |= run.exact and identical != len(run.outputs)
    return lines, differs


if __name__ == "__main__":
    raise SystemExit(main())
