"""graft against the other drafters, side by side in one run: tau and tok/s at batch 1 on MT-Bench + HumanEval.

For each configuration a fresh engine (embedded SmolLM2-135M-Instruct, fp32 unless ``--dtype``) generates greedily
for every prompt one at a time (batch 1) after a short warm-up. tau = 1 + accepted / drafts from vLLM's own
spec-decode counters (steps that proposed nothing are not drafts, so tok/s is the end-to-end figure); every output is
compared with the no-speculation output. Configurations: no speculation; vLLM ``ngram`` (k=5, prompt lookup 2..4);
vLLM ``eagle3`` (k=5) with the trained head; ``suffix_tree``; ``ngram_tree``; ``eagle_tree``; ``graft`` (on the EAGLE
head); the ablations graft without pruning / without grafting / with the head drafting its full tree before pruning /
ranking nodes by the sources' raw confidences instead of their learned acceptance rates; and graft without the head
(retrieval-only). The
EAGLE rows need a head (``--head``, default: the one ``vllm-treespec train-eagle`` wrote to the cache); without one
they are skipped. ShareGPT prompts come from the benchmark prefix that EAGLE training never sees.

    python scripts/bench_graft.py [--mt-bench 4] [--human-eval 4] [--sharegpt 4] [--max-tokens 128] [--budget 32]
                                  [--graft-options '{"calibration_path": "graft_calibration.json"}'] [--out r.json]
                                  [--only NAME ...] [--confidence-floors 0.05,0.15] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


def configs(budget: int, graft_options: dict, head: str | None,
            floors: tuple[float, ...] = ()) -> list[tuple[str, dict | None]]:
    graft = {"method": "graft", "num_speculative_tokens": budget, **graft_options}
    out = [
        ("no speculation", None),
        ("vllm ngram", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2}),
    ]
    if head:
        out.append(("vllm eagle3 k=5", {"method": "eagle3", "model": head, "num_speculative_tokens": 5}))
    out += [("suffix_tree", {"method": "suffix_tree", "num_speculative_tokens": budget}),
            ("ngram_tree", {"method": "ngram_tree", "num_speculative_tokens": budget})]
    if head:
        out.append(("eagle_tree", {"method": "eagle_tree", "num_speculative_tokens": budget, "checkpoint": head}))
        graft = {"eagle_checkpoint": head, **graft}
    out += [
        ("graft", graft),
        ("graft w/o pruning", {**graft, "prune": False}),
        ("graft w/o grafting", {**graft, "graft": False}),
    ]
    if head:
        out += [("graft, head drafts in full", {**graft, "stop_drafting_at_checkpoints": False}),
                ("graft retrieval-only", {**graft, "eagle_checkpoint": "none"})]
    # ablation: rank and floor nodes by the sources' raw confidences instead of their learned acceptance rates
    out.append(("graft, raw confidences", {**graft, "calibrate_acceptance": False}))
    if head:
        out.append(("graft retrieval-only, raw confidences",
                    {**graft, "eagle_checkpoint": "none", "calibrate_acceptance": False}))
    for floor in floors:  # min_node_confidence: unlikely nodes are not verified
        out.append((f"graft, floor {floor:g}", {**graft, "min_node_confidence": floor}))
        if head:
            out.append((f"graft retrieval-only, floor {floor:g}",
                        {**graft, "eagle_checkpoint": "none", "min_node_confidence": floor}))
    return out


def spec_counters(llm) -> dict[str, float]:
    return {m.name.removeprefix("vllm:spec_decode_"): float(m.value) for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}


def run(model: str, spec: dict | None, prompts: list[str], max_tokens: int, dtype: str) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_treespec.tools.bench import tokens_per_forward

    started = time.perf_counter()
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=4, enforce_eager=True, seed=0,
              speculative_config=spec, disable_log_stats=False)
    startup = time.perf_counter() - started
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # warm-up
        before = spec_counters(llm)
        started = time.perf_counter()
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        elapsed = time.perf_counter() - started
        after = spec_counters(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("num_drafts", 0.0)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    output, accepted = sum(map(len, tokens)), delta.get("num_accepted_tokens", 0.0)
    return {"tokens": tokens, "tok_s": output / elapsed, "seconds": elapsed, "startup_s": startup,
            "tau": 1 + accepted / drafts if drafts else 1.0,
            "drafts": drafts, "draft_tokens": delta.get("num_draft_tokens", 0.0),
            "tokens_per_step": tokens_per_forward(output, accepted)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--mt-bench", type=int, default=4)
    parser.add_argument("--human-eval", type=int, default=4)
    parser.add_argument("--sharegpt", type=int, default=0, help="ShareGPT first turns (benchmark prefix)")
    parser.add_argument("--head", default=None, help="EAGLE-3 head folder (default: the trained default, if any)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=32, help="num_speculative_tokens of the tree methods")
    parser.add_argument("--graft-options", default="{}", help="extra graft options as JSON")
    parser.add_argument("--only", nargs="*", help="run only these configuration names (no speculation always runs)")
    parser.add_argument("--confidence-floors", default="", help="comma-separated graft min_node_confidence values: "
                        "adds graft (and graft retrieval-only) rows at each")
    parser.add_argument("--repeats", type=int, default=1, help="run the configurations this many times, round-robin "
                        "(each on a fresh engine), and report the median tok/s: this machine's speed drifts by 10-20%% "
                        "over minutes, which a single pass attributes to whichever configuration ran then")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2
    from vllm_treespec.tools.graft_calibrate import calibration_prompts

    cpu_memory_defaults()
    model = args.model or str(ensure_smollm2())
    prompts = calibration_prompts(model, args.mt_bench, args.human_eval)
    if args.sharegpt:
        from transformers import AutoTokenizer

        from vllm_treespec.tools.data import chat_prompt, sharegpt

        tok = AutoTokenizer.from_pretrained(model)
        prompts += [chat_prompt(tok, q["turns"][0][:4000]) for q in sharegpt(args.sharegpt)]
    head = args.head
    if head is None:
        from vllm_treespec.proposers.eagle_tree import default_head_path

        head = str(default_head_path()) if (default_head_path() / "config.json").is_file() else None
    results: dict[str, dict] = {}
    floors = tuple(float(v) for v in args.confidence_floors.split(",") if v.strip())
    chosen = [(name, spec) for name, spec in configs(args.budget, json.loads(args.graft_options), head, floors)
              if not args.only or spec is None or name in args.only]
    for repeat in range(args.repeats):
        for name, spec in chosen:
            r = run(model, spec, prompts, args.max_tokens, args.dtype)
            if name in results:  # later repeats add their throughput and outputs; tau is the first pass's
                results[name]["tok_s_runs"].append(r["tok_s"])
                results[name]["tok_s"] = statistics.median(results[name]["tok_s_runs"])
                results[name]["token_runs"].append(r["tokens"])
            else:
                results[name] = {**r, "tok_s_runs": [r["tok_s"]], "token_runs": [r["tokens"]]}
            print(f"[{name}] pass {repeat + 1}: {r['tok_s']:.2f} tok/s, tau {r['tau']:.2f} "
                  f"(engine start {r['startup_s']:.0f} s)", flush=True)

    base = results["no speculation"]
    print(f"\n{len(prompts)} prompts ({args.mt_bench} MT-Bench, {args.human_eval} HumanEval, {args.sharegpt} ShareGPT), "
          f"batch 1, head {head}, "
          f"max_tokens {args.max_tokens}, tree budget {args.budget}, {args.dtype}"
          + (f", median tok/s of {args.repeats} round-robin passes" if args.repeats > 1 else ""))
    print(f"{'method':<36} {'tau':>6} {'tok/step':>8} {'tok/s':>7} {'x no-spec':>10} {'draft tok/draft':>15} "
          f"{'identical':>10}")
    for name, r in results.items():
        # a prompt counts as identical when every pass's output equals the baseline's first pass
        same = sum(all(run[i] == base["tokens"][i] for run in r["token_runs"]) for i in range(len(prompts)))
        per_step = r["draft_tokens"] / r["drafts"] if r["drafts"] else 0.0
        print(f"{name:<36} {r['tau']:>6.2f} {r['tokens_per_step']:>8.2f} {r['tok_s']:>7.2f} "
              f"{r['tok_s'] / base['tok_s']:>9.2f}x "
              f"{per_step:>15.1f} {same:>6}/{len(prompts)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk not in ("tokens", "token_runs")}
                       for k, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
