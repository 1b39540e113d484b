"""Benchmark the retrieval store against vLLM's n-gram kernel and ArcticInference's SuffixDecodingCache, side by side.

For each context length it measures, on the same real token stream (Python stdlib sources, tokenised with
``--tokenizer`` or a word-level fallback):

- append throughput: indexing the stream in decode-sized chunks (ours: per-request suffix automaton; Arctic:
  ``add_active_response``);
- speculate latency p50/p99 at ``--queries`` positions near the end of the stream, for a ``--budget``-node tree (ours:
  ``SuffixRetriever.retrieve`` with the new token already indexed; Arctic: ``speculate(use_tree_spec=True)``; vLLM:
  ``_find_longest_matched_ngram_and_propose_tokens``, a chain);
- offline replay: mean number of the stream's next tokens each draft covers (the accepted length a perfect verifier
  would give, bonus token excluded).

    python scripts/bench_retrieval.py [--tokenizer PATH] [--sizes 1000 10000 100000] [--arctic-path DIR]

Arctic is optional (``--arctic-path`` is prepended to sys.path; it is skipped when not importable), and so is vLLM.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import sysconfig
import time

import numpy as np

from vllm_treespec.retrieval import SuffixAutomaton, SuffixRetriever


def token_stream(tokenizer: str | None, limit: int) -> tuple[np.ndarray, str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    text, parts = "", []
    for f in files:
        parts.append(open(f, encoding="utf-8", errors="replace").read())
        if sum(map(len, parts)) > 8 * limit:
            break
    text = "\n".join(parts)
    if tokenizer:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(tokenizer)(text, add_special_tokens=False)["input_ids"]
        return np.array(ids[:limit], np.int32), f"stdlib sources, tokenizer {tokenizer}"
    vocab: dict[str, int] = {}
    words = re.findall(r"\w+|[^\w\s]|\n", text)[:limit]
    return np.array([vocab.setdefault(w, len(vocab)) for w in words], np.int32), "stdlib sources, word-level ids"


def covered(tokens, parents, future) -> int:
    """Length of the longest root path of the tree that equals a prefix of ``future``."""
    best, depth_of = 0, {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        d = 1 if p < 0 else depth_of.get(p, -10**9) + 1
        if 1 <= d <= len(future) and t == future[d - 1]:
            depth_of[i] = d
            best = max(best, d)
    return best


def pct(xs, q):
    return float(np.percentile(np.array(xs) * 1e6, q))


def bench_ours(stream, n, positions, budget, chunk, **kw):
    sam = SuffixAutomaton()
    start = time.perf_counter()
    for i in range(0, n, chunk):
        sam.extend(stream[i:i + chunk])
    append_s = time.perf_counter() - start
    memory = (sam.nbytes / n, sam.nbytes_for(n) / n, sam.num_states / n, sam.num_edges / n)
    r = SuffixRetriever(global_max_tokens=0, max_tokens_per_request=max(n, 2), **kw)
    lat, cov = [], []
    r.retrieve("q", stream[:positions[0] - 1], 0)
    for pos in positions:
        ctx = stream[:pos]
        r.retrieve("q", ctx, 0)  # index the new tokens, untimed
        t = time.perf_counter()
        tree = r.retrieve("q", ctx, budget)
        lat.append(time.perf_counter() - t)
        cov.append(covered(tree.token_ids.tolist(), tree.parents.tolist(), stream[pos:pos + 64].tolist()))
    return n / append_s, lat, cov, memory


def bench_arctic(cache_cls, stream, n, positions, budget, chunk):
    cache = cache_cls(max_tree_depth=64)
    cache.start_request("a", np.zeros(0, np.int32))
    start = time.perf_counter()
    for i in range(0, n, chunk):
        cache.add_active_response("a", stream[i:i + chunk])
    append_s = time.perf_counter() - start
    cache.stop_request("a")
    cache = cache_cls(max_tree_depth=64)
    cache.start_request("q", stream[:positions[0] - 1])
    done = positions[0] - 1
    lat, cov = [], []
    for pos in positions:
        cache.add_active_response("q", stream[done:pos])
        done = pos
        ctx = stream[pos - 64:pos]
        t = time.perf_counter()
        draft = cache.speculate("q", ctx, max_spec_tokens=budget, use_tree_spec=True)
        lat.append(time.perf_counter() - t)
        cov.append(covered(list(draft.token_ids), list(draft.parents), stream[pos:pos + 64].tolist()))
    return n / append_s, lat, cov


def bench_vllm(kernel, stream, positions, budget):
    lat, cov = [], []
    for pos in positions:
        ctx = stream[:pos]
        t = time.perf_counter()
        draft = kernel(ctx, 2, 4, 1 << 30, budget)
        lat.append(time.perf_counter() - t)
        cov.append(covered(draft.tolist(), list(range(-1, len(draft) - 1)), stream[pos:pos + 64].tolist()))
    return lat, cov


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=4, help="tokens per append (decode step)")
    ap.add_argument("--arctic-path", default=None, help="directory holding arctic_inference (e.g. a pip --target)")
    args = ap.parse_args()

    stream, source = token_stream(args.tokenizer, max(args.sizes) + 64)
    if args.arctic_path:
        sys.path.insert(0, args.arctic_path)
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as e:
        print(f"# arctic_inference not importable ({e}); skipped")
        SuffixDecodingCache = None
    try:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_kernel
    except ImportError as e:
        print(f"# vllm n-gram kernel not importable ({e}); skipped")
        vllm_kernel = None

    print(f"# {source}; {len(stream)} tokens; budget {args.budget}; {args.queries} queries; chunk {args.chunk}")
    # warm the JITs (ours and vLLM's) outside the timings
    bench_ours(stream, 2000, list(range(1900, 1950)), args.budget, args.chunk)
    if vllm_kernel is not None:
        bench_vllm(vllm_kernel, stream, [1000], args.budget)
    same = dict(min_prob=0.1, max_spec_factor=1.0)  # Arctic's defaults (min_token_prob 0.1, max_spec_factor 1)
    from vllm_treespec.proposers.suffix_tree import SuffixTreeOptions

    o = SuffixTreeOptions()  # what `"method": "suffix_tree"` runs with
    shipped = dict(max_depth=o.max_depth, min_prob=o.min_token_prob, min_score=o.min_confidence,
                   min_match_len=o.min_match_len, max_spec_factor=o.max_spec_factor, match_window=o.match_window)
    print(f"{'tokens':>7} {'method':<26} {'append Mtok/s':>13} {'p50 us':>8} {'p99 us':>8} {'covered':>8}")
    for n in args.sizes:
        n = min(n, len(stream) - 64)
        positions = np.linspace(max(n // 2, 2), n, args.queries).astype(int).tolist()
        rows = {}
        tput, lat, cov, memory = bench_ours(stream, n, positions, args.budget, args.chunk, **same)
        rows["suffix_tree (Arctic params)"] = (tput, lat, cov)
        _, lat_d, cov_d, _ = bench_ours(stream, n, positions, args.budget, args.chunk, **shipped)
        rows["suffix_tree (defaults)"] = (tput, lat_d, cov_d)
        _, lat2, cov2, _ = bench_ours(stream, n, positions, args.budget, args.chunk, min_prob=0.0)
        rows["suffix_tree (full budget)"] = (tput, lat2, cov2)
        if SuffixDecodingCache is not None:
            rows["arctic SuffixDecoding tree"] = bench_arctic(SuffixDecodingCache, stream, n, positions, args.budget,
                                                              args.chunk)
        if vllm_kernel is not None:
            rows["vllm ngram (KMP chain)"] = (float("nan"), *bench_vllm(vllm_kernel, stream, positions, args.budget))
        for name, (tp, la, co) in rows.items():
            print(f"{n:>7} {name:<26} {tp / 1e6:>13.2f} {pct(la, 50):>8.1f} {pct(la, 99):>8.1f} {np.mean(co):>8.2f}")
        held, tight, states, edges = memory
        print(f"{n:>7} memory: {held:.0f} bytes/token held by the growable automaton (capacity doubling), "
              f"{tight:.0f} at exact capacity; {states:.2f} states and {edges:.2f} edges per token")
        if SuffixDecodingCache is not None:
            ours, arc = rows["suffix_tree (Arctic params)"], rows["arctic SuffixDecoding tree"]
            print(f"{n:>7} ratio ours/Arctic: append x{ours[0] / arc[0]:.2f}, "
                  f"p50 x{pct(arc[1], 50) / pct(ours[1], 50):.2f} faster, "
                  f"p99 x{pct(arc[1], 99) / pct(ours[1], 99):.2f} faster")


if __name__ == "__main__":
    main()
