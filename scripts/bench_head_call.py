"""One drafting call of the shipped EAGLE head, as ``eagle_tree`` and graft make it for one request: ``ingest`` of the
step's committed row, then ``draft`` of a tree, on one thread (as vLLM's CPU worker here), after a context of
``--context`` rows. Random target hidden states and embeddings: the head's speed does not depend on what it reads,
and no model is loaded. Prints the median milliseconds of each part per dtype, and with ``--split`` each linear
layer's share.

    .venv/bin/python scripts/bench_head_call.py [--dtypes bfloat16 float32] [--budget 16] [--context 600]
    .venv/bin/python scripts/bench_head_call.py --split --max-depth 3
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np
import torch

from vllm_treespec.api import ProposeContext
from vllm_treespec.eagle.drafter import EagleDrafter
from vllm_treespec.proposers.eagle_tree import default_head_path

TARGET_LAYERS = 30  # SmolLM2-135M: the shipped head reads its layers 2, 15 and 27
VOCAB, HIDDEN = 49152, 576


def time_calls(dtype: str, budget: int, context: int, calls: int, max_depth: int | None, split: bool) -> None:
    rng = np.random.default_rng(0)
    total = context + calls + 64
    seq = rng.integers(0, VOCAB, size=total + 1)
    aux = torch.randn(total, 3, HIDDEN).to(getattr(torch, dtype))
    tokens = np.zeros((1, total + 1), np.int64)
    tokens[0] = seq

    def step(start: int, stop: int) -> ProposeContext:
        return ProposeContext(req_ids=["r"], sampled_token_ids=[[int(seq[stop])]], num_tokens=np.array([stop + 1]),
                              token_ids=tokens, max_nodes=budget,
                              aux_hidden_states=[aux[start:stop, j] for j in range(3)],
                              hidden_row_index=np.array([stop - start - 1]), hidden_row_start=np.array([0]),
                              hidden_position_start=np.array([start]))

    drafter = EagleDrafter(str(default_head_path()), num_target_layers=TARGET_LAYERS, depth=6, top_k=8, dtype=dtype)
    drafter.load(torch.randn(VOCAB, HIDDEN))
    drafter.ingest(step(0, context))
    layer_seconds: dict[tuple[int, int], float] = collections.defaultdict(float)
    if split:
        for layer in drafter.head.modules():
            if isinstance(layer, torch.nn.Linear):
                inner = layer.forward

                def timed(x, inner=inner, key=(layer.in_features, layer.out_features)):
                    started = time.perf_counter()
                    out = inner(x)
                    layer_seconds[key] += time.perf_counter() - started
                    return out

                layer.forward = timed
    ingest, draft, nodes = [], [], []
    for position in range(context, context + calls + 10):
        ctx = step(position, position + 1)
        started = time.perf_counter()
        drafter.ingest(ctx)
        ingested = time.perf_counter()
        tree = drafter.draft(ctx, [0], budget, max_depth=max_depth)[0]
        if position >= context + 10:  # the first calls build kernels
            ingest.append(ingested - started)
            draft.append(time.perf_counter() - ingested)
            nodes.append(tree.num_nodes)
        elif position == context + 9:
            layer_seconds.clear()
    print(f"{dtype} (head computes in {drafter.compute}), budget {budget}, context {context}: ingest "
          f"{statistics.median(ingest) * 1e3:.2f} ms, draft {statistics.median(draft) * 1e3:.2f} ms, "
          f"{statistics.median(nodes):.0f} nodes")
    for (fan_in, fan_out), seconds in sorted(layer_seconds.items(), key=lambda kv: -kv[1]):
        print(f"  linear {fan_in:>5} -> {fan_out:<5} {seconds / calls * 1e3:.2f} ms a call")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--max-depth", type=int, default=None)
    parser.add_argument("--split", action="store_true", help="time each linear layer too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for dtype in args.dtypes:
        time_calls(dtype, args.budget, args.context, args.calls, args.max_depth, args.split)


if __name__ == "__main__":
    main()
