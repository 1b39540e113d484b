"""The README's main job: offline generation on the embedded SmolLM2 model with a tree method of ours.

Runs the same chat prompts without speculation and with the chosen method, prints the generated text, the method
that ran, tokens/s for both, the mean accepted length and whether greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import time

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-treespec demo", description=__doc__)
    parser.add_argument("--method", default="graft", help="tree method (graft, suffix_tree, ngram_tree, static_tree…)")
    # 16: on 2 CPU cores the demo measured 0.93x with 16 and 0.83x with 32 before the acceptance calibration (wider
    # verify steps cost more than they win); 1.16x with 16 since
    parser.add_argument("--num-speculative-tokens", type=int, default=16, help="tree node budget per step")
    parser.add_argument("--dtype", default="float32", help="float32 makes greedy output exactly comparable")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--train-eagle", action="store_true",
                        help="first train the EAGLE-3 head graft / eagle_tree use, if it is not there yet "
                             "(about 35 min on 2 CPU cores; `vllm-treespec train-eagle --help`)")
    args = parser.parse_args(argv)

    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2

    cpu_memory_defaults()
    model = args.model or str(ensure_smollm2())
    from vllm_treespec.proposers.eagle_tree import default_head_path

    head = default_head_path()
    if args.model is None and not (head / "config.json").is_file():
        if args.train_eagle:
            from vllm_treespec.training.train import main as train_eagle

            if train_eagle(["-o", str(head)]) != 0:
                return 1
        elif args.method == "eagle_tree":
            print(f"eagle_tree needs a trained EAGLE-3 head and there is none at {head}: "
                  "`bash scripts/demo.sh --method eagle_tree --train-eagle` trains it once (~35 min).", flush=True)
            return 2
    from vllm import LLM, SamplingParams
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = {}
    for label, spec in (("no speculation", None),
                        (args.method, {"method": args.method, "num_speculative_tokens": args.num_speculative_tokens})):
        llm = LLM(model=model, dtype=args.dtype, max_model_len=2048, max_num_seqs=8, speculative_config=spec,
                  disable_log_stats=False, seed=0)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
        before = spec_decode_summary(llm)
        started = time.perf_counter()
        outputs = []
        for prompt in prompts:  # batch 1: the latency case speculation is for
            outputs += llm.generate([prompt], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        after = spec_decode_summary(llm)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        stats = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        results[label] = (outputs, tokens / elapsed, stats)
        del llm
        import gc

        gc.collect()

    base_outputs, base_speed, _ = results["no speculation"]
    outputs, speed, stats = results[args.method]
    for prompt, out in zip(PROMPTS, outputs):
        print(f"\n### {prompt}\n{out.outputs[0].text.strip()}")
    drafts = stats.get("num_drafts", 0)
    tau = 1 + stats.get("num_accepted_tokens", 0) / drafts if drafts else float("nan")
    identical = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outputs, base_outputs))
    print(f"\nspeculative method: {args.method} (tree verification by vllm_treespec; model {model}, {args.dtype})")
    print(f"decode speed: {speed:.1f} tok/s with {args.method}, {base_speed:.1f} tok/s without "
          f"({speed / base_speed:.2f}x); mean accepted length per step {tau:.2f}")
    print(f"greedy outputs identical to no speculation: {identical}/{len(outputs)}")
    return 0 if identical == len(outputs) or args.dtype != "float32" else 1


if __name__ == "__main__":
    raise SystemExit(main())
