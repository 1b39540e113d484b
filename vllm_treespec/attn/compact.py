"""KV compaction on the logical paged view, for any device, layout and dtype.

After tree acceptance the accepted nodes' K/V move from their linear slots (context + 1 + node) to the chain slots
(context + 1 + k). Here that is one gather followed by one scatter per cache, on views shaped
``[num_blocks, block_size, num_kv_heads, head_dim]`` with whatever strides the backend's physical layout gives them:
no cache-write kernel, no layout adapter. Gathering everything first makes overlapping moves safe. Elements are moved
as same-width integers, so every dtype (fp8 included) is copied bit for bit.

The CPU backend moves the slots of its VEC layouts in place (``layout.move_slots``, one numba call per layer); any
other CPU cache goes through ``layout.read_slots`` / ``write_slots`` (vLLM's cache-write op). :func:`compact_layers`
picks the path of each layer. Which slots move is the verifier's business
(:mod:`vllm_treespec.verify.compact`).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_treespec.attn import layout

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flash_kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a FLASH_ATTN layer's cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` as logical
    ``[num_blocks, block_size, num_kv_heads, head_size]`` views (the split vLLM's FlashAttentionImpl makes)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def compact_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """Copy the K/V at ``src_slots`` to ``dst_slots`` (slot = block * block_size + offset) in place."""
    block_size = key_cache.shape[1]
    src_slots = src_slots.to(key_cache.device, torch.int64)
    dst_slots = dst_slots.to(key_cache.device, torch.int64)
    src_block, src_offset = src_slots // block_size, src_slots % block_size
    dst_block, dst_offset = dst_slots // block_size, dst_slots % block_size
    for cache in (key_cache, value_cache):
        as_int = cache.view(_SAME_WIDTH_INT[cache.element_size()])
        rows = as_int[src_block, src_offset]  # advanced indexing gathers into a new tensor
        as_int[dst_block, dst_offset] = rows


def compact_layers(layers: list[Any], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy the K/V at ``src_slots`` to ``dst_slots`` in every attention layer's cache: device backends (impls with
    ``compact_tree_kv``) on their logical view, the CPU backend in place on its VEC layout (else through vLLM's
    cache-write op)."""
    device = layers[0].kv_cache.device
    src_slots, dst_slots = src_slots.to(device), dst_slots.to(device)  # one copy for all layers
    src_np = dst_np = None
    for layer in layers:
        compact = getattr(layer.impl, "compact_tree_kv", None)
        if compact is not None:  # device backends: gather-then-scatter on the logical view
            compact(layer.kv_cache, src_slots, dst_slots)
            continue
        kv_cache_dtype = layer.impl.kv_cache_dtype
        if layout.can_move_slots(layer.kv_cache, layer.isa, kv_cache_dtype):
            if src_np is None:
                src_np, dst_np = src_slots.numpy(), dst_slots.numpy()
            layout.move_slots(layer.kv_cache, src_np, dst_np)
            continue
        key, value = layout.read_slots(layer.kv_cache, src_slots)  # gather all first, then scatter
        layout.write_slots(layer.kv_cache, dst_slots, key, value, layer.isa,
                           layer._k_scale_float, layer._v_scale_float, kv_cache_dtype)
