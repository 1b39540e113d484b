"""Per-depth chain acceptance of draft heads, offline, on the target's own greedy continuations.

    python scripts/eval_kv_alpha.py [--mt-bench 40] [--long 12] [--heads eagle=PATH,kv=PATH,hybrid=PATH]

Two prompt sets: MT-Bench first turns, and *long* prompts — the longest ShareGPT first turns of the benchmark prefix
(held out from head training), 2k-3.8k tokens, each followed by "Summarize the text above." The target answers each
greedily (vLLM, bf16, 128 tokens); transformers re-reads prompt + answer and keeps the aux hidden states (the
trainer's feature pipeline). Every head then drafts a depth-8 chain from every answer position by the trainer's own
unrolled forward (``ttt_forward``: while a chain is accepted its inputs are the committed tokens, so this is exactly
what the proposer drafts with ``top_k=1``); KV-aware heads read the target's K/V recomputed from the aux states.

    acc_d   = P(depth-d draft token == target's token), the chain's inputs being the committed tokens
              (training-time-test accuracy: every root counts at every depth, so deep positions are well sampled
              and the decay with depth shows directly)
    alpha_d = P(depth-d draft token == target's token | depths 1..d-1 accepted)   (few chains reach deep)
    MAT     = 1 + sum_d prod_{j<=d} alpha_j        (expected tokens per step of a depth-8 chain)

Prints one table per set, writes JSON (``--out``). Heads default to the trained heads in the cache
(``train-eagle`` and ``train-eagle --mode kv|hybrid``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

LONG_SUFFIX = "\n\nSummarize the text above."


def long_questions(tokenizer, count: int, min_tokens: int, max_tokens: int) -> list[tuple[str, str]]:
    from vllm_treespec.tools.data import sharegpt
    from vllm_treespec.training.data import SHAREGPT_EVAL_PREFIX

    pool = sharegpt(limit=SHAREGPT_EVAL_PREFIX, seed=0)
    pool = sorted(pool, key=lambda q: -len(q["turns"][0]))
    out = []
    for q in pool:
        text = q["turns"][0] + LONG_SUFFIX
        n = len(tokenizer(text)["input_ids"])
        if min_tokens <= n <= max_tokens:
            out.append((f"long-{q['question_id']}", text))
        if len(out) == count:
            break
    return out


def chain_alpha(head, feats, depth: int, projector=None) -> dict:
    """Accepted-chain counts per depth over every answer position of every conversation."""
    import torch

    from vllm_treespec.training.train import ttt_forward

    reached = np.zeros(depth + 1)  # reached[d]: chains whose first d tokens were accepted (d=0: all roots)
    correct = np.zeros(depth)  # correct[k]: roots whose depth-(k+1) token is right (earlier ones right or not)
    d2t = head.draft_to_target
    with torch.inference_mode():
        for c in range(len(feats)):
            tokens, mask, _valid, aux, _final = feats.batch([c])
            t = tokens.shape[1]
            target_kv = None
            if head.reads_target_kv:
                target_kv = projector(aux)
            alive = None
            # roots: rows j whose first drafted token (position j+2) is an answer token and whose whole chain fits
            roots = torch.zeros(t, dtype=torch.bool)
            roots[: max(0, t - 1 - depth)] = mask[0, 2: 2 + max(0, t - 1 - depth)] > 0
            for k, logits in ttt_forward(head, tokens, aux.float(), depth, target_kv):
                pred = d2t[logits[0].argmax(-1)]
                hit = torch.zeros(t, dtype=torch.bool)
                hit[: t - 2 - k] = pred[: t - 2 - k] == tokens[0, 2 + k:]
                if alive is None:
                    alive = roots.clone()
                    reached[0] += int(alive.sum())
                alive &= hit
                reached[k + 1] += int(alive.sum())
                correct[k] += int((hit & roots).sum())
    return {"roots": int(reached[0]), "reached": reached.tolist(), "correct": correct.tolist()}


def summarize(reached: list[float], correct: list[float]) -> dict:
    r = np.asarray(reached)
    alpha = (r[1:] / np.maximum(r[:-1], 1)).round(4)
    mat = 1 + float((r[1:] / max(r[0], 1)).sum())
    acc = (np.asarray(correct) / max(r[0], 1)).round(4)
    return {"acc": acc.tolist(), "alpha": alpha.tolist(), "mat": round(mat, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mt-bench", type=int, default=40, help="MT-Bench first turns (0: skip)")
    p.add_argument("--long", type=int, default=12, help="long prompts (0: skip)")
    p.add_argument("--long-min-tokens", type=int, default=2000)
    p.add_argument("--long-max-tokens", type=int, default=3800)
    p.add_argument("--max-tokens", type=int, default=128, help="answer tokens per prompt")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--heads", default=None, help="name=folder,... (default: the trained heads in the cache)")
    p.add_argument("--work-dir", default=None, help="answers and features (default: <cache>/kv-alpha-eval)")
    p.add_argument("--out", default="bench_out/kv_alpha.json")
    args = p.parse_args(argv)

    from vllm_treespec.tools.engine_env import cpu_memory_defaults

    cpu_memory_defaults()
    from transformers import AutoTokenizer

    from vllm_treespec.tools.data import mt_bench
    from vllm_treespec.training.data import extract_features, generate_answers
    from vllm_treespec.eagle.kv_head import TargetKVProjector
    from vllm_treespec.eagle.checkpoint import load_draft_head
    from vllm_treespec.eagle.model import param_count
    from vllm_treespec.training.train import Features, _target_tensors
    from vllm_treespec.settings import default_cache_dir
    from vllm_treespec.tools.models import ensure_smollm2
    from vllm_treespec.proposers.eagle_tree import default_kv_head_path

    model_dir = str(ensure_smollm2())
    work = Path(args.work_dir or default_cache_dir() / "kv-alpha-eval")
    work.mkdir(parents=True, exist_ok=True)
    if args.heads:
        heads = dict(item.split("=", 1) for item in args.heads.split(","))
    else:
        heads = {name: str(default_kv_head_path(mode)) for name, mode in
                 (("eagle3 (hidden)", "hidden"), ("kv", "kv"), ("hybrid", "hybrid"))
                 if (default_kv_head_path(mode) / "config.json").is_file()}
    if not heads:
        print("eval_kv_alpha: no trained heads (run vllm-treespec train-eagle [--mode kv|hybrid])", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sets = {}
    if args.mt_bench:
        sets["mt_bench"] = ([(f"mt-{q['question_id']}", q["turns"][0]) for q in mt_bench()[: args.mt_bench]], 2048)
    if args.long:
        sets["long"] = (long_questions(tokenizer, args.long, args.long_min_tokens, args.long_max_tokens), 4096)
    embed, _ = _target_tensors(model_dir)
    loaded = {}
    for name, path in heads.items():
        head = load_draft_head(path, embed=embed).eval()
        projector = (TargetKVProjector(model_dir, head.cfg.kv_layers, head.cfg.aux_layers)
                     if head.reads_target_kv else None)
        loaded[name] = (head, projector)
    aux_layers = next(iter(loaded.values()))[0].cfg.aux_layers
    if any(h.cfg.aux_layers != aux_layers for h, _ in loaded.values()):
        raise SystemExit("eval_kv_alpha: the heads read different aux layers; evaluate them separately")
    report = {"depth": args.depth, "heads": {n: {"path": heads[n], "parameters": param_count(h),
                                                 "mode": getattr(h.cfg, "mode", "hidden")}
                                             for n, (h, _) in loaded.items()}, "sets": {}}
    for set_name, (questions, max_len) in sets.items():
        answers = generate_answers(model_dir, questions, work / f"{set_name}.jsonl", args.max_tokens,
                                   batch=16, max_model_len=max_len)
        # features of exactly these questions (the answers file keeps every answer ever generated)
        wanted = {qid for qid, _ in questions}
        subset = work / f"{set_name}-{len(questions)}.jsonl"
        subset.write_text("".join(line for line in open(answers) if line.strip()
                                  and json.loads(line)["question_id"] in wanted))
        feats_dir = extract_features(model_dir, subset, work / f"features-{set_name}-{len(questions)}",
                                     tuple(aux_layers), max_len=max_len, batch_tokens=8192)
        feats = Features(feats_dir)
        lengths = [feats.length(i) for i in range(len(feats))]
        entry = {"conversations": len(feats), "mean_tokens": round(float(np.mean(lengths)), 1), "heads": {}}
        print(f"\n{set_name}: {len(feats)} conversations, mean {entry['mean_tokens']} tokens (prompt + answer)")
        print(f"{'head':<16} {'params':>9} {'':>5} " + " ".join(f"d{d + 1:<5}" for d in range(args.depth)) + "  MAT")
        for name, (head, projector) in loaded.items():
            t0 = time.time()
            counts = chain_alpha(head, feats, args.depth, projector)
            res = {**counts, **summarize(counts["reached"], counts["correct"]), "eval_s": round(time.time() - t0, 1)}
            entry["heads"][name] = res
            print(f"{name:<16} {param_count(head):>9} {'acc':>5} " + " ".join(f"{a:<6.3f}" for a in res["acc"]))
            print(f"{'':<16} {'':>9} {'alpha':>5} " + " ".join(f"{a:<6.3f}" for a in res["alpha"])
                  + f" {res['mat']:.3f}")
            print(f"{'':<16} {'':>9} {'n':>5} " + " ".join(f"{int(n):<6d}" for n in counts["reached"][:-1]))
        report["sets"][set_name] = entry
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
