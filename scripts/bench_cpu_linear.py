"""Time a model's dense layers on one thread: vLLM's CPU linear against vllm_treespec's Numba linear.

Every linear layer of SmolLM2-135M (30 x qkv, o, gate_up, down, and the LM head), each with its own random weight
so that a pass streams the weights from memory as a real step does, is run once per pass at each row count; the
fp32 weights hold bf16 values, as the model's do when its bf16 checkpoint runs in fp32 (``--fp32-values fp32``:
values bf16 cannot hold, the case of a checkpoint trained and stored in fp32); the
best of ``--repeats`` passes is printed per dtype and linear. vLLM's linear is what its CPU dispatch builds for the
weight (oneDNN where it can build the matmul, else torch's linear): the same code path as in an engine, without
our patch.

    .venv/bin/python scripts/bench_cpu_linear.py --rows 1 2 4 8 16 32 128 --repeats 3

``--call-overhead`` instead times one call of each linear on a tiny cached weight (8 x 64, one row): what a call
costs beside the multiply, per dtype, for the input a layer passes (2-D, contiguous) and for one with a leading
dimension. A step calls ~90 linears of SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import time

import torch

# (out_features, in_features, layers) of SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536
SMOLLM2_LINEARS = ((960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1))


def vllm_linear(weight: torch.Tensor):
    """The linear vLLM's CPU dispatch builds for this weight (our patch not installed)."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch = getattr(dispatch_cpu_unquantized_gemm, "__vllm_treespec_original__", dispatch_cpu_unquantized_gemm)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    dispatch(layer, remove_weight=False)
    return layer.cpu_linear


def call_overhead(dtype_names: list[str], calls: int = 20000) -> None:
    """Microseconds per call of each linear on an 8 x 64 weight (in cache: the multiply is ~0.1 us), best of 3."""
    from vllm_treespec.cpu_gemm import NumbaLinear

    print("us per call on an 8 x 64 weight, one row: 2-D input (as layers pass it) / with a leading dimension")
    for dtype_name in dtype_names:
        dtype = getattr(torch, dtype_name)
        weight = (torch.randn(8, 64) * 0.02).to(torch.bfloat16).to(dtype)
        for name, fn in (("vllm", vllm_linear(weight)), ("numba", NumbaLinear(weight))):
            cells = []
            for x in (torch.randn(1, 64).to(dtype), torch.randn(1, 1, 64).to(dtype)):
                best = float("inf")
                for _ in range(4):  # the first round warms up
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(x, weight, None)
                    best = min(best, time.perf_counter() - start)
                cells.append(f"{best / calls * 1e6:6.2f}")
            print(f"{dtype_name} {name:>5}: " + " / ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp32-values", choices=["bf16", "fp32"], default="bf16",
                        help="what the fp32 weights hold: bf16 values (a bf16 checkpoint) or any fp32 value")
    parser.add_argument("--call-overhead", action="store_true",
                        help="time one call on a tiny weight (what a call costs beside the multiply) and stop")
    args = parser.parse_args()
    torch.set_num_threads(1)  # vLLM's CPU worker here

    from vllm_treespec.cpu_gemm import NumbaLinear

    if args.call_overhead:
        call_overhead(args.dtypes)
        return

    generator = torch.Generator().manual_seed(0)
    print("rows  " + "  ".join(f"{n:>7d}" for n in args.rows) + "   (ms per pass over every linear layer)")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        values = torch.bfloat16 if args.fp32_values == "bf16" else torch.float32
        weights = [(torch.randn(n_out, n_in, generator=generator) * 0.02).to(values).to(dtype)
                   for n_out, n_in, layers in SMOLLM2_LINEARS for _ in range(layers)]
        linears = {"vllm": [vllm_linear(w) for w in weights], "numba": [NumbaLinear(w) for w in weights]}
        for name, fns in linears.items():
            cells = []
            for rows in args.rows:
                inputs = {n_in: torch.randn(rows, n_in, generator=generator).to(dtype)
                          for _, n_in, _ in SMOLLM2_LINEARS}
                times = []
                for _ in range(args.repeats + 1):
                    start = time.perf_counter()
                    for weight, fn in zip(weights, fns):
                        fn(inputs[weight.shape[1]], weight, None)
                    times.append(time.perf_counter() - start)
                best = min(times[1:])  # the first pass warms up (compiles, first touch)
                cells.append(f"{best * 1e3:7.1f}")
            print(f"{dtype_name} {name:>5}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
