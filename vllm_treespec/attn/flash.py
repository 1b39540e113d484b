"""Tree attention for vLLM's FLASH_ATTN backend (CUDA).

Registered over ``FLASH_ATTN`` in processes that serve a tree method, so automatic backend selection resolves to it
with no user flag. Every row first goes through vLLM's own FlashAttention (chains, prefills and decodes keep it,
bit for bit); then the tree rows are overwritten by the Triton tree kernel (``attn.triton_tree``), which reads the same
paged cache: committed context plus the row's ancestors. The kernel's inputs are built once per step from the tree
batch the verifier publishes (``attn.plan``) and shared by every layer.

A tree step must not replay a FULL CUDA graph (its attention would be the captured FlashAttention call); see
``patches.cudagraph_dispatcher``.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_treespec.attn import plan
from vllm_treespec.attn.compact import compact_kv, flash_kv_views
from vllm_treespec.attn.triton_tree import TreeKernelPlan, plan_for_step, tree_attention
from vllm_treespec.patches import expect_signature

# FlashAttention's own methods that the subclasses below override and call through super().
OVERRIDDEN_SIGNATURES = {
    "forward": ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
                "output_block_scale"),
    "build": ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
}
expect_signature(FlashAttentionImpl, "forward", OVERRIDDEN_SIGNATURES["forward"])
expect_signature(FlashAttentionMetadataBuilder, "build", OVERRIDDEN_SIGNATURES["build"])

_step: dict = {"batch": None, "plans": {}}


def current_kernel_plan(group: int, device: torch.device) -> TreeKernelPlan | None:
    """This step's kernel inputs on ``device`` (built on first use, then shared by every layer and builder)."""
    batch = plan.current_batch()
    if batch is None or batch.num_reqs == 0:
        return None
    if _step["batch"] is not batch:
        _step["batch"], _step["plans"] = batch, {}
    key = (group, str(device))
    kernel_plan = _step["plans"].get(key)
    if kernel_plan is None:
        started = time.perf_counter()
        kernel_plan = plan_for_step(batch, group, device)
        _step["plans"][key] = kernel_plan
        plan.build_seconds[0] += time.perf_counter() - started
    return kernel_plan


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.tree_kernel_plan = current_kernel_plan(self.num_heads_q // self.num_heads_kv,
                                                        common_attn_metadata.block_table_tensor.device)
        return metadata


class TreeFlashAttentionImpl(FlashAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        kernel_plan: TreeKernelPlan | None = getattr(attn_metadata, "tree_kernel_plan", None)
        if kernel_plan is not None:
            key_cache, value_cache = flash_kv_views(kv_cache, self.head_size)
            tree_attention(query.view(-1, self.num_heads, self.head_size), key_cache, value_cache,
                           attn_metadata.block_table, kernel_plan, self.scale,
                           output=output.view(-1, self.num_heads, self.head_size))
        return output

    def compact_tree_kv(self, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Move accepted nodes' K/V to their chain slots (called by the verifier after acceptance)."""
        key_cache, value_cache = flash_kv_views(kv_cache, self.head_size)
        compact_kv(key_cache, value_cache, src_slots, dst_slots)


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeFlashAttentionMetadataBuilder
