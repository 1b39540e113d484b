"""Reading vLLM's CPU paged KV cache from torch (the "layout adapter").

The CPU cache of one layer is ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``; its bytes per (block, head)
depend on the ISA the kernels were built for. For the VEC layouts (``vec``, ``vec16``) the first
``block_size * head_dim`` elements hold K column-major (``[head_dim, block_size]``) and the rest hold V row-major
(``[block_size, head_dim]``). AMX prepacks tiles, so tree mode forces a VEC layout. :func:`self_check` proves the
adapter against vLLM's own cache-write op at startup; if it fails, tree verification stays off.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

VEC_LAYOUT_ISAS = ("vec", "vec16")
_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32}


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


@numba.njit(cache=True, nogil=True, boundscheck=False)
def _move_slots_kernel(cache, src, dst, block_size, head_dim):
    """``cache [num_blocks, num_kv_heads, 2 * block_size * head_dim]`` (integers of the element width): K of slot s
    at ``d * block_size + offset``, V at ``block_size * head_dim + offset * head_dim + d``. All gathered, then
    scattered."""
    n, heads = src.size, cache.shape[1]
    v_base = block_size * head_dim
    keys = np.empty((n, heads, head_dim), cache.dtype)
    values = np.empty((n, heads, head_dim), cache.dtype)
    for i in range(n):
        block, offset = src[i] // block_size, src[i] % block_size
        for h in range(heads):
            row = cache[block, h]
            for d in range(head_dim):
                keys[i, h, d] = row[d * block_size + offset]
            start = v_base + offset * head_dim
            for d in range(head_dim):
                values[i, h, d] = row[start + d]
    for i in range(n):
        block, offset = dst[i] // block_size, dst[i] % block_size
        for h in range(heads):
            row = cache[block, h]
            for d in range(head_dim):
                row[d * block_size + offset] = keys[i, h, d]
            start = v_base + offset * head_dim
            for d in range(head_dim):
                row[start + d] = values[i, h, d]


def can_move_slots(kv_cache: torch.Tensor, isa: str, kv_cache_dtype: str = "auto") -> bool:
    """:func:`move_slots` reads this cache: a VEC layout, stored as the model dtype (16 or 32 bits), on the CPU."""
    return (isa in VEC_LAYOUT_ISAS and kv_cache_dtype == "auto" and kv_cache.device.type == "cpu"
            and kv_cache.element_size() in _SAME_WIDTH_INT and kv_cache.is_contiguous())


def move_slots(kv_cache: torch.Tensor, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
    """Copy the K/V at ``src_slots`` to ``dst_slots`` in place, bit for bit, gathering all first (a destination may
    be another move's source): what :func:`read_slots` then :func:`write_slots` do, in one call without vLLM's op.
    Only where :func:`can_move_slots`."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    flat = kv_cache.view(_SAME_WIDTH_INT[kv_cache.element_size()]).view(num_blocks, num_heads, -1)
    _move_slots_kernel(flat.numpy(), np.ascontiguousarray(src_slots, np.int64),
                       np.ascontiguousarray(dst_slots, np.int64), block_size, two_d // 2)


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
