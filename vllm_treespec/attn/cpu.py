"""Tree attention for vLLM's CPU backend.

vLLM's CPU platform ignores the selected attention backend, so we override ``CPU_ATTN`` itself. Rows of
non-tree requests (chains, prefills, plain decodes) keep vLLM's C++ kernel. Tree rows attend to the committed context
plus their ancestors: they are recomputed in torch over the paged cache, read through the VEC layout adapter
(``attn.layout``), and overwrite the kernel's causal result for those rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_treespec.attn import layout
from vllm_treespec.attn.plan import TreeAttentionPlan, current_plan


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # AMX packs K/V in a layout torch cannot read; tree rows need to read the cache.
        readable = layout.readable_isa(self.isa, self.block_size)
        if readable != self.isa:
            self.isa = readable
            self._set_isa_to_layers(layer_names)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.tree_plan = current_plan(self.block_size, common_attn_metadata)
        return metadata


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        plan: TreeAttentionPlan | None = getattr(attn_metadata, "tree_plan", None)
        if plan is not None:
            tree_attention_cpu(plan, query, kv_cache, output, self.scale, self.num_heads, self.head_size)
        return output


def tree_attention_cpu(plan: TreeAttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                       scale: float, num_heads: int, head_size: int) -> None:
    """Overwrite the tree rows of ``output`` with context + ancestor attention."""
    q = query.view(-1, num_heads, head_size)[plan.query_index]  # [R, W, Hq, D]
    keys, values = layout.gather_blocks(kv_cache, plan.block_ids)  # [R, Hkv, L, D]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=plan.attn_mask, scale=scale,
                                       enable_gqa=num_heads != keys.shape[1])
    out = output.view(-1, num_heads, head_size)
    out[plan.valid_query_index] = o.transpose(1, 2).reshape(-1, num_heads, head_size)[plan.valid_flat]


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
