"""Tree-aware attention backends, installed through vLLM's ``register_backend``."""

from __future__ import annotations


def register_backends() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        # The CPU platform ignores the selected backend, so the override has to replace CPU_ATTN itself.
        register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_treespec.attn.cpu.TreeCPUAttentionBackend")
    elif current_platform.is_cuda():
        # Automatic selection resolves FLASH_ATTN through the registry, so no user flag is needed. Where the platform
        # picks another backend (Blackwell: FlashInfer) the verifier logs it once and runs chains.
        register_backend(AttentionBackendEnum.FLASH_ATTN, "vllm_treespec.attn.flash.TreeFlashAttentionBackend")
    forget_resolved_backends()


def forget_resolved_backends() -> None:
    """Drop vLLM's memo of resolved attention backends. An engine built earlier in this process without a tree method
    (in-process engines, VLLM_ENABLE_V1_MULTIPROCESSING=0) resolved and cached the stock class; without this a tree
    engine built after it would get that class too and run every draft as a chain."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()
