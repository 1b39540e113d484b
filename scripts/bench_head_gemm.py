"""The draft head's linear layers: torch's ``F.linear`` against vLLM's CPU GEMM dispatch (oneDNN) per dtype, and
int8 weights (fbgemm), per row count, one thread as vLLM's CPU worker here. ``--agreement N``: how often the shipped
head's int8 and bf16 versions pick the fp32 head's top token, and the target's, at draft depths 1-3 over N ShareGPT
answers (prompts from position 4000 of the benchmark shuffle: neither the head's training data nor any benchmark's).

    .venv/bin/python scripts/bench_head_gemm.py [--rows 1 4 16] [--dtypes bfloat16 float32] [--repeats 200]
    .venv/bin/python scripts/bench_head_gemm.py --agreement 24 [--answer-tokens 96]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch


def per_call_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(3):  # best of three batches: the machine drifts
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - started) / repeats * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--agreement", type=int, default=0, metavar="N",
                        help="measure the int8 and bf16 heads' top-1 agreement over N answers instead of timing")
    parser.add_argument("--answer-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm_treespec.eagle.checkpoint import load_draft_head
    from vllm_treespec.eagle.cpu_gemm import use_int8_weights, use_vllm_cpu_gemm
    from vllm_treespec.eagle.default_head import shipped_head_path

    if args.agreement:
        agreement(args.agreement, args.answer_tokens)
        return

    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        folder = shipped_head_path()
        vocab = json.loads((folder / "config.json").read_text())
        embed = torch.zeros(vocab["vocab_size"], vocab["hidden_size"])  # the target's; its values do not matter here
        head = load_draft_head(str(folder), embed=embed, dtype=dtype).eval().requires_grad_(False)
        routed = copy.deepcopy(head)
        use_vllm_cpu_gemm(routed)
        int8 = copy.deepcopy(head)
        use_int8_weights(int8)
        print(f"== {dtype_name}: the shipped head's linear layers, us per call (torch F.linear / vLLM dispatch / "
              "int8 weights)")
        totals = {rows: [0.0, 0.0, 0.0] for rows in args.rows}
        layers = zip(head.named_modules(), routed.named_modules(), int8.named_modules())
        for (name, torch_layer), (_, vllm_layer), (_, int8_layer) in layers:
            if type(torch_layer) is not torch.nn.Linear:
                continue
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, torch_layer.in_features, dtype=dtype)
                with torch.inference_mode():
                    times = [per_call_us(lambda: layer(x), args.repeats)
                             for layer in (torch_layer, vllm_layer, int8_layer)]
                totals[rows] = [t + u for t, u in zip(totals[rows], times)]
                cells.append(f"{rows} rows {times[0]:6.0f} / {times[1]:6.0f} / {times[2]:6.0f}")
            print(f"  {name:12s} {torch_layer.out_features}x{torch_layer.in_features}: " + "; ".join(cells),
                  flush=True)
        print("  all layers:   " + "; ".join(f"{rows} rows {a:6.0f} / {b:6.0f} / {c:6.0f}"
                                             for rows, (a, b, c) in totals.items()), flush=True)


def agreement(num_answers: int, answer_tokens: int) -> None:
    """Teacher-forced drafting (the trainer's unrolled steps) over the target's own greedy answers: per depth, the
    share of answer positions where each head's top token equals the fp32 head's, and the target's next token."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_treespec.eagle.checkpoint import load_draft_head
    from vllm_treespec.eagle.cpu_gemm import use_int8_weights
    from vllm_treespec.eagle.default_head import shipped_head_path
    from vllm_treespec.tools.data import chat_prompt, sharegpt
    from vllm_treespec.tools.models import ensure_smollm2
    from vllm_treespec.training.train import ttt_forward

    model_dir = str(ensure_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    embed = target.get_input_embeddings().weight.detach()
    folder = shipped_head_path()
    heads = {"fp32": load_draft_head(str(folder), embed=embed, dtype=torch.float32)}
    heads["int8"] = copy.deepcopy(heads["fp32"])
    use_int8_weights(heads["int8"])
    heads["bf16"] = load_draft_head(str(folder), embed=embed, dtype=torch.bfloat16)
    aux_layers = heads["fp32"].cfg.aux_layers
    prompts = [q["turns"][0] for q in sharegpt(seed=0)[4000:] if 0 < len(q["turns"][0]) <= 1500][:num_answers]
    steps = 3
    same = {name: np.zeros(steps) for name in heads}
    right = {name: np.zeros(steps) for name in heads}
    counted = np.zeros(steps)
    with torch.inference_mode():
        for text in prompts:
            ids = tokenizer(chat_prompt(tokenizer, text), return_tensors="pt").input_ids
            full = target.generate(ids, max_new_tokens=answer_tokens, do_sample=False)
            out = target.model(input_ids=full, output_hidden_states=True)
            aux = torch.stack([out.hidden_states[k] for k in aux_layers], dim=2)
            answer_start = ids.shape[1]
            tops = {}
            for name, head in heads.items():
                tops[name] = [head.draft_to_target[logits.argmax(-1)][0]
                              for _, logits in ttt_forward(head, full, aux.to(head.fc.weight.dtype), steps)]
            for k in range(steps):
                # row j at step k drafts token j+2+k; count rows whose drafted token is an answer token
                rows = np.arange(max(answer_start - 2 - k, 0), full.shape[1] - 2 - k)
                truth = full[0, rows + 2 + k]
                counted[k] += len(rows)
                for name in heads:
                    same[name][k] += int((tops[name][k][rows] == tops["fp32"][k][rows]).sum())
                    right[name][k] += int((tops[name][k][rows] == truth).sum())
    print(f"== top-1 over {int(counted[0])} answer positions of {len(prompts)} ShareGPT answers (depth 1 / 2 / 3)")
    for name in heads:
        print(f"  {name}: same as fp32 " + " / ".join(f"{s:.3f}" for s in same[name] / counted)
              + "; the target's token " + " / ".join(f"{r:.3f}" for r in right[name] / counted), flush=True)


if __name__ == "__main__":
    main()
