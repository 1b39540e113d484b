"""Compile (or load from Numba's cache) the kernels of a tree verification step at engine start-up.

Every kernel is ``@njit(cache=True)`` and compiles on its first call: without this, inside the first step that
verifies a tree. On a cold cache (a fresh install) that stalled graft's first request by ~2.9 s on an AVX-512 CPU
(5.5 s against 2.7 s warm, fp32, batch 1: the target's top-k and argmax over the logits, greedy acceptance, the
tree layout, the KV compaction and the step-cost prediction). :func:`compile_step_kernels` calls each once on a
tiny input with the argument types of a real step (the engine's logits and KV-cache dtypes), so the first request
runs at speed; from a warm cache it takes milliseconds. The tree attention kernel is compiled earlier, when
:func:`vllm_treespec.attn.cpu_fast.decide` checks it against vLLM's kernel, and the retrieval store's by
:func:`vllm_treespec.retrieval.warmup.compile_kernels`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_treespec.attn import layout
from vllm_treespec.tree import greedy_accept, tree_layout
from vllm_treespec.verify.accept import argmax_rows
from vllm_treespec.verify.topk import target_topk

logger = logging.getLogger("vllm.treespec")

#: logits dtypes the CPU kernels read in place (others take torch's path, nothing to compile)
KERNEL_LOGITS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compile_logits_kernels(dtypes: set[torch.dtype]) -> None:
    """Top-k with probabilities and argmax over rows of logits of each dtype (the engine's, and fp32)."""
    rows = np.arange(2, dtype=np.int64)
    for dtype in dtypes & set(KERNEL_LOGITS_DTYPES):
        logits = torch.linspace(-1.0, 1.0, 64).repeat(2, 1).to(dtype)
        argmax_rows(logits, rows)
        if dtype != torch.float16:
            target_topk(logits, rows, 2)


def compile_acceptance_kernels() -> None:
    """The tree layout and greedy acceptance of one request with a two-node chain."""
    parents = np.array([-1, 0], np.int32)
    node_offsets = np.array([0, 2], np.int64)
    depth, _ = tree_layout(parents, node_offsets)
    greedy_accept(np.array([5, 6], np.int64), parents, depth, node_offsets, np.zeros(1, np.int64),
                  np.array([5, 6, 7], np.int64), 2)


def compile_compaction_kernels(kv_caches: list[torch.Tensor]) -> None:
    """The in-place KV move, on a two-block copy of each distinct geometry of ``kv_caches`` (caches that
    :func:`~vllm_treespec.attn.layout.can_move_slots`; never the engine's cache itself)."""
    seen = set()
    for cache in kv_caches:
        key = (cache.dtype, tuple(cache.shape[1:]))
        if key not in seen:
            seen.add(key)
            scratch = torch.zeros((2, *cache.shape[1:]), dtype=cache.dtype)
            layout.move_slots(scratch, np.array([0], np.int64), np.array([1], np.int64))


def movable_caches(layers: list[Any]) -> list[torch.Tensor]:
    """The KV caches of ``layers`` that compaction moves with :func:`~vllm_treespec.attn.layout.move_slots` (as
    :func:`~vllm_treespec.attn.compact.compact_layers` decides: a CPU layer whose layout it reads)."""
    return [layer.kv_cache for layer in layers
            if getattr(layer.impl, "compact_tree_kv", None) is None
            and layout.can_move_slots(layer.kv_cache, layer.isa, layer.impl.kv_cache_dtype)]


def compile_step_kernels(runner: Any) -> float:
    """Compile the kernels of ``runner``'s tree verification steps; seconds spent. Any failure: one log line (the
    kernel then compiles on its first real call, as before)."""
    started = time.perf_counter()
    try:
        model_dtype = getattr(getattr(getattr(runner, "vllm_config", None), "model_config", None), "dtype", None)
        compile_logits_kernels({torch.float32} | ({model_dtype} if isinstance(model_dtype, torch.dtype) else set()))
        compile_acceptance_kernels()
        verifier = getattr(runner, "_treespec_verifier", None)
        if verifier is not None:
            compile_compaction_kernels(movable_caches(verifier._attention_layers()))
            budget = getattr(verifier, "budget", None)
            if budget is not None:  # the allocator's and the gate's predictions, with and without a context term
                tokens = np.arange(1.0, 3.0)
                budget.step_time.predict_many(tokens, 1, plain_tokens=1.0)
                budget.step_time.predict_many(tokens, 1, excess=np.zeros(2), plain_tokens=1.0)
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation, never a reason to fail start-up
        logger.warning("vllm_treespec: could not compile the tree step's kernels at start-up (%s: %s); they compile "
                       "on first use", type(e).__name__, e)
    return time.perf_counter() - started
