"""Tree attention kernel on a GPU: correctness in bf16/fp16 against float64, then speed per layer.

Standalone: torch + triton + numpy, no vLLM (the GPU machine has none); it imports only
``vllm_treespec.attn.triton_tree`` from this checkout. Timings per shape, at equal tokens per request
(``rows`` query rows over ``context + rows`` keys, Llama-3-8B heads: 32 query / 8 KV heads, head_dim 128):

- tree:  the Triton kernel over the paged cache with random trees (ancestor bitmasks), launched as an engine does
         (``plan_for_step``: tiles and launch configuration by the widest tree, the context split over as many
         programs as ``choose_num_splits`` picks for the GPU), again with the launch configuration it did not pick
         (default or wide), and again with one split (no split-KV);
- chain: the same kernel with chain masks (row j sees rows 0..j);
- sdpa:  torch ``scaled_dot_product_attention``, causal aligned bottom-right, over a contiguous (not paged) KV of
         the same bytes: what FlashAttention costs for a chain of the same length.

Also the host cost of building one step's kernel plan (numpy + one host-to-device copy). Goal (issue 21): tree <= 1.2x
sdpa at 1 and 8 requests, 4k context.

    python scripts/bench_gpu_tree_attention.py                    # GPU: full sweep, markdown table on stdout
    TRITON_INTERPRET=1 python scripts/bench_gpu_tree_attention.py --smoke   # CPU: tiny shapes, checks the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Checked after dtype rounding of the inputs: fp32 softmax, P rounded to the input dtype for the second product.
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def random_tree_mask(rng: np.random.Generator, num_rows: int, chain: bool) -> np.ndarray:
    """``[W, W]`` ancestor-or-self mask of a random tree (or a chain) with ``num_rows - 1`` nodes under the root."""
    mask = np.zeros((num_rows, num_rows), np.bool_)
    mask[0, 0] = True
    for row in range(1, num_rows):
        parent = row - 1 if chain else int(rng.integers(0, row))
        mask[row] = mask[parent]
        mask[row, row] = True
    return mask


def make_batch(rng: np.random.Generator, num_reqs: int, context: int, rows: int, chain: bool) -> SimpleNamespace:
    """The fields of a ``TreeBatch`` the kernel plan reads; request r is batch row r, its rows packed back to back."""
    return SimpleNamespace(
        rows=np.arange(num_reqs), query_start=np.arange(num_reqs) * rows, context_len=np.full(num_reqs, context),
        node_offsets=np.arange(num_reqs + 1) * (rows - 1),
        mask=np.stack([random_tree_mask(rng, rows, chain) for _ in range(num_reqs)]))


def paged_kv(num_reqs: int, seq_len: int, kv_heads: int, head_dim: int, block_size: int, dtype, device,
             shuffle: bool, generator: torch.Generator):
    """Per-request contiguous K/V ``[R, S, Hkv, D]`` and their paged views ``[R * nb, block_size, Hkv, D]`` (same
    memory) with a block table; ``shuffle`` permutes the blocks (and copies) to exercise arbitrary tables."""
    blocks = -(-seq_len // block_size)
    shape = (num_reqs, blocks * block_size, kv_heads, head_dim)
    keys = torch.randn(shape, generator=generator, device=device).to(dtype)
    values = torch.randn(shape, generator=generator, device=device).to(dtype)
    table = torch.arange(num_reqs * blocks, device=device, dtype=torch.int32).view(num_reqs, blocks)
    key_cache = keys.view(num_reqs * blocks, block_size, kv_heads, head_dim)
    value_cache = values.view(num_reqs * blocks, block_size, kv_heads, head_dim)
    if shuffle:
        # randperm draws on the host: a CUDA generator cannot drive it
        host = torch.Generator().manual_seed(generator.initial_seed())
        order = torch.randperm(num_reqs * blocks, generator=host).to(device)
        key_cache, value_cache = torch.empty_like(key_cache), torch.empty_like(value_cache)
        key_cache[order.long()] = keys.view_as(key_cache)
        value_cache[order.long()] = values.view_as(value_cache)
        table = order.to(torch.int32).view(num_reqs, blocks)
    return keys, values, key_cache, value_cache, table


def dense_reference(query, keys, values, batch, scale) -> torch.Tensor:
    """float64 tree attention: query ``[R * W, Hq, D]``, keys/values ``[R, S, Hkv, D]``."""
    num_reqs, rows = batch.mask.shape[:2]
    context = int(batch.context_len[0])
    heads = query.shape[1]
    group = heads // keys.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64, device=query.device)
    for r in range(num_reqs):
        visible = torch.ones(rows, context + rows, dtype=torch.bool, device=query.device)
        visible[:, context:] = torch.from_numpy(batch.mask[r]).to(query.device)
        q = query[r * rows:(r + 1) * rows].double().transpose(0, 1)  # [Hq, W, D]
        k = keys[r, : context + rows].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
        v = values[r, : context + rows].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
        out[r * rows:(r + 1) * rows] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def timed_us(fn, device, iters: int) -> float:
    """Median µs per call."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e6)
    return statistics.median(samples)


def check_correctness(tt, device, shapes, heads, kv_heads, head_dim, block_size) -> bool:
    ok = True
    print("| dtype | requests | context | rows | max abs error vs float64 | tolerance |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.bfloat16, torch.float16):
        for num_reqs, context, rows in shapes:
            rng, generator = np.random.default_rng(0), torch.Generator(device=device).manual_seed(0)
            batch = make_batch(rng, num_reqs, context, rows, chain=False)
            keys, values, key_cache, value_cache, table = paged_kv(num_reqs, context + rows, kv_heads, head_dim,
                                                                  block_size, dtype, device, True, generator)
            query = torch.randn(num_reqs * rows, heads, head_dim, generator=generator, device=device).to(dtype)
            plan = tt.plan_for_step(batch, heads // kv_heads, device)
            scale = head_dim ** -0.5
            out, _ = tt.tree_attention(query, key_cache, value_cache, table, plan, scale)
            error = (out.double() - dense_reference(query, keys, values, batch, scale)).abs().max().item()
            ok &= error <= TOLERANCE[dtype]
            print(f"| {str(dtype).split('.')[-1]} | {num_reqs} | {context} | {rows} | {error:.2e} | "
                  f"{TOLERANCE[dtype]:.0e} |")
    return ok


def sdpa_chain(query_bhwd, keys, values, rows):
    """SDPA over a chain: causal aligned bottom-right. On CUDA it must be FlashAttention (torch's lower-right causal
    otherwise falls back to slower kernels); returns (call, backend label)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    # [R, S, Hkv, D] -> [R, Hkv, S, D] views of the same memory as the paged cache.
    k, v = keys.transpose(1, 2), values.transpose(1, 2)
    bias = causal_lower_right(rows, k.shape[2])

    def call():
        return torch.nn.functional.scaled_dot_product_attention(query_bhwd, k, v, attn_mask=bias, enable_gqa=True)

    if query_bhwd.device.type != "cuda":
        return call, "default"

    def flash_only():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return call()

    try:
        flash_only()
        return flash_only, "flash"
    except RuntimeError:
        return call, "not flash"


def sweep(tt, device, requests, contexts, row_counts, heads, kv_heads, head_dim, block_size, dtype, iters) -> None:
    print(f"\n{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU (interpreter)'}, {dtype}, "
          f"{heads} query / {kv_heads} KV heads, head_dim {head_dim}, block {block_size}; µs per layer (median)")
    print("| requests | context | rows | splits | launch (tile_m/block_n/warps/stages) | tree µs | tree, other "
          "launch µs | tree, 1 split µs | chain-mask µs | sdpa causal µs | sdpa kernel | tree / sdpa | plan build µs "
          "(host) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    scale = head_dim ** -0.5
    for num_reqs in requests:
        for context in contexts:
            for rows in row_counts:
                rng, generator = np.random.default_rng(1), torch.Generator(device=device).manual_seed(1)
                seq_len = context + rows
                keys, values, key_cache, value_cache, table = paged_kv(num_reqs, seq_len, kv_heads, head_dim,
                                                                      block_size, dtype, device, False, generator)
                keys, values = keys[:, :seq_len], values[:, :seq_len]
                query = torch.randn(num_reqs * rows, heads, head_dim, generator=generator, device=device).to(dtype)
                group = heads // kv_heads
                timings = []
                # tree (as an engine launches it), tree with the launch configuration not chosen (default or wide),
                # tree unsplit, chain masks
                for chain, splits, other_launch in ((False, None, False), (False, None, True), (False, 1, False),
                                                    (True, None, False)):
                    batch = make_batch(rng, num_reqs, context, rows, chain)
                    plan = tt.plan_for_step(batch, group, device)
                    if other_launch:
                        other = tt.WIDE_TREE_LAUNCH if plan.launch == tt.DEFAULT_LAUNCH else tt.DEFAULT_LAUNCH
                        plan = tt.plan_for_launch(batch, group, other, device)
                    output = torch.empty_like(query)
                    timings.append(timed_us(lambda: tt.tree_attention(query, key_cache, value_cache, table, plan,
                                                                      scale, output=output, num_splits=splits),
                                            device, iters))
                chosen = tt.choose_num_splits(plan.tile_request.shape[0] * kv_heads, context,
                                              torch.cuda.get_device_properties(device).multi_processor_count
                                              ) if device.type == "cuda" else 1
                query_bhwd = query.view(num_reqs, rows, heads, head_dim).transpose(1, 2)
                sdpa_call, sdpa_label = sdpa_chain(query_bhwd, keys, values, rows)
                timings.append(timed_us(sdpa_call, device, iters))
                batch = make_batch(rng, num_reqs, context, rows, False)
                plan_us = timed_us(lambda: tt.plan_for_step(batch, group, device), torch.device("cpu"), iters)
                launch_label = "/".join(map(str, plan.launch))
                print(f"| {num_reqs} | {context} | {rows} | {chosen} | {launch_label} | {timings[0]:.1f} | "
                      f"{timings[1]:.1f} | {timings[2]:.1f} | {timings[3]:.1f} | {timings[4]:.1f} | {sdpa_label} | "
                      f"{timings[0] / timings[4]:.2f} | {plan_us:.1f} |")
                del keys, values, key_cache, value_cache
                if device.type == "cuda":
                    torch.cuda.empty_cache()


#: --tune: shapes (requests, context, rows) and the launch configurations tried on each
TUNE_SHAPES = ((1, 4096, 16), (1, 32768, 64), (8, 4096, 16), (8, 32768, 64), (32, 512, 16), (32, 4096, 64))
TUNE_TILE_M = (32, 64, 128)
TUNE_BLOCK_N = (32, 64, 128)
TUNE_WARPS = (4, 8)
TUNE_STAGES = (2, 3)


def tune_inputs(tt, device, shape, heads, kv_heads, head_dim, block_size, dtype):
    """One tuning shape's paged cache, queries and tree batch (seeded: every process builds the same)."""
    num_reqs, context, rows = shape
    rng, generator = np.random.default_rng(2), torch.Generator(device=device).manual_seed(2)
    _, _, key_cache, value_cache, table = paged_kv(num_reqs, context + rows, kv_heads, head_dim, block_size, dtype,
                                                   device, False, generator)
    query = torch.randn(num_reqs * rows, heads, head_dim, generator=generator, device=device).to(dtype)
    return SimpleNamespace(key_cache=key_cache, value_cache=value_cache, table=table, query=query,
                           batch=make_batch(rng, num_reqs, context, rows, False), output=torch.empty_like(query))


def launch(tt, inputs, config, heads, kv_heads, head_dim, device):
    """The kernel on one shape's inputs with one launch configuration (tile rows, keys per step, warps, stages)."""
    plan = tt.plan_for_launch(inputs.batch, heads // kv_heads, tt.LaunchConfig(*config), device)
    return lambda: tt.tree_attention(inputs.query, inputs.key_cache, inputs.value_cache, inputs.table, plan,
                                     head_dim ** -0.5, output=inputs.output)


def compile_configs(configs, shapes, heads, kv_heads, head_dim, block_size, dtype_name) -> None:
    """Run each configuration once on each shape, so that Triton's on-disk cache holds every compiled kernel; run
    in worker processes (compiling is CPU-bound and holds the interpreter) before the timed pass."""
    from vllm_treespec.attn import triton_tree as tt

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for shape in shapes:
        inputs = tune_inputs(tt, device, shape, heads, kv_heads, head_dim, block_size, getattr(torch, dtype_name))
        for config in configs:
            try:
                launch(tt, inputs, config, heads, kv_heads, head_dim, device)()
            except Exception:  # noqa: BLE001 - the timed pass reports a configuration that does not fit
                pass


def tune(tt, device, heads, kv_heads, head_dim, block_size, dtype, iters, jobs: int = 1) -> None:
    """Every launch configuration on :data:`TUNE_SHAPES`, µs per layer, with each shape's best marked, and the
    configurations ranked by their geometric mean over the shapes relative to each shape's best. With ``jobs`` > 1
    the kernels are compiled first by that many processes (one process compiled 36 configurations of four shapes in
    ~4.5 minutes on the H200's host)."""
    import itertools
    import math

    configs = list(itertools.product(TUNE_TILE_M, TUNE_BLOCK_N, TUNE_WARPS, TUNE_STAGES))
    if jobs > 1:
        import multiprocessing

        started = time.perf_counter()
        chunks = [configs[i::jobs] for i in range(jobs)]
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            pool.starmap(compile_configs, [(chunk, TUNE_SHAPES, heads, kv_heads, head_dim, block_size,
                                            str(dtype).removeprefix("torch.")) for chunk in chunks if chunk])
        print(f"compiled {len(configs)} configurations x {len(TUNE_SHAPES)} shapes in {jobs} processes: "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    global DEFAULTS
    DEFAULTS = tuple(tt.DEFAULT_LAUNCH)
    times: dict[tuple, list[float]] = {c: [] for c in configs}
    for num_reqs, context, rows in TUNE_SHAPES:
        inputs = tune_inputs(tt, device, (num_reqs, context, rows), heads, kv_heads, head_dim, block_size, dtype)
        for config in configs:
            try:
                us = timed_us(launch(tt, inputs, config, heads, kv_heads, head_dim, device), device, iters)
            except Exception as e:  # noqa: BLE001 - a configuration that does not fit (shared memory) is skipped
                tile_m, block_n, warps, stages = config
                print(f"skipped tile_m={tile_m} block_n={block_n} warps={warps} stages={stages}: "
                      f"{type(e).__name__}")
                us = math.inf
            times[config].append(us)
        # per shape as it finishes (a run cut short keeps these)
        fastest = sorted(configs, key=lambda c: times[c][-1])[:5]
        print(f"{num_reqs}x{context}x{rows}: defaults {DEFAULTS} {times[DEFAULTS][-1]:.1f} µs; fastest (tile_m, "
              f"block_n, warps, stages): " + ", ".join(f"{c} {times[c][-1]:.1f}" for c in fastest), flush=True)
        del inputs
        torch.cuda.empty_cache()
    best = [min(times[c][i] for c in configs) for i in range(len(TUNE_SHAPES))]
    ranked = sorted(configs, key=lambda c: sum(math.log(t / b) for t, b in zip(times[c], best)))
    print(f"\n{torch.cuda.get_device_name()}, {dtype}, {heads} query / {kv_heads} KV heads, head_dim {head_dim}: "
          "µs per layer (median), configurations best first by geometric mean over the shapes of time / the "
          "shape's best")
    print("| tile_m | block_n | warps | stages | " + " | ".join(f"{r}x{c}x{w}" for r, c, w in TUNE_SHAPES)
          + " | geo. mean / best |")
    print("|---|---|---|---|" + "---|" * (len(TUNE_SHAPES) + 1))
    for c in ranked:
        mean = math.exp(sum(math.log(t / b) for t, b in zip(times[c], best)) / len(best))
        print(f"| {' | '.join(map(str, c))} | " + " | ".join(f"{t:.1f}" for t in times[c]) + f" | {mean:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--requests", default="1,8,32,128")
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--rows", default="4,16,32,64", help="tree rows per request (root + nodes)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tune", action="store_true", help="time the kernel's launch configurations instead "
                        "(tile rows, keys per step, warps, pipeline stages) on a fixed set of shapes")
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1),
                        help="--tune: processes that compile the configurations before they are timed")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run with TRITON_INTERPRET=1 (set before triton is imported) and --smoke")
    from vllm_treespec.attn import triton_tree as tt  # after the device check: triton reads TRITON_INTERPRET on import

    if "vllm" in sys.modules:
        sys.exit("vllm was imported: this benchmark must run without it")
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    if args.smoke:
        heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
        correctness_shapes = [(2, 40, 9)]
        requests, contexts, row_counts, iters = [1, 2], [32], [4, 8], 2
    else:
        heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
        correctness_shapes = [(3, 100, 17), (2, 600, 64), (1, 4096, 33), (1, 32768, 17)]
        requests, contexts, row_counts, iters = ints(args.requests), ints(args.contexts), ints(args.rows), args.iters
    if args.tune:
        if device.type != "cuda":
            sys.exit("--tune needs a GPU")
        tune(tt, device, heads, kv_heads, head_dim, block_size, getattr(torch, args.dtype), args.iters, args.jobs)
        return
    ok = check_correctness(tt, device, correctness_shapes, heads, kv_heads, head_dim, block_size)
    sweep(tt, device, requests, contexts, row_counts, heads, kv_heads, head_dim, block_size,
          getattr(torch, args.dtype), iters)
    if not ok:
        sys.exit("correctness check failed")


if __name__ == "__main__":
    main()
