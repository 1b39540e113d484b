"""The draft head's linear layers: torch's ``F.linear`` against vLLM's CPU GEMM dispatch (oneDNN), per dtype and
row count, one thread as vLLM's CPU worker here; and one drafting call of the shipped head both ways.

    .venv/bin/python scripts/bench_head_gemm.py [--rows 1 4 16] [--dtypes bfloat16 float32] [--repeats 200]
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm_treespec.eagle.checkpoint import load_draft_head
    from vllm_treespec.eagle.cpu_gemm import use_vllm_cpu_gemm
    from vllm_treespec.eagle.default_head import shipped_head_path

    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        folder = shipped_head_path()
        vocab = json.loads((folder / "config.json").read_text())
        embed = torch.zeros(vocab["vocab_size"], vocab["hidden_size"])  # the target's; its values do not matter here
        head = load_draft_head(str(folder), embed=embed, dtype=dtype).eval().requires_grad_(False)
        routed = copy.deepcopy(head)
        use_vllm_cpu_gemm(routed)
        print(f"== {dtype_name}: the shipped head's linear layers, us per call (torch F.linear / vLLM dispatch)")
        for (name, torch_layer), (_, vllm_layer) in zip(head.named_modules(), routed.named_modules()):
            if type(torch_layer) is not torch.nn.Linear:
                continue
            cells = []
            for rows in args.rows:
                x = torch.randn(rows, torch_layer.in_features, dtype=dtype)
                with torch.inference_mode():
                    a = per_call_us(lambda: torch_layer(x), args.repeats)
                    b = per_call_us(lambda: vllm_layer(x), args.repeats)
                cells.append(f"{rows} rows {a:6.0f} / {b:6.0f} ({b / a:.2f}x)")
            print(f"  {name:12s} {torch_layer.out_features}x{torch_layer.in_features}: " + "; ".join(cells),
                  flush=True)


if __name__ == "__main__":
    main()
