"""Tree rows vs chain rows on CPU (issue 20): fidelity, kernel time, and engine step time, in one run.

1. Fidelity (no engine): chain-shaped trees through the fast tree path and through the torch path, against vLLM's own
   CPU attention kernel on the same cache (max |diff| and how many outputs differ), fp32 and bf16; and random trees
   against the float64 reference.
2. Kernel (no engine): one layer's tree rows through the fast path vs the same rows as chains through vLLM's kernel
   (SmolLM2-135M's heads), median of alternating repeats.
   ``--gemm-rows``: whether a row's output of each of the model's linear shapes, through vLLM's CPU GEMM dispatch,
   depends on how many rows share the GEMM (a decode step computes one row; a verify step 1 + k).
3. Engine: the embedded SmolLM2-135M, one engine per dtype with ``num_speculative_tokens`` = the largest k; each step
   drafts k nodes per request, as a random tree (verified by vllm_treespec) or as a k-token chain (verified by vLLM's
   own path), switched between runs by RPC. Draft tokens are rare vocabulary ids that greedy decoding never accepts,
   so both modes commit one token per request per step and see the same contexts. Step time = wall time between the
   engine's outputs once every request has its first token (prefill steps excluded); runs alternate
   tree/chain/chain/tree. Tree attention = time in the tree rows (``attn.cpu.stats``) per step.

4. ``--identical`` (long; off by default): bf16, batch 1, greedy: how many outputs of vLLM's ``ngram`` and of the tree
   methods (fast path, and with ``VLLM_TREESPEC_CPU_TREE_PATH=torch`` the torch path) are token-identical to bf16
   without speculation, on MT-Bench + HumanEval + ShareGPT prompts (ShareGPT from position 700 of the benchmark
   shuffle, those that fit 1024 tokens with their output: no default was chosen on them, the head never trained on
   them). ``--identical-probes K``: also runs whose every step verifies K drafts the target never accepts (each
   commits one token from a K+1-row step), as vLLM's chain and as our tree: a chain's count shows what the step's
   shape alone does to bf16 outputs, the tree's what our tree rows add.

    .venv/bin/python scripts/bench_tree_rows.py [--dtypes float32 bfloat16] [--batches 1 8] [--nodes 4 8 16 32]
        [--steps 24] [--repeats 2] [--skip-engine] [--skip-kernel] [--skip-fidelity] [--gemm-rows]
        [--identical [--identical-methods suffix_tree graft] [--mt-bench 80] [--humaneval 40] [--sharegpt 0]
                     [--max-tokens 128] [--identical-paths fast torch] [--identical-probes 8 32]]

Goals (issue 20): tree step <= 1.05 x chain step for every k, batch and dtype; tree attention <= 5% of the worker at
16 nodes, fp32; bf16 identical-output counts of the tree methods within 5% of ngram's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))
sys.path.insert(0, HERE)

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 128  # SmolLM2-135M's attention geometry and vLLM's CPU block size
_DRAFT = {"mode": "tree", "k": 4}  # set in the worker by set_draft()


# --- worker side (imported by dotted path in vLLM's worker process) ------------------------------------------------
class SwitchProposer(TreeProposer):
    """k draft nodes per request per step, as a random tree or as a chain (``_DRAFT``); tokens never accepted."""

    def __init__(self, vllm_config=None, options=None) -> None:
        super().__init__(vllm_config, options)
        self.rng = np.random.default_rng(0)
        vocab = vllm_config.model_config.get_vocab_size() if vllm_config is not None else 49152
        self.rare = np.arange(vocab - 8000, vocab - 16)
        self.shapes: dict[int, list[np.ndarray]] = {}
        self.drawn = 0

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        k = _DRAFT["k"]
        trees = []
        for i in range(ctx.num_reqs):
            if not ctx.needs_draft(i):
                trees.append(None)
                continue
            tokens = self.rng.choice(self.rare, size=k)
            if _DRAFT["mode"] == "chain":
                trees.append(DraftTree.chain(tokens))
            else:  # a shape drawn in advance: drawing it here would count the bench's own work in tree steps only
                trees.append(DraftTree(tokens, self._shape(k)))
        return trees

    def _shape(self, k: int) -> np.ndarray:
        """Parents of a random breadth-first tree with k nodes that is not a chain (one of 64 drawn per k)."""
        if k not in self.shapes:
            shapes = []
            while len(shapes) < 64:
                parents = np.array([-1] + [int(self.rng.integers(-1, j)) for j in range(1, k)], np.int32)
                tree = DraftTree(np.zeros(k, np.int64), parents)
                if not tree.is_chain():
                    shapes.append(tree.breadth_first().parents)
            self.shapes[k] = shapes
        self.drawn += 1
        return self.shapes[k][self.drawn % 64]


def set_draft(worker, mode: str, k: int) -> None:
    _DRAFT["mode"] = mode
    _DRAFT["k"] = k


def worker_pid(worker) -> int:
    return os.getpid()


def attention_stats(worker) -> dict:
    from vllm_treespec.attn import cpu
    from vllm_treespec.verify import verifier_report

    stats = dict(cpu.stats)
    stats["verifier_seconds"] = sum(verifier_report(worker).get("seconds", {}).values())
    return stats


# --- 1. fidelity ----------------------------------------------------------------------------------------------------
def fidelity() -> None:
    import torch
    from vllm import _custom_ops as ops

    from vllm_treespec.attn import cpu_fast, cpu_kernel, layout
    from vllm_treespec.attn.cpu import tree_attention_cpu
    from vllm_treespec.attn.plan import build_plan
    from vllm_treespec.attn.reference import reference_tree_attention
    from vllm_treespec.tree import TreeBatch

    print(f"== fidelity: chains through the tree paths vs vLLM's kernel (torch threads: {torch.get_num_threads()}; "
          f"expected build profile avx512={cpu_fast.expected_profile()[0]} rne={cpu_fast.expected_profile()[1]})")
    rng = np.random.default_rng(0)
    for dtype in (torch.float32, torch.bfloat16):
        elem = torch.tensor([], dtype=dtype).element_size()
        tile = cpu_kernel.kv_tile_length(17, HQ // HKV, D, elem, "vec")
        widths = [5, 9, 17, 33, 17]
        contexts = [40, 300, 600, 250, tile + 100]
        lengths = [c + w for c, w in zip(contexts, widths)]
        blocks = [-(-n // BS) for n in lengths]
        cache = torch.zeros(sum(blocks) + 1, HKV, BS, 2 * D, dtype=dtype)
        table = torch.zeros(len(widths), max(blocks), dtype=torch.int32)
        order = torch.randperm(sum(blocks)) + 1
        raws, used = [], 0
        for r, n in enumerate(lengths):
            table[r, :blocks[r]] = order[used:used + blocks[r]].to(torch.int32)
            used += blocks[r]
            pos = torch.arange(n)
            k, v = torch.randn(n, HKV, D).to(dtype), torch.randn(n, HKV, D).to(dtype)
            layout.write_slots(cache, table[r, pos // BS].long() * BS + pos % BS, k, v, "vec")
            raws.append((k, v))
        qkv = (2 * torch.randn(sum(widths), HQ + 2 * HKV, D)).to(dtype)
        query = qkv[:, :HQ]
        starts = np.concatenate([[0], np.cumsum(widths)])
        scale = D ** -0.5
        qsl = torch.tensor(starts, dtype=torch.int32)
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        md = ops.cpu_attn_get_scheduler_metadata(num_reqs=len(widths), num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                 seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl, causal=True,
                                                 sliding_window_size=-1, isa="vec", enable_kv_split=True)
        kc, vc = cache.view(cache.shape[0], HKV, 2 * BS, D).chunk(2, dim=2)
        kernel = torch.empty(sum(widths), HQ * D, dtype=dtype)
        ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=kernel, query_start_loc=qsl,
                                        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
                                        sliding_window=-1, block_table=table, softcap=0.0, scheduler_metadata=md,
                                        s_aux=None)
        chains = [DraftTree.chain(list(range(1, w))) for w in widths]
        batch = TreeBatch.build(np.arange(len(widths)), [str(i) for i in range(len(widths))], chains, starts[:-1],
                                np.array(contexts))
        plan = build_plan(batch, table, BS)
        fast = cpu_fast.decide("vec", dtype, BS, D, HKV, HQ)
        fast_out = torch.full_like(kernel, float("nan"))
        cpu_fast.attend(plan, query, cache, fast_out, scale, HQ, D, "vec", fast)
        torch_out = torch.full_like(kernel, float("nan"))
        tree_attention_cpu(plan, query, cache, torch_out, scale, HQ, D)
        for name, out in (("fast path", fast_out), ("torch path", torch_out)):
            diff = (out.float() - kernel.float()).abs()
            print(f"  {str(dtype):15s} {name:10s}: max |diff| {diff.max().item():.3g}, "
                  f"{int((out != kernel).sum())} of {out.numel()} outputs differ")
        # Random trees vs float64 (same contexts, same cache).
        worst = 0.0
        trees = [DraftTree(np.arange(1, w), np.array([-1] + [int(rng.integers(-1, j)) for j in range(1, w - 1)]))
                 for w in widths]
        batch = TreeBatch.build(np.arange(len(widths)), [str(i) for i in range(len(widths))], trees, starts[:-1],
                                np.array(contexts))
        out = torch.full_like(kernel, float("nan"))
        cpu_fast.attend(build_plan(batch, table, BS), query, cache, out, scale, HQ, D, "vec", fast)
        for r, (c, t) in enumerate(zip(contexts, trees)):
            k, v = raws[r]
            ref = reference_tree_attention(query[starts[r]:starts[r + 1]], k[:c], v[:c], k[c:], v[c:], t.parents,
                                           scale)
            got = out[starts[r]:starts[r + 1]].view(-1, HQ, D).double()
            worst = max(worst, float((got - ref).abs().max()))
        print(f"  {str(dtype):15s} fast path on random trees vs float64: max |diff| {worst:.3g}")


# --- 2. kernel time -------------------------------------------------------------------------------------------------
def kernel_times(nodes: list[int], batches: list[int], dtypes: list[str], context: int = 400) -> None:
    import torch
    from vllm import _custom_ops as ops

    from vllm_treespec.attn import cpu_fast, layout
    from vllm_treespec.attn.plan import build_plan
    from vllm_treespec.tree import TreeBatch

    print(f"== kernel: one layer, {HQ} query / {HKV} KV heads x {D}, contexts ~{context}; tree rows through the fast "
          f"path vs the same rows as chains through vLLM's kernel (us, median of alternating repeats)")
    rng = np.random.default_rng(1)
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        fast = cpu_fast.decide("vec", dtype, BS, D, HKV, HQ)
        for b in batches:
            for k in nodes:
                w = k + 1
                contexts = [context + 17 * i for i in range(b)]
                lengths = [c + w for c in contexts]
                blocks = [-(-n // BS) for n in lengths]
                cache = torch.randn(sum(blocks) + 1, HKV, BS, 2 * D).to(dtype)
                table = torch.zeros(b, max(blocks), dtype=torch.int32)
                order = torch.randperm(sum(blocks)) + 1
                used = 0
                for r in range(b):
                    table[r, :blocks[r]] = order[used:used + blocks[r]].to(torch.int32)
                    used += blocks[r]
                query = (torch.randn(b * w, HQ + 2 * HKV, D)).to(dtype)[:, :HQ]
                qsl = torch.arange(b + 1, dtype=torch.int32) * w
                seq_lens = torch.tensor(lengths, dtype=torch.int32)
                md = ops.cpu_attn_get_scheduler_metadata(num_reqs=b, num_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                                         seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl,
                                                         causal=True, sliding_window_size=-1, isa="vec",
                                                         enable_kv_split=True)
                kc, vc = cache.view(cache.shape[0], HKV, 2 * BS, D).chunk(2, dim=2)
                out = torch.empty(b * w, HQ * D, dtype=dtype)
                trees = []
                for _ in range(b):
                    parents = np.array([-1] + [int(rng.integers(-1, j)) for j in range(1, k)], np.int32)
                    trees.append(DraftTree(np.arange(k), parents).breadth_first())
                batch = TreeBatch.build(np.arange(b), [str(i) for i in range(b)], trees, qsl[:-1].numpy(),
                                        np.array(contexts))
                plan = build_plan(batch, table, BS)

                def chain():
                    ops.cpu_attention_with_kv_cache(query=query, key_cache=kc, value_cache=vc, output=out,
                                                    query_start_loc=qsl, seq_lens=seq_lens, scale=0.125, causal=True,
                                                    alibi_slopes=None, sliding_window=-1, block_table=table,
                                                    softcap=0.0, scheduler_metadata=md, s_aux=None)

                def tree():
                    cpu_fast.attend(plan, query, cache, out, 0.125, HQ, D, "vec", fast)

                times = {"chain": [], "tree": []}
                for rep in range(7):
                    for name in (("chain", "tree") if rep % 2 == 0 else ("tree", "chain")):
                        fn = chain if name == "chain" else tree
                        fn()
                        started = time.perf_counter()
                        for _ in range(20):
                            fn()
                        times[name].append((time.perf_counter() - started) / 20 * 1e6)
                c, t = statistics.median(times["chain"]), statistics.median(times["tree"])
                print(f"  {dtype_name:8s} batch {b} k={k:2d}: chain rows (vLLM kernel) {c:8.1f} us   "
                      f"tree rows (fast path) {t:8.1f} us   ratio {t / c:.2f}")


def switch_spec(k: int) -> dict:
    """SwitchProposer's speculative config: every drafted node verified (the cost budget, where this version has one,
    would trim or skip drafts, and this bench compares verification of the same k nodes)."""
    spec = {"method": "bench_tree_rows.SwitchProposer", "num_speculative_tokens": k}
    try:
        from vllm_treespec.settings import COST_BUDGET_KEY
    except ImportError:  # a version without the budget
        return spec
    spec[COST_BUDGET_KEY] = False
    return spec


# --- 2b. GEMM rows -------------------------------------------------------------------------------------------------
def gemm_rows(dtypes: list[str]) -> None:
    """Does a row's output of each of SmolLM2-135M's linear shapes, through vLLM's CPU GEMM dispatch (as the target
    runs them), depend on how many rows share the GEMM? Random weights and inputs; each row of an M-row GEMM against
    the same row computed alone (the shape of a decode step)."""
    import torch

    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    torch.manual_seed(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
    print("== GEMM rows: rows of an M-row GEMM whose output differs (any bit) from the row computed alone")
    for dtype in dtypes:
        for name, (n, k) in shapes.items():
            layer = torch.nn.Linear(k, n, bias=False).to(getattr(torch, dtype))
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            x = torch.randn(40, k).to(layer.weight.dtype)
            alone = torch.cat([layer.cpu_linear(x[r:r + 1], layer.weight, None) for r in range(x.shape[0])])
            differ = {m: int((layer.cpu_linear(x[:m], layer.weight, None) != alone[:m]).any(dim=1).sum())
                      for m in (2, 5, 9, 17, 33, 40)}
            print(f"  {dtype:8s} {name:8s} {n}x{k}: " + ", ".join(f"M={m}: {d}" for m, d in differ.items()),
                  flush=True)


# --- 3. engine ------------------------------------------------------------------------------------------------------
def engine_times(nodes: list[int], batches: list[int], dtypes: list[str], steps: int, repeats: int) -> None:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships functions by pickle
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    from engine_helpers import chat_prompts, close, make_llm
    from vllm import SamplingParams

    import bench_tree_rows as worker_side  # this file, as the worker imports it
    from vllm_treespec.tools.models import ensure_smollm2

    model = str(ensure_smollm2())
    prompts = chat_prompts(model, limit_mt=max(batches), limit_he=0)
    rows = []
    for dtype in dtypes:
        # vLLM's multiprocess engine: its CPU worker binds its OpenMP threads (here: one core, one kept for the
        # scheduler), as served; an in-process engine would run on this process's threads.
        llm = make_llm(model, switch_spec(max(nodes)), in_process=False, dtype=dtype, max_num_seqs=max(batches),
                       max_num_batched_tokens=8192)
        try:
            engine = llm.llm_engine
            counter = [0]

            def run(mode: str, k: int, b: int) -> tuple[float, float, float, float]:
                llm.collective_rpc(worker_side.set_draft, args=(mode, k))
                before = llm.collective_rpc(worker_side.attention_stats)[0]
                params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
                for prompt in prompts[:b]:
                    counter[0] += 1
                    engine.add_request(f"r{counter[0]}", prompt, params)
                stamps, started = [], set()
                while engine.has_unfinished_requests():
                    outputs = engine.step()
                    started.update(o.request_id for o in outputs)
                    # timed from the step that completed the last request's prefill: with 8 requests the prefills
                    # can take two steps, and how long the second takes depends on vLLM's prefix cache, not the mode
                    if outputs and len(started) == b:
                        stamps.append(time.perf_counter())
                after = llm.collective_rpc(worker_side.attention_stats)[0]
                measured = len(stamps) - 1
                step = (stamps[-1] - stamps[0]) / measured
                tree = (after["tree_seconds"] - before["tree_seconds"]) / measured
                kernel = (after["kernel_seconds"] - before["kernel_seconds"]) / measured
                verifier = (after["verifier_seconds"] - before["verifier_seconds"]) / measured
                return step, tree, kernel, verifier

            for b in sorted(set([1, max(batches)])):  # warm-up: compiles, caches, the largest batch's buffers
                run("tree", max(nodes), b)
                run("chain", max(nodes), b)
            for b in batches:
                for k in nodes:
                    got = {"tree": [], "chain": []}
                    attention = {"tree": [], "chain": []}
                    tree_attn, verifier_time = [], []
                    for rep in range(repeats):
                        for mode in (("tree", "chain") if rep % 2 == 0 else ("chain", "tree")):
                            step, tree, kernel, verifier = run(mode, k, b)
                            got[mode].append(step)
                            attention[mode].append(tree + kernel)
                            if mode == "tree":
                                tree_attn.append(tree)
                                verifier_time.append(verifier)
                    t, c = statistics.median(got["tree"]), statistics.median(got["chain"])
                    a = statistics.median(tree_attn)
                    at, ac = statistics.median(attention["tree"]), statistics.median(attention["chain"])
                    v = statistics.median(verifier_time)
                    rows.append((dtype, b, k, c, t, a))
                    print(f"  {dtype:8s} batch {b} k={k:2d}: chain {c * 1e3:7.1f} ms  tree {t * 1e3:7.1f} ms  "
                          f"ratio {t / c:.3f} | tree rows {a * 1e3:6.2f} ms/step = {a / t:5.2%} of the step | "
                          f"attention {ac * 1e3:6.2f} ms chain, {at * 1e3:6.2f} ms tree | verifier "
                          f"{v * 1e3:5.2f} ms | runs {' '.join(f'{x * 1e3:.1f}' for x in got['chain'])} / "
                          f"{' '.join(f'{x * 1e3:.1f}' for x in got['tree'])}", flush=True)
        finally:
            close(llm)
    print("== engine summary (tree step / chain step; goal <= 1.05): " + ", ".join(
        f"{d} b{b} k{k}: {t / c:.3f}" for d, b, k, c, t, _ in rows))


# --- 4. bf16 outputs identical to no speculation ----------------------------------------------------------------------
def identical(methods: list[str], mt_bench: int, humaneval: int, sharegpt: int, max_tokens: int,
              paths: list[str], probes: list[int] = ()) -> None:
    from engine_helpers import chat_prompts, close, make_llm, token_ids
    from vllm import SamplingParams

    import bench_tree_rows as worker_side  # this file, as the worker imports it
    from vllm_treespec.attn.cpu_fast import FORCE_PATH_ENV
    from vllm_treespec.tools.models import ensure_smollm2

    if probes:
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships functions by pickle
        os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    model = str(ensure_smollm2())
    prompts = chat_prompts(model, limit_mt=mt_bench, limit_he=humaneval)
    if sharegpt:
        from transformers import AutoTokenizer

        from vllm_treespec.tools.data import load_prompt_set

        tok = AutoTokenizer.from_pretrained(model)
        fits = []  # the first ``sharegpt`` from position 700 on whose prompt and output fit the engine's 1024 tokens
        for q in load_prompt_set(f"sharegpt[700:{700 + 4 * sharegpt}]"):
            text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True)
            if len(tok(text).input_ids) + max_tokens <= 1024:
                fits.append(text)
            if len(fits) == sharegpt:
                break
        prompts += fits
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    print(f"== identical: bf16, batch 1, {len(prompts)} prompts (MT-Bench {mt_bench} + HumanEval {humaneval} + "
          f"ShareGPT {sharegpt}), "
          f"{max_tokens} tokens, greedy; outputs token-identical to bf16 without speculation", flush=True)

    def outputs(spec: dict | None, path: str | None = None,
                draft: tuple[str, int] | None = None) -> tuple[list[list[int]], float]:
        if path is None:
            os.environ.pop(FORCE_PATH_ENV, None)
        else:
            os.environ[FORCE_PATH_ENV] = path
        llm = make_llm(model, spec, in_process=False, dtype="bfloat16", max_num_seqs=1)
        try:
            if draft is not None:
                llm.collective_rpc(worker_side.set_draft, args=draft)
            started = time.perf_counter()
            got = [token_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
            return got, time.perf_counter() - started
        finally:
            close(llm)
            os.environ.pop(FORCE_PATH_ENV, None)

    reference, seconds = outputs(None)
    print(f"  none: {seconds:.0f} s", flush=True)
    runs = [("ngram (vLLM)", {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                              "prompt_lookup_min": 1}, None)]
    for method in methods:
        spec = {"method": method, "num_speculative_tokens": 32}
        if "fast" in paths:
            runs.append((f"{method} (fast path)", spec, None))
        if "torch" in paths:
            runs.append((f"{method} (torch path)", spec, "torch"))
    runs = [(name, spec, path, None) for name, spec, path in runs]
    for k in probes:  # every step verifies k drafts the target never accepts, as vLLM's chain or as our tree
        for mode in ("chain", "tree"):
            runs.append((f"{k} never-accepted, {mode}", switch_spec(k), None, (mode, k)))
    for name, spec, path, draft in runs:
        got, seconds = outputs(spec, path, draft)
        same = sum(a == b for a, b in zip(got, reference))
        print(f"  {name:26s}: {same:3d} of {len(prompts)} identical to no speculation ({seconds:.0f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--nodes", nargs="+", type=int, default=[4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=24, help="measured steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode and configuration (alternating)")
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--skip-kernel", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--gemm-rows", action="store_true",
                        help="also check whether a row's GEMM output depends on the rows sharing the GEMM (seconds)")
    parser.add_argument("--identical", action="store_true", help="run section 4 (long)")
    parser.add_argument("--identical-methods", nargs="*", default=["suffix_tree", "graft"])
    parser.add_argument("--mt-bench", type=int, default=80)
    parser.add_argument("--humaneval", type=int, default=40)
    parser.add_argument("--sharegpt", type=int, default=0, help="ShareGPT prompts, positions 700+ of the shuffle")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--identical-paths", nargs="+", choices=["fast", "torch"], default=["fast", "torch"],
                        help="CPU tree-attention paths to count (torch: the reference path before the fast one)")
    parser.add_argument("--identical-probes", nargs="*", type=int, default=[], metavar="K",
                        help="also count runs whose every step verifies K drafts the target never accepts, as "
                             "vLLM's chain and as our tree: what a step's shape alone does to bf16 outputs")
    args = parser.parse_args()
    if min(args.nodes) < 2:
        parser.error("--nodes: every k must be at least 2 (the engine section draws trees that are not chains, and a "
                     "tree of one node is one)")
    import torch

    if not args.skip_fidelity or not args.skip_kernel or args.gemm_rows:
        torch._C.set_num_threads(1)  # as vLLM's CPU worker here
    if not args.skip_fidelity:
        fidelity()
    if not args.skip_kernel:
        kernel_times(args.nodes, args.batches, args.dtypes)
    if args.gemm_rows:
        gemm_rows(args.dtypes)
    if not args.skip_engine:
        print(f"== engine: SmolLM2-135M, {args.steps} steps per run, {args.repeats} runs per mode, alternating")
        engine_times(args.nodes, args.batches, args.dtypes, args.steps, args.repeats)
    if args.identical:
        identical(args.identical_methods, args.mt_bench, args.humaneval, args.sharegpt, args.max_tokens,
                  args.identical_paths, args.identical_probes)


if __name__ == "__main__":
    main()
