"""A draft head's linear layers through a faster CPU GEMM than torch's ``F.linear``:

- vLLM's own CPU GEMM dispatch (oneDNN where it can build a matmul, else torch), as vLLM runs the target's. At the
  shipped head's shapes (1-16 rows; 576-wide layers, an 8k draft vocabulary) it took 0.2-0.8x the time of torch's
  ``F.linear`` in bf16 and mostly 0.3-0.9x in fp32 on the development CPU (``scripts/bench_head_gemm.py``);
- int8 weights (:func:`use_int8_weights`): a quarter of fp32's bytes, for a memory-bound head.

The head's outputs only steer drafts: neither a different summation order nor rounded weights can change what is
verified."""

from __future__ import annotations

import logging
import types
import warnings

import torch

from vllm_treespec.cpu_gemm import best_seconds

logger = logging.getLogger("vllm.treespec")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = self.cpu_linear(rows, self.weight, self.bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def use_vllm_cpu_gemm(module: torch.nn.Module) -> int:
    """Route every CPU ``nn.Linear`` of ``module`` through vLLM's GEMM dispatch (inference only: the weights are
    packed once, so they must not change afterwards). Returns how many layers were routed; 0 (and one log line)
    when vLLM's dispatch is unavailable or refuses, leaving the module as it was."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return 0
    layers = [m for m in module.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    try:
        for layer in layers:
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    except Exception as e:  # noqa: BLE001 - a faster GEMM is an optimisation; torch's stays
        logger.info("vllm_treespec: the draft head keeps torch's GEMM (vLLM's CPU dispatch failed: %s: %s)",
                    type(e).__name__, e)
        for layer in layers:
            layer.__dict__.pop("cpu_linear", None)
        return 0
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)


def _int8_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).float().contiguous()
    out = torch.ops.quantized.linear_dynamic(rows, self.int8_weight, True)
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def use_int8_weights(module: torch.nn.Module) -> int:
    """Every CPU ``nn.Linear`` of ``module`` multiplies with int8 weights (symmetric, one scale per output row) and
    its input quantized per call (torch's dynamic int8 linear, fbgemm's kernels; the range reduced to 7 bits as
    fbgemm needs on AVX2): the weights' bytes are a quarter of fp32's, and the head is memory-bound at a level's
    rows (1.9x faster than fp32 through vLLM's dispatch at 8 rows on an AVX2 CPU, ``scripts/bench_head_gemm.py``).
    Inputs and outputs stay in the module's dtype. Inference only (the weights are packed once). Returns how many
    layers were converted; 0 (and one log line) where torch has no int8 GEMM here, leaving the module as it was."""
    layers = [m for m in module.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"]
    packed = []
    try:
        for layer in layers:
            weight = layer.weight.detach().float()
            scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            zero = torch.zeros(weight.shape[0], dtype=torch.long)
            with warnings.catch_warnings():  # torch deprecates its quantized tensors; once removed, this falls back
                warnings.simplefilter("ignore", UserWarning)
                q = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
            bias = None if layer.bias is None else layer.bias.detach().float()
            packed.append(torch.ops.quantized.linear_prepack(q, bias))
    except Exception as e:  # noqa: BLE001 - int8 is an optimisation; the float layers stay
        logger.info("vllm_treespec: no int8 GEMM for the draft head here (%s: %s)", type(e).__name__, e)
        return 0
    for layer, weight in zip(layers, packed):
        layer.__dict__.pop("cpu_linear", None)
        layer.int8_weight = weight
        layer.forward = types.MethodType(_int8_forward, layer)
    return len(layers)


def linear_seconds(module: torch.nn.Module, rows: int, repeats: int = 5) -> float:
    """Seconds one call of each of ``module``'s linear layers takes at ``rows`` rows (best of ``repeats``), summed:
    what choosing the head's compute dtype compares. Inputs are constant (no random state is used)."""
    total = 0.0
    with torch.inference_mode():
        for layer in module.modules():
            if not isinstance(layer, torch.nn.Linear):
                continue
            x = torch.full((rows, layer.in_features), 0.01, dtype=layer.weight.dtype, device=layer.weight.device)
            total += best_seconds(lambda: layer(x), repeats)  # the untimed first call packs or allocates
    return total
