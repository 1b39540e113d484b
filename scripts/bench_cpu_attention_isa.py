"""vLLM's CPU decode attention in its AMX layout against its VEC layout, one thread, on an AMX host in bf16.

A tree engine on an AMX host runs vLLM's VEC attention kernel instead of its AMX one for every step, plain steps
too: vLLM's AMX build packs K/V into tile layout, which the tree rows cannot read
(:func:`vllm_treespec.attn.layout.readable_isa`). This times vLLM's own kernel
(``cpu_attention_with_kv_cache``) both ways on decode rows (one query row per request), per layer, with SmolLM2-135M's
heads (9 query heads, 3 KV heads, 64 dims), 128-token blocks, median of ``--repeats`` calls after 20 warm-up calls.

``--layout``: also writes known ids into one block through vLLM's cache-write op in AMX layout and prints where the
first positions of K and V land (position, dimension): the packing a tree-row kernel would have to read.

    .venv/bin/python scripts/bench_cpu_attention_isa.py [--requests 1 8 16] [--contexts 400 1000] [--repeats 200]
        [--layout]
"""

from __future__ import annotations

import argparse
import sys

from vllm_treespec.cost.measure import time_callable

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 128, 30


def time_decode(ops, torch, isa: str, reqs: int, context: int, repeats: int) -> float:
    """Median seconds of one layer's decode attention for ``reqs`` requests of ``context`` positions."""
    blocks_per_req = -(-context // BLOCK_SIZE)
    num_blocks = reqs * blocks_per_req + 1  # block 0 is vLLM's null block
    kv = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM).to(torch.bfloat16)
    key_cache, value_cache = kv.view(num_blocks, NUM_KV_HEADS, 2 * BLOCK_SIZE, HEAD_DIM).chunk(2, dim=2)
    query = torch.randn(reqs, NUM_HEADS, HEAD_DIM).to(torch.bfloat16)
    output = torch.empty_like(query)
    query_start = torch.arange(reqs + 1, dtype=torch.int32)
    seq_lens = torch.full((reqs,), context, dtype=torch.int32)
    block_table = (torch.arange(reqs * blocks_per_req, dtype=torch.int32) + 1).view(reqs, blocks_per_req)
    metadata = ops.cpu_attn_get_scheduler_metadata(reqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, seq_lens, torch.bfloat16,
                                                   query_start, True, -1, isa, False)

    def call() -> None:
        ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, output, query_start, seq_lens,
                                        HEAD_DIM ** -0.5, True, None, -1, block_table, 0.0, metadata, None)

    return time_callable(call, repeats, warmup=20)


def print_layout(ops, torch) -> None:
    """Where vLLM's AMX cache write puts the first positions of K and V of one block and head."""
    num_ids = BLOCK_SIZE * HEAD_DIM
    kv = torch.zeros(1, 1, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)
    key_cache, value_cache = kv.view(1, 1, 2 * BLOCK_SIZE, HEAD_DIM).chunk(2, dim=2)
    ids = torch.arange(num_ids, dtype=torch.int32).view(BLOCK_SIZE, 1, HEAD_DIM)
    as_bf16 = (ids % 32768).to(torch.int16).view(torch.bfloat16)  # each id travels as a bf16 bit pattern
    ops.cpu_attn_reshape_and_cache(as_bf16, as_bf16, key_cache, value_cache,
                                   torch.arange(BLOCK_SIZE, dtype=torch.int64), "amx", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    raw = kv.view(torch.int16).to(torch.int32).view(2 * BLOCK_SIZE, HEAD_DIM)
    for name, part in (("K", raw[:BLOCK_SIZE]), ("V", raw[BLOCK_SIZE:])):
        first = [(int(i) // HEAD_DIM, int(i) % HEAD_DIM) for i in part.reshape(-1)[:36]]
        print(f"{name} layout, (position, dimension) of the first 36 elements: {first}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[400, 1000])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--layout", action="store_true")
    args = parser.parse_args(argv)
    import torch
    import vllm._custom_ops as ops

    torch.set_num_threads(1)  # as vLLM's CPU worker here
    if not torch.cpu._is_amx_tile_supported():
        print("this CPU has no AMX tiles: vLLM takes the VEC layout here anyway", file=sys.stderr)
        return 1
    # the AMX kernel needs the process's AMX tile state, which this asks the kernel for (vLLM's worker has it from
    # oneDNN; without it: illegal instruction)
    torch._C._cpu._init_amx()
    for context in args.contexts:
        for reqs in args.requests:
            amx, vec = (time_decode(ops, torch, isa, reqs, context, args.repeats) for isa in ("amx", "vec"))
            print(f"{reqs:3d} requests x {context:5d} positions: AMX {amx * 1e3:.3f} ms, VEC {vec * 1e3:.3f} ms a "
                  f"layer (x{LAYERS} layers: {LAYERS * amx * 1e3:.1f} / {LAYERS * vec * 1e3:.1f} ms, "
                  f"VEC/AMX {vec / amx:.2f})")
    if args.layout:
        print_layout(ops, torch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
