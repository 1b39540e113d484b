"""The fast CPU tree path: when to use it, and one call per layer.

:func:`decide` runs once per layer geometry (ISA, dtype, block size, head size, head counts). It writes a small
chain-shaped batch into a cache with vLLM's own cache-write op, runs vLLM's attention kernel on it, and runs
:func:`~vllm_treespec.attn.cpu_kernel.tree_attention_rows` on the same rows: a chain is a tree whose rows see the same
positions as the kernel's causal rows, so the two must agree. The arithmetic profile of the vLLM build this process
loaded (:func:`expected_profile`) is tried first, then the others; the first that agrees bit for bit is used.

When none does, the closest one is used if it stays within :data:`TOLERANCE`. That is the case on a build or ISA
whose arithmetic we do not follow, and with several OpenMP threads: vLLM's scheduler then splits a request's rows
(and, for a single row, its context) across threads, which changes its own tiling, while the fast path keeps the
one-thread schedule (the CPU worker's, where it is bit-exact). Otherwise, or when the layout cannot be read at all
(an ISA we do not know, fp16), the layer keeps the torch path (:func:`vllm_treespec.attn.cpu.tree_attention_cpu`),
with one log line per geometry.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from vllm_treespec.attn import cpu_kernel, layout
from vllm_treespec.attn.plan import TreeAttentionPlan

logger = logging.getLogger("vllm.treespec")

FAST_DTYPES = (torch.float32, torch.bfloat16)
# Largest |fast - vLLM| accepted when no profile is bit-exact: a few ulps of the output dtype around outputs of ~1.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}
PROFILES = ((True, True), (True, False), (False, False))  # (avx512, rne)
# "torch": every layer takes the torch path (A/B comparisons, debugging).
FORCE_PATH_ENV = "VLLM_TREESPEC_CPU_TREE_PATH"


@dataclass(frozen=True)
class FastPath:
    avx512: bool
    rne: bool
    exact: bool  # bit-identical to vLLM's kernel on the check batch
    max_abs_diff: float
    #: the AVX2 profile's exponentials 16 at a time, where they agree with libm (cpu_kernel.vector_expf_agrees)
    vector_exp: bool = False


_decisions: dict[tuple, FastPath | None] = {}


def expected_profile() -> tuple[bool, bool]:
    """The arithmetic of the vLLM build that ``vllm.platforms.cpu.CpuPlatform.import_kernels`` loads on this CPU:
    ``vllm._C`` (AVX-512 + AVX512-BF16), ``vllm._C_AVX512`` or ``vllm._C_AVX2``."""
    if not torch.cpu._is_avx512_supported():
        return False, False
    return True, bool(torch.cpu._is_avx512_bf16_supported())


def decide(isa: str, dtype: torch.dtype, block_size: int, head_size: int, num_kv_heads: int,
           num_heads: int) -> FastPath | None:
    """The fast path for this layer geometry, or None for the torch path (logged once per geometry)."""
    key = (isa, dtype, block_size, head_size, num_kv_heads, num_heads, torch.get_num_threads())
    if key not in _decisions:
        fast, reason = _check(*key[:-1])
        _decisions[key] = fast
        if fast is None:
            logger.warning("vllm_treespec: tree rows of %s layers (ISA %s, block %d, head size %d) use the torch "
                           "path: %s", str(dtype).removeprefix("torch."), isa, block_size, head_size, reason)
        elif not fast.exact:
            logger.warning("vllm_treespec: fast tree attention differs from vLLM's CPU kernel by up to %.3g on a chain "
                           "(ISA %s, %s); using it", fast.max_abs_diff, isa, str(dtype).removeprefix("torch."))
    return _decisions[key]


def _check(isa: str, dtype: torch.dtype, block_size: int, head_size: int, num_kv_heads: int,
           num_heads: int) -> tuple[FastPath | None, str]:
    if os.environ.get(FORCE_PATH_ENV) == "torch":
        return None, f"{FORCE_PATH_ENV}=torch"
    if dtype not in FAST_DTYPES:
        return None, f"the fast path reads float32 and bfloat16 caches, not {dtype}"
    if isa not in layout.VEC_LAYOUT_ISAS:
        return None, f"the fast path reads the VEC cache layouts {layout.VEC_LAYOUT_ISAS}, not {isa!r}"
    if head_size % 16 or block_size % 16:
        return None, f"head size {head_size} and block size {block_size} must be multiples of 16"
    try:
        reference, run = _check_batch(isa, dtype, block_size, head_size, num_kv_heads, num_heads)
    except Exception as exc:  # noqa: BLE001 - a layout or op we cannot drive means "cannot read"
        return None, f"the read-back check could not run ({type(exc).__name__}: {exc})"
    order = [expected_profile()] + [p for p in PROFILES if p != expected_profile()]
    # the AVX2 profile computes libm's exponentials 16 at a time where that gives libm's bits (the same outputs, the
    # softmax ~2x cheaper); checked here like any profile, which also compiles it before the first tree step
    candidates = [(avx512, rne, vector) for avx512, rne in order
                  for vector in ((True, False) if not avx512 and cpu_kernel.vector_expf_agrees() else (False,))]
    chosen: FastPath | None = None
    best: tuple[FastPath, torch.Tensor] | None = None
    for avx512, rne, vector_exp in candidates:
        try:
            got = run(avx512, rne, vector_exp)
        except Exception as exc:  # noqa: BLE001
            return None, f"the fast kernel failed on the check batch ({type(exc).__name__}: {exc})"
        diff = float((got.float() - reference.float()).abs().max())
        if torch.equal(got, reference):
            chosen = FastPath(avx512, rne, True, 0.0, vector_exp)
            break
        if best is None or diff < best[0].max_abs_diff:
            best = FastPath(avx512, rne, False, diff, vector_exp), got
    else:  # no profile was exact (there is always one to try: the expected profile)
        if best[0].max_abs_diff > TOLERANCE[dtype]:
            return None, (f"it differs from vLLM's kernel by {best[0].max_abs_diff:.3g} on a chain (more than "
                          f"{TOLERANCE[dtype]:g})")
        chosen, got = best
    # Eager engines hand the query over strided, compiled ones contiguous, and Numba compiles one kernel per layout:
    # both compile here, not inside the first tree step (4.3 s of it on a Zen 1 core with a cold cache)
    try:
        contiguous = run(chosen.avx512, chosen.rne, chosen.vector_exp, contiguous_query=True)
    except Exception as exc:  # noqa: BLE001
        return None, f"the fast kernel failed on a contiguous query ({type(exc).__name__}: {exc})"
    if not torch.equal(contiguous, got):
        return None, "its output depends on the query's memory layout"
    return chosen, ""


def _check_batch(isa: str, dtype: torch.dtype, block_size: int, head_size: int, num_kv_heads: int, num_heads: int):
    """A chain-shaped batch in a cache written by vLLM's op: vLLM's kernel output on it, and a runner of ours."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    q_per_kv = num_heads // num_kv_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    widths = [4, 9]
    tile = cpu_kernel.kv_tile_length(widths[1], q_per_kv, head_size, elem, isa)
    contexts = [37, tile + block_size // 2 + 3]  # the second crosses a KV tile boundary
    lengths = [c + w for c, w in zip(contexts, widths)]
    blocks = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks) + 1
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_table = torch.zeros(len(widths), max(blocks), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks):
        block_table[r, :n] = order[used:used + n].to(torch.int32)
        used += n
    for r, n in enumerate(lengths):
        positions = torch.arange(n)
        slots = block_table[r, positions // block_size].long() * block_size + positions % block_size
        key = torch.randn(n, num_kv_heads, head_size, generator=generator).to(dtype)
        value = torch.randn(n, num_kv_heads, head_size, generator=generator).to(dtype)
        layout.write_slots(cache, slots, key, value, isa)
    # The query as an eager engine hands it over: a strided view into the fused QKV projection.
    qkv = (2 * torch.randn(sum(widths), num_heads + 2 * num_kv_heads, head_size, generator=generator)).to(dtype)
    query = qkv[:, :num_heads]
    query_start = torch.tensor([0, widths[0], sum(widths)], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_size ** -0.5
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(widths), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)
    reference = torch.empty(sum(widths), num_heads * head_size, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=reference, query_start_loc=query_start,
        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    width = max(widths)
    ancestors = np.zeros((len(widths), width, width), np.bool_)
    for r, w in enumerate(widths):
        ancestors[r, :w, :w] = np.tril(np.ones((w, w), np.bool_))
    plan = TreeAttentionPlan(batch=None, block_table=block_table, block_size=block_size,
                             q_start=query_start[:-1].numpy().astype(np.int64), num_rows=np.array(widths, np.int64),
                             context_len=np.array(contexts, np.int64), block_rows=block_table.numpy(),
                             ancestors=ancestors)

    def run(avx512: bool, rne: bool, vector_exp: bool, contiguous_query: bool = False) -> torch.Tensor:
        output = torch.full_like(reference, float("nan"))
        attend(plan, query.contiguous() if contiguous_query else query, cache, output, scale, num_heads, head_size,
               isa, FastPath(avx512, rne, False, 0.0, vector_exp))
        return output

    return reference, run


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view (bf16 as its uint16 bits)."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.numpy()


def cache_array(kv_cache: torch.Tensor) -> np.ndarray:
    """The numpy view :func:`attend` reads a layer's cache through, ``[num_blocks, num_kv_heads, 2 * bs * D]``."""
    return as_numpy(kv_cache.view(kv_cache.shape[0], kv_cache.shape[1], -1))


def attend(plan: TreeAttentionPlan, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, scale: float,
           num_heads: int, head_size: int, isa: str, fast: FastPath, cache: np.ndarray | None = None) -> None:
    """Write the attention of every tree row of ``plan`` into ``output`` (one kernel call). ``cache``: the layer's
    :func:`cache_array`, if the caller keeps it."""
    geometry = (num_heads // kv_cache.shape[1], head_size, kv_cache.element_size(), isa)
    tiles = plan.kv_tiles.get(geometry)
    if tiles is None:
        tiles = np.array([cpu_kernel.kv_tile_length(int(n), *geometry) for n in plan.num_rows], np.int64)
        plan.kv_tiles[geometry] = tiles
    cpu_kernel.run(as_numpy(query.view(-1, num_heads, head_size)), cache_array(kv_cache) if cache is None else cache,
                   as_numpy(output.view(-1, num_heads, head_size)), plan.q_start, plan.num_rows, plan.context_len,
                   plan.block_rows, plan.ancestors, tiles, scale, kv_cache.shape[2], fast.avx512, fast.rne,
                   fast.vector_exp)
