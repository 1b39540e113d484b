"""What can verify as a tree: per request (its sampling parameters) and per model (attention, KV cache, parallelism).

A request or a model that fails a check is not an error: its proposals run as chains, which stock vLLM verifies.
"""

from __future__ import annotations

from typing import Any

from vllm_treespec.attn import layout


def tree_unsupported_reason(sampling_params: Any) -> str | None:
    """Why a request must run as a chain (its sampling reads draft-order context or draft logprobs), else None."""
    sp = sampling_params
    if sp is None:
        return "not a generation request"
    checks = (
        (sp.logprobs is not None, "logprobs"),
        (sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1, "penalties"),
        (bool(sp.bad_words), "bad_words"),
        (sp.min_tokens > 0, "min_tokens"),
        (sp.min_p > 0, "min_p"),
        (bool(sp.logit_bias), "logit_bias"),
        (sp.allowed_token_ids is not None, "allowed_token_ids"),
        (sp.seed is not None, "per-request seed"),
        (sp.structured_outputs is not None, "structured output"),
    )
    for failed, name in checks:
        if failed:
            return name
    return None


def tree_attention_impls() -> tuple[type, ...]:
    """The attention impls with a tree path on this platform (CPU: the CPU_ATTN override; CUDA: FLASH_ATTN's)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_treespec.attn.cpu import TreeCPUAttentionImpl

        return (TreeCPUAttentionImpl,)
    from vllm_treespec.attn.flash import TreeFlashAttentionImpl

    return (TreeFlashAttentionImpl,)


def attention_layers(vllm_config: Any) -> list[Any]:
    """The model's attention layers that own a (non-empty) KV cache."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    layers = get_layers_from_vllm_config(vllm_config, Attention)
    return [layer for layer in layers.values() if layer.kv_cache is not None and layer.kv_cache.numel()]


def unsupported_model_reason(runner: Any, layers: list[Any]) -> str | None:
    """Why this runner's model must run chains (the first failed check, in a fixed order), else None.
    ``layers`` are its :func:`attention_layers`."""
    if getattr(runner, "uses_mrope", False):
        return "M-RoPE positions"
    if runner.vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism"
    if getattr(runner.vllm_config.parallel_config, "data_parallel_size", 1) > 1:
        return "data parallelism (ranks re-dispatch CUDA graphs with a mode agreed across ranks)"
    if not runner.vllm_config.model_config.is_attention_free and layers == []:
        return "no attention layers found"
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kv_config = getattr(runner, "kv_cache_config", None)
    if kv_config is not None:
        for group in kv_config.kv_cache_groups:
            spec = group.kv_cache_spec
            if type(spec) is not FullAttentionSpec:
                return f"{type(spec).__name__} layers (sliding window / hybrid models)"
    for layer in layers:
        impl = layer.impl
        if getattr(impl, "sliding_window", -1) not in (-1, None, (-1, -1)):  # FlashAttention: (-1, -1) = none
            return "sliding-window attention"
        if getattr(impl, "dcp_world_size", 1) > 1:
            return "decode context parallelism"
        if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
            return "ALiBi / attention sinks"
        if getattr(impl, "logits_soft_cap", 0):
            return "logit soft-capping"
        if getattr(impl, "kv_cache_dtype", "auto") != "auto":
            return f"kv_cache_dtype={impl.kv_cache_dtype}"
        if not isinstance(impl, tree_attention_impls()):
            return (f"attention backend {type(impl).__name__} has no tree path; on CUDA trees need FLASH_ATTN "
                    "(--attention-backend FLASH_ATTN)")
    layer = layers[0]
    if hasattr(layer.impl, "compact_tree_kv"):
        return None  # reads and compacts the cache through its logical view: no layout adapter to check
    kv = layer.kv_cache
    if not layout.self_check(layer.isa, kv.dtype, kv.shape[2], kv.shape[3] // 2, kv.shape[1]):
        return f"the KV cache layout of ISA {layer.isa!r} failed the read-back self-check"
    return None
