"""The environment every tool sets before it starts a vLLM engine."""

from __future__ import annotations

import os

DEFAULT_CPU_KVCACHE_GIB = "4"


def cpu_memory_defaults() -> None:
    """vLLM on CPU reserves 92% of RAM for KV cache unless told otherwise; a few GiB is plenty here."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_CPU_KVCACHE_GIB)
