"""Reading vLLM's CPU paged KV cache from torch (the "layout adapter").

The CPU cache of one layer is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``; its bytes per (block, head)
depend on the ISA the kernels were built for. For the VEC layouts (``vec``, ``vec16``) the first
``block_size * head_dim`` elements hold K column-major (``[head_dim, block_size]``) and the rest hold V row-major
(``[block_size, head_dim]``). AMX prepacks tiles, so tree mode forces a VEC layout. :func:`self_check` proves the
adapter against vLLM's own cache-write op at startup; if it fails, tree verification stays off.
"""

from __future__ import annotations

import torch

VEC_LAYOUT_ISAS = ("vec", "vec16")


def readable_isa(isa: str, block_size: int) -> str:
    if isa in VEC_LAYOUT_ISAS or isa != "amx":
        return isa
    return "vec" if block_size % 32 == 0 else "vec16"


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.view(num_blocks, num_heads, 2 * block_size * d)
    keys_t = flat[..., : block_size * d].unflatten(-1, (d, block_size))  # [NB, H, D, bs]
    values = flat[..., block_size * d:].unflatten(-1, (block_size, d))  # [NB, H, bs, D]
    return keys_t, values


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks, ``[R, num_kv_heads, nb * block_size, head_dim]`` for ``block_ids [R, nb]``."""
    keys_t, values = _split(kv_cache)
    r, nb = block_ids.shape
    _, h, d, bs = keys_t.shape
    flat_ids = block_ids.reshape(-1)
    k = keys_t.index_select(0, flat_ids).view(r, nb, h, d, bs).permute(0, 2, 1, 4, 3).reshape(r, h, nb * bs, d)
    v = values.index_select(0, flat_ids).view(r, nb, h, bs, d).permute(0, 2, 1, 3, 4).reshape(r, h, nb * bs, d)
    return k, v


def read_slots(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V stored at the given slots, ``[n, num_kv_heads, head_dim]`` each."""
    keys_t, values = _split(kv_cache)
    bs = keys_t.shape[-1]
    block, offset = slots // bs, slots % bs
    return keys_t[block, :, :, offset].clone(), values[block, :, offset, :].clone()


def write_slots(kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor, isa: str,
                k_scale: float = 1.0, v_scale: float = 1.0, kv_cache_dtype: str = "auto") -> None:
    """Write K/V rows with vLLM's own CPU cache-write op."""
    from vllm import _custom_ops as ops

    nb, h, bs, two_d = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=k_scale, v_scale=v_scale,
                                   kv_cache_dtype=kv_cache_dtype)


def self_check(isa: str, dtype: torch.dtype, block_size: int, head_dim: int, num_kv_heads: int) -> bool:
    """Write random K/V with vLLM's op and read them back through the adapter; True iff bit-identical."""
    generator = torch.Generator().manual_seed(0)
    num_blocks = 3
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    n = min(num_blocks * block_size, 2 * block_size + 5)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:n]
    key = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
    value = torch.randn(n, num_kv_heads, head_dim, generator=generator).to(dtype)
    try:
        write_slots(cache, slots, key, value, isa)
    except Exception:  # noqa: BLE001 - an unsupported ISA/dtype means "cannot read"
        return False
    k, v = read_slots(cache, slots)
    if not (torch.equal(k, key) and torch.equal(v, value)):
        return False
    kb, vb = gather_blocks(cache, torch.arange(num_blocks).view(1, -1))
    return bool(torch.equal(kb[0].transpose(0, 1)[slots], key) and torch.equal(vb[0].transpose(0, 1)[slots], value))
