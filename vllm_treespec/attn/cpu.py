"""Tree attention for vLLM's CPU backend.

vLLM's CPU platform ignores the selected attention backend, so we override ``CPU_ATTN`` itself. Rows of non-tree
requests (chains, prefills, plain decodes) keep vLLM's C++ kernel. Tree rows attend to the committed context plus
their ancestors, and are computed once:

* the builder hands vLLM's kernel each tree request with its sequence length cut to its own rows, so that the kernel
  spends next to nothing on rows whose result is replaced; a step whose rows are all tree rows skips the kernel;
* the fast path (:mod:`~vllm_treespec.attn.cpu_fast`, :mod:`~vllm_treespec.attn.cpu_kernel`) then computes every tree
  row straight from the paged cache, with the arithmetic of vLLM's kernel, in one call per layer;
* a layer whose cache the fast path cannot read (checked once per layer geometry, logged) takes the torch path,
  :func:`tree_attention_cpu`: the context copied out of the cache (``layout.gather_blocks``) and SDPA with a mask.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from vllm_treespec.attn import cpu_fast, layout
from vllm_treespec.attn.plan import TreeAttentionPlan, current_plan

# Host time in this process's attention layers on steps with trees (benchmarks read it through collective_rpc):
# vLLM's kernel, and the tree rows computed after it.
stats = {"kernel_seconds": 0.0, "tree_seconds": 0.0, "tree_calls": 0}


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # AMX packs K/V in a layout torch cannot read; tree rows need to read the cache.
        readable = layout.readable_isa(self.isa, self.block_size)
        if readable != self.isa:
            self.isa = readable
            self._set_isa_to_layers(layer_names)
        if self.kv_cache_dtype == "auto":
            # Decide (and compile) the fast path at start-up, not in the first tree step.
            cpu_fast.decide(self.isa, self.dtype, self.block_size, self.head_dim, self.num_kv_heads, self.num_heads)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        plan = current_plan(self.block_size, common_attn_metadata)
        if plan is not None:
            # Tree rows are recomputed after the kernel: let it see only each tree request's own rows.
            seq_lens = common_attn_metadata.seq_lens.clone()
            seq_lens[torch.from_numpy(plan.batch.rows)] = torch.from_numpy(plan.num_rows).to(seq_lens.dtype)
            common_attn_metadata = common_attn_metadata.replace(seq_lens=seq_lens, _num_computed_tokens_cache=None)
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.tree_plan = plan
        return metadata


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    _tree_layer: tuple | None = None  # (cache key, FastPath | None, the cache's numpy view, ISA)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan: TreeAttentionPlan | None = getattr(attn_metadata, "tree_plan", None)
        if plan is None or self.attn_type != AttentionType.DECODER:
            # a step without trees (most steps once the budget stops drafting): vLLM's forward and nothing else,
            # not even the timers (30 layers' worth of them cost ~0.1 ms a step)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        started = time.perf_counter()
        if plan.total_rows != attn_metadata.num_actual_tokens:
            # Some rows are not tree rows (with none, this is vLLM's forward); tree rows cost the kernel next to
            # nothing (the builder cut their sequences to their own rows) and are written below.
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
        kernel_done = time.perf_counter()
        stats["kernel_seconds"] += kernel_done - started
        self._tree_rows(layer, plan, query, kv_cache, output)
        stats["tree_seconds"] += time.perf_counter() - kernel_done
        stats["tree_calls"] += 1
        return output

    def _tree_rows(self, layer, plan, query, kv_cache, output) -> None:
        key = (kv_cache.data_ptr(), kv_cache.dtype, tuple(kv_cache.shape))
        if self._tree_layer is None or self._tree_layer[0] != key:
            isa = getattr(layer, "isa", "vec")
            fast = cpu_fast.decide(isa, kv_cache.dtype, kv_cache.shape[2], self.head_size, kv_cache.shape[1],
                                   self.num_heads)
            self._tree_layer = (key, fast, cpu_fast.cache_array(kv_cache) if fast is not None else None, isa)
        _, fast, cache, isa = self._tree_layer
        if fast is not None:
            cpu_fast.attend(plan, query, kv_cache, output, self.scale, self.num_heads, self.head_size, isa, fast, cache)
        else:
            tree_attention_cpu(plan, query, kv_cache, output, self.scale, self.num_heads, self.head_size)


def tree_rows(plan: TreeAttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
              scale: float, num_heads: int, head_size: int, isa: str) -> None:
    """Write every tree row of ``plan`` into ``output``: the fast path where it reads this cache, else the torch
    path (what a layer's forward does, without its per-layer memo)."""
    fast = cpu_fast.decide(isa, kv_cache.dtype, kv_cache.shape[2], head_size, kv_cache.shape[1], num_heads)
    if fast is not None:
        cpu_fast.attend(plan, query, kv_cache, output, scale, num_heads, head_size, isa, fast)
    else:
        tree_attention_cpu(plan, query, kv_cache, output, scale, num_heads, head_size)


def tree_attention_cpu(plan: TreeAttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor,
                       scale: float, num_heads: int, head_size: int) -> None:
    """The torch path: overwrite the tree rows of ``output`` with context + ancestor attention."""
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
