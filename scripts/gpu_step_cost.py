"""The step-cost model on a GPU, without vLLM: what the budget would do where a verified token is cheap.

An engine measures its curve at start-up with :func:`vllm_treespec.cost.measure.time_rounds` over vLLM's dummy
steps and fits it with :meth:`CostRecord.step_model`. The GPU machine has torch and triton but no vLLM, so this
script puts a stand-in step under the *same* sweep, record, fit and allocator: a Llama decoder (random bf16 weights
of a real model's shapes; step time does not depend on their values) whose attention is this package's Triton tree
kernel (``attn/triton_tree.py``) over a paged cache, every request's rows a random draft tree over its context, plus
the per-step kernel plan built on the host, the logits and the argmax. What it leaves out of a vLLM step: the
scheduler, FlashAttention's pass over all rows before the tree rows are overwritten, CUDA graphs (it runs eager)
and sampling beyond argmax.

It prints, per model: the fitted curve, held-out points (timed in the same rounds, not fitted) predicted vs
measured, the context term, and what :func:`vllm_treespec.cost.allocate.allocate` admits on that curve for
synthetic trees with fixed calibrated acceptance probabilities at 1–64 requests.

    python scripts/gpu_step_cost.py --out DIR                                  # GPU
    python scripts/gpu_step_cost.py --report ~/.cache/vllm_treespec/cost_models/FILE.json   # any record, no GPU
    TRITON_INTERPRET=1 python scripts/gpu_step_cost.py --smoke                 # CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_gpu_tree_attention import make_batch  # noqa: E402 - this folder is on the path of a script


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


#: the published configurations' shapes (HF config.json of each)
MODELS = {
    "SmolLM2-135M": Shape(576, 30, 9, 3, 64, 1536, 49152),
    "Llama-3.1-8B": Shape(4096, 32, 32, 8, 128, 14336, 128256),
    "smoke": Shape(64, 2, 4, 2, 16, 128, 512),
}
BLOCK_SIZE = 16
#: beyond the engines' grid (which stops at 64 tokens, where a CPU step is already many times a plain one)
GPU_TOKEN_GRID = (96, 128, 192, 256, 384, 512)
GPU_BATCH_REQS = (2, 4, 8, 16, 32, 64)
#: timed in the same rounds as the sweep, never fitted
HELD_OUT = ((5, 1), (10, 1), (20, 1), (40, 1), (80, 1), (160, 1), (320, 1), (24, 8), (48, 16), (96, 32))
#: the synthetic draft tree: each node has these children's calibrated acceptance probabilities
CHILD_PROBS = (0.6, 0.2, 0.1)
TREE_NODES = 64


class TreeDecoder:
    """A Llama decoder step over a paged cache with tree attention; weights random, ``dtype`` on ``device``."""

    def __init__(self, shape: Shape, dtype: torch.dtype, device: torch.device, num_blocks: int) -> None:
        from vllm_treespec.attn import triton_tree

        self.tt, self.shape, self.dtype, self.device = triton_tree, shape, dtype, device
        s = shape
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(*dims: int) -> torch.Tensor:
            return (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * dims[-1] ** -0.5).to(dtype)

        self.embed = weight(s.vocab, s.hidden)
        self.layers = [dict(qkv=weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
                            o=weight(s.hidden, s.heads * s.head_dim),
                            gate_up=weight(2 * s.intermediate, s.hidden), down=weight(s.hidden, s.intermediate),
                            norm1=torch.ones(s.hidden, device=device, dtype=dtype),
                            norm2=torch.ones(s.hidden, device=device, dtype=dtype)) for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = weight(s.vocab, s.hidden)
        self.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, device=device).float() / s.head_dim))
        # paged K/V caches for the largest step, allocated once (CUDA graphs hold their addresses)
        self.caches = []
        for _ in range(s.layers):
            kv = torch.randn(2, num_blocks, BLOCK_SIZE, s.kv_heads, s.head_dim, generator=gen, device=device,
                             dtype=torch.float32).to(dtype)
            self.caches.append((kv[0], kv[1]))
        self.graph_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def inputs(self, num_tokens: int, num_reqs: int, context: int, rng: np.random.Generator) -> dict:
        """One verify step's host work and its device inputs: ``num_reqs`` requests, each ``num_tokens / num_reqs``
        tree rows (random trees) after ``context`` committed tokens, each request on its own blocks."""
        rows = num_tokens // num_reqs
        per_req = -(-(context + rows) // BLOCK_SIZE)
        batch = make_batch(rng, num_reqs, context, rows, chain=False)
        depth = batch.mask.sum(-1) - 1  # a node's position is its depth after the context
        slot_rows = np.arange(num_reqs)[:, None] * per_req * BLOCK_SIZE + context + np.arange(rows)[None, :]
        host = dict(positions=(context + depth).reshape(-1), slots=slot_rows.reshape(-1),
                    token_ids=rng.integers(0, self.shape.vocab, num_tokens))
        inputs = {k: torch.from_numpy(v).to(self.device, non_blocking=True) for k, v in host.items()}
        inputs["table"] = torch.arange(num_reqs * per_req, device=self.device, dtype=torch.int32).view(num_reqs, -1)
        inputs["plan"] = self.tt.plan_for_step(batch, self.shape.heads // self.shape.kv_heads, self.device)
        return inputs

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                plan) -> torch.Tensor:
        """The step's next tokens (argmax), on the device; no host synchronisation (capturable)."""
        s, tt = self.shape, self.tt
        num_tokens = token_ids.shape[0]
        angles = positions[:, None].float() * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x = self.embed[token_ids]
        q_size, kv_size = s.heads * s.head_dim, s.kv_heads * s.head_dim
        out = torch.empty(num_tokens, s.heads, s.head_dim, device=self.device, dtype=self.dtype)
        for layer, (key_cache, value_cache) in zip(self.layers, self.caches):
            h = torch.nn.functional.rms_norm(x, (s.hidden,), layer["norm1"], 1e-5)
            q, k, v = (h @ layer["qkv"].T).split((q_size, kv_size, kv_size), dim=-1)
            q = self._rotate(q.view(num_tokens, s.heads, s.head_dim), cos, sin)
            k = self._rotate(k.view(num_tokens, s.kv_heads, s.head_dim), cos, sin)
            key_cache.view(-1, s.kv_heads, s.head_dim).index_copy_(0, slots, k)
            value_cache.view(-1, s.kv_heads, s.head_dim).index_copy_(0, slots, v.view(num_tokens, s.kv_heads, -1))
            tt.tree_attention(q, key_cache, value_cache, table, plan, s.head_dim ** -0.5, output=out)
            x = x + out.view(num_tokens, q_size) @ layer["o"].T
            h = torch.nn.functional.rms_norm(x, (s.hidden,), layer["norm2"], 1e-5)
            gate, up = (h @ layer["gate_up"].T).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ layer["down"].T
        logits = torch.nn.functional.rms_norm(x, (s.hidden,), self.norm, 1e-5) @ self.lm_head.T
        return logits.argmax(dim=-1)


class Driver:
    """``run(num_tokens, num_reqs) -> seconds`` at a fixed context, as :class:`~vllm_treespec.cost.measure.StepDriver`.

    eager: every kernel launched from Python each step. graph: the step's device work replayed from a CUDA graph
    captured on its first call for that shape (the host work of a step — its trees, kernel plan and input copies —
    is still done and timed every step; the replay reads the inputs captured with the first)."""

    def __init__(self, decoder: TreeDecoder, context: int, graph: bool) -> None:
        self.decoder, self.context, self.graph = decoder, context, graph
        self.rng = np.random.default_rng(0)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _capture(self, inputs: dict) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.decoder.forward(**inputs)  # compiles the Triton kernel for this shape outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.decoder.graph_pool):
            tokens = self.decoder.forward(**inputs)
        return graph, tokens

    def __call__(self, num_tokens: int, num_reqs: int = 1) -> float:
        if num_tokens % num_reqs:
            raise ValueError(f"{num_tokens} tokens do not split evenly over {num_reqs} requests")
        decoder = self.decoder
        sync = torch.cuda.synchronize if decoder.device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            if self.graph and (num_tokens, num_reqs) not in self.graphs:
                self.graphs[num_tokens, num_reqs] = self._capture(
                    decoder.inputs(num_tokens, num_reqs, self.context, self.rng))
            sync()
            started = time.perf_counter()
            inputs = decoder.inputs(num_tokens, num_reqs, self.context, self.rng)
            if self.graph:
                graph, tokens = self.graphs[num_tokens, num_reqs]
                graph.replay()
            else:
                tokens = decoder.forward(**inputs)
            tokens.cpu()  # the step's tokens reach the host, as the sampler's do
            return time.perf_counter() - started


def synthetic_tree(nodes: int = TREE_NODES):
    """A BFS tree of ``nodes`` nodes whose every node has children with :data:`CHILD_PROBS` (calibrated)."""
    from vllm_treespec.api import DraftTree

    parents, probs = [], []
    frontier = [-1]
    while len(parents) < nodes:
        next_frontier = []
        for parent in frontier:
            for p in CHILD_PROBS:
                if len(parents) == nodes:
                    break
                next_frontier.append(len(parents))
                parents.append(parent)
                probs.append(p)
        frontier = next_frontier
    return DraftTree(np.arange(nodes), np.array(parents), node_probs=np.array(probs))


def blocks_needed(points: list[tuple[int, int]], context: int) -> int:
    return max(r * -(-(context + t // r) // BLOCK_SIZE) for t, r in points)


def measure(name: str, shape: Shape, dtype: torch.dtype, device: torch.device, context: int, repeats: int,
            graph: bool, smoke: bool):
    from vllm_treespec.cost.measure import LONG_CONTEXT_FACTOR, LONG_CONTEXT_POINTS, TOKEN_GRID, time_rounds
    from vllm_treespec.cost.model import FORMAT_VERSION, CostKey, CostRecord, StepSample

    grid = (1, 2, 4, 8) if smoke else TOKEN_GRID + GPU_TOKEN_GRID
    reqs = (2, 4) if smoke else GPU_BATCH_REQS
    points = list(dict.fromkeys([(t, 1) for t in grid] + [(r * q, r) for r in reqs for q in (1, 4)]))
    held_out = [] if smoke else [p for p in HELD_OUT if p not in points]
    long_context, long_points = LONG_CONTEXT_FACTOR * context, list(LONG_CONTEXT_POINTS)
    decoder = TreeDecoder(shape, dtype, device, max(blocks_needed(points + held_out, context),
                                                    blocks_needed(long_points, long_context)))
    short, longer_driver = Driver(decoder, context, graph), Driver(decoder, long_context, graph)
    # an engine's sweep runs after vLLM's compilation and warm-up: compile (and capture) every shape first, so that
    # no first call is taken for a slow step
    for driver, shapes in ((short, points + held_out), (longer_driver, long_points)):
        for point in shapes:
            driver(*point)
    started = time.perf_counter()
    # budget_s / stop_ratio: as an engine's full sweep (measure.sweep's defaults), the grid and batch sizes wider
    timed = time_rounds(short, points + held_out, repeats, keep=[(1, 1), *held_out])
    longer = time_rounds(longer_driver, long_points, repeats, keep=[(1, 1)])
    seconds = time.perf_counter() - started
    device_label = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    mode = "CUDA graph" if graph else "eager"
    record = CostRecord(format_version=FORMAT_VERSION,
                        key=CostKey(model=f"{name} (random weights, stand-in step, {mode})",
                                    dtype=str(dtype).split(".")[-1], device=device_label, vllm_version="none",
                                    torch_threads=torch.get_num_threads()),
                        samples=[x for x in timed if (x.num_tokens, x.num_reqs) not in held_out]
                        + [StepSample(x.num_tokens, x.num_reqs, x.seconds, long_context) for x in longer],
                        measured_at=time.time(), context_len=context)
    extra = [x for x in timed if (x.num_tokens, x.num_reqs) in held_out]
    return record, extra, seconds


def report(record, extra, seconds: float) -> None:
    from vllm_treespec.cost.allocate import allocate
    from vllm_treespec.cost.measure import context_errors, relative_errors

    model = record.step_model()
    key = record.key
    print(f"\n## {key.model}, {key.dtype}, {key.device}: sweep {seconds:.1f} s, {len(record.samples)} timed steps\n")
    print("| tokens | requests | measured ms | fitted ms | error |")
    print("|---|---|---|---|---|")
    for t, r, measured, predicted, err in relative_errors(model, record.samples):
        print(f"| {t} | {r} | {measured * 1e3:.2f} | {predicted * 1e3:.2f} | {err:+.1%} |")
    if extra:
        print("\nheld out (timed in the same rounds, not fitted):\n")
        print("| tokens | requests | measured ms | predicted ms | error |")
        print("|---|---|---|---|---|")
        errors = relative_errors(model, extra)
        for t, r, measured, predicted, err in errors:
            print(f"| {t} | {r} | {measured * 1e3:.2f} | {predicted * 1e3:.2f} | {err:+.1%} |")
        print(f"\nheld-out max |error| {max(abs(e[-1]) for e in errors):.1%}")
    print(f"\ncontext term {model.per_context * 1e6:.3f} ms per row and 1,000 positions beyond "
          f"{model.reference_context}, {model.per_request_context * 1e6:.3f} ms more per request")
    for t, r, c, measured, predicted, err in context_errors(model, record.samples):
        print(f"- {t} tokens x {r} requests at {c} tokens of context: {measured * 1e3:.2f} ms measured, "
              f"{predicted * 1e3:.2f} ms fitted ({err:+.1%})")
    largest = max(x.num_tokens for x in record.samples)  # no extrapolation past the sweep: a batch cap, as an engine's
    print(f"\nallocator on this curve: {TREE_NODES}-node trees per request, children's calibrated acceptance "
          f"{CHILD_PROBS}, at most {TREE_NODES} nodes per request and {largest} tokens per step\n")
    print("| requests | nodes admitted per request | expected tokens per step | step ms | "
          "predicted tokens/s vs plain |")
    print("|---|---|---|---|---|")
    tree = synthetic_tree()
    for reqs in (1, 8, 32, 64):
        allocation = allocate([tree] * reqs, model, per_request_cap=TREE_NODES, batch_cap=largest - reqs)
        print(f"| {reqs} | {allocation.total_nodes / reqs:.1f} | {allocation.expected_tokens:.1f} | "
              f"{allocation.seconds * 1e3:.2f} | {allocation.rate / allocation.plain_rate:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="Llama-3.1-8B,SmolLM2-135M", help=f"of {', '.join(MODELS)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=256, help="the sweep's sequence length (an engine's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="graph,eager", help="graph (the step replayed from a CUDA graph) and/or "
                        "eager (every kernel launched from Python); on CPU: eager")
    parser.add_argument("--out", help="write each model's cost record (JSON, the engines' cache format) here")
    parser.add_argument("--smoke", action="store_true", help="tiny model and grid (CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--report", metavar="RECORD", help="measure nothing: fit and allocate on a cost record (one "
                        "written by --out, or an engine's from the step-cost cache) and print the same tables")
    args = parser.parse_args()

    import msgspec

    if args.report:
        from vllm_treespec.cost.model import CostRecord

        with open(args.report, "rb") as f:
            report(msgspec.json.decode(f.read(), type=CostRecord), [], 0.0)
        return

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("no GPU: run with TRITON_INTERPRET=1 (set before triton is imported) and --smoke")

    names = ["smoke"] if args.smoke else args.models.split(",")
    modes = ["eager"] if device.type == "cpu" else args.modes.split(",")
    for name, mode in [(n, m) for n in names for m in modes]:
        if name not in MODELS:
            sys.exit(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
        if mode not in ("graph", "eager"):
            sys.exit(f"--modes: unknown mode {mode!r}; choose graph and/or eager")
        dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
        record, extra, seconds = measure(name, MODELS[name], dtype, device, 32 if args.smoke else args.context,
                                         2 if args.smoke else args.repeats, mode == "graph", args.smoke)
        report(record, extra, seconds)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"cost-{name}-{record.key.dtype}-{mode}.json"), "wb") as f:
                f.write(msgspec.json.encode(record))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "vllm" in sys.modules:
        sys.exit("vllm was imported: this script must run without it")


if __name__ == "__main__":
    main()
