"""The memory of servers that run side by side (``bench serve --interleave``): the KV cache each one needs for the
run, and whether all of them fit in this machine's memory before any starts.

vLLM's CPU backend takes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB; our tools default it to 4). Four
servers of 4 GiB each do not fit in 24 GiB: the later ones failed at start-up, minutes into a run, for want of their KV
cache. A run's levels need far less: at most ``max(concurrency)`` requests of the longest prompt plus ``--max-tokens``
at once."""

from __future__ import annotations

import json
import math
from pathlib import Path

#: a server's memory besides its KV cache (API server, engine core, worker, weights, a drafter's head and stores):
#: what the machine's available memory dropped by, less the KV cache, for a graft server of SmolLM2-135M at 4 requests
#: (2.3 GiB in bf16, 1.9 in fp32, 2026-12-02), rounded up
SERVER_BASE_GIB = 2.5
#: left free for the load generator and the OS
HEADROOM_GIB = 1.0
#: KV slots a request may hold beyond its prompt and output: its scheduled drafts (a tree of up to 32 nodes)
DRAFT_SLOTS = 64
#: the part of a KV cache a block allocator wastes, and the chat template's tokens beyond what was counted
KV_MARGIN = 1.25
#: what the tools give a server when nothing else is known (tools.engine_env)
DEFAULT_KV_GIB = 4

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
GIB = 1 << 30


class ServerMemoryError(ValueError):
    """The servers do not fit; the message says by how much and what to change."""


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int | None:
    """Bytes of K/V one token takes in every layer of the model in ``model_dir`` (its config.json) at ``dtype`` (the
    server's ``--dtype``; "auto": the model's own); None when the config does not say."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    name = str(cfg.get("torch_dtype") or "float32") if dtype == "auto" else dtype
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES.get(name, 4)


def kv_cache_gib(bytes_per_token: int, concurrency: int, longest_prompt: int, max_tokens: int,
                 max_model_len: int) -> int:
    """Whole GiB of KV cache for ``concurrency`` requests of ``longest_prompt`` tokens and ``max_tokens`` more at once
    (with their drafts' slots), never less than one request of ``max_model_len`` (vLLM refuses to start with less),
    nor more than the tools' default."""
    tokens = max(concurrency * (longest_prompt + max_tokens + DRAFT_SLOTS), max_model_len)
    return min(max(1, math.ceil(tokens * bytes_per_token * KV_MARGIN / GIB)), DEFAULT_KV_GIB)


def available_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def check_servers_fit(labels: list[str], kv_gib: int, available_bytes: int, kv_from_user: bool) -> None:
    """Refuse, before any starts, servers that cannot all be up at once: each needs its KV cache and
    :data:`SERVER_BASE_GIB` besides, and :data:`HEADROOM_GIB` stays free."""
    needed = len(labels) * (kv_gib + SERVER_BASE_GIB) + HEADROOM_GIB
    available = available_bytes / GIB
    if needed <= available:
        return
    kv_source = "VLLM_CPU_KVCACHE_SPACE" if kv_from_user else "what this run's busiest level needs"
    fits = max(math.floor((available - HEADROOM_GIB) / (kv_gib + SERVER_BASE_GIB)), 0)
    fixes = ["run fewer methods", "drop --interleave (one server at a time)",
             "lower VLLM_CPU_KVCACHE_SPACE" if kv_from_user else "lower --concurrency or --max-tokens"]
    raise ServerMemoryError(
        f"--interleave keeps {len(labels)} servers up at once ({', '.join(labels)}), each with {kv_gib} GiB of KV cache "
        f"({kv_source}) and ~{SERVER_BASE_GIB:g} GiB besides: ~{needed:.1f} GiB with {HEADROOM_GIB:g} GiB to spare, but "
        f"this machine has {available:.1f} GiB available, room for {fits}; {', '.join(fixes[:-1])} or {fixes[-1]}")
