"""The fast CPU tree path (attn.cpu_fast / attn.cpu_kernel) against vLLM's CPU kernel, the float64 reference and the
torch path; its fallback to the torch path (no engine)."""

import logging

import numpy as np
import pytest
import torch

from proposers_helpers import random_tree
from vllm_treespec.api import DraftTree
from vllm_treespec.tree import TreeBatch

pytest.importorskip("vllm")

HQ, HKV, D, BS = 9, 3, 64, 128  # SmolLM2-135M's geometry (GQA 3, vLLM's CPU block size)
SCALE = D ** -0.5


def _batch(dtype, contexts, trees, seed=0, query_stride_pad=True):
    """Random K/V written with vLLM's op into a shuffled paged cache, and a query shaped as the engine's (a strided
    view into a wider projection output)."""
    from vllm_treespec.attn import layout

    generator = torch.Generator().manual_seed(seed)
    lengths = [c + t.num_nodes + 1 for c, t in zip(contexts, trees)]
    blocks = [-(-n // BS) for n in lengths]
    num_blocks = sum(blocks) + 2
    kv_cache = torch.zeros(num_blocks, HKV, BS, 2 * D, dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_table = torch.zeros(len(trees) + 1, max(blocks) + 1, dtype=torch.int32)  # one extra (non-tree) batch row
    raw, q_start, total = [], [], 0
    used = 0
    for r, n in enumerate(blocks):
        block_table[r + 1, :n] = order[used:used + n].to(torch.int32)
        used += n
        positions = torch.arange(lengths[r])
        slots = block_table[r + 1, positions // BS].long() * BS + positions % BS
        k = torch.randn(lengths[r], HKV, D, generator=generator).to(dtype)
        v = torch.randn(lengths[r], HKV, D, generator=generator).to(dtype)
        layout.write_slots(kv_cache, slots, k, v, "vec")
        raw.append((k, v))
        q_start.append(total + 3)  # three rows of another request come first
        total += trees[r].num_nodes + 1
    wide = (2 * torch.randn(total + 3, HQ + 2 * HKV, D, generator=generator)).to(dtype)
    query = wide[:, :HQ] if query_stride_pad else wide[:, :HQ].contiguous()
    batch = TreeBatch.build(np.arange(1, len(trees) + 1), [str(i) for i in range(len(trees))], trees,
                            np.array(q_start), np.array(contexts))
    return kv_cache, block_table, query, batch, raw


def _reference(query, raw, batch, contexts, trees):
    from vllm_treespec.attn.reference import reference_tree_attention

    out = {}
    for r, (c, t) in enumerate(zip(contexts, trees)):
        k, v = raw[r]
        rows = query[batch.query_start[r]: batch.query_start[r] + t.num_nodes + 1]
        out[r] = reference_tree_attention(rows, k[:c], v[:c], k[c:], v[c:], t.parents, SCALE)
    return out


def _fast(dtype):
    from vllm_treespec.attn import cpu_fast

    fast = cpu_fast.decide("vec", dtype, BS, D, HKV, HQ)
    assert fast is not None
    return fast


@pytest.fixture
def one_thread():
    """vLLM's kernel splits a request's rows across OpenMP threads when it has several; the fast path follows its
    one-thread schedule (the CPU worker's), which is where bit-equality holds."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)  # torch.set_num_threads itself is a no-op once an in-process CPU worker has run
    yield
    torch._C.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_is_vllm_kernel_bit_for_bit_on_chains(dtype, one_thread):
    """Chains (every row sees the rows before it) are where vLLM's kernel and the tree path must agree: the start-up
    check finds the profile of the loaded vLLM build and requires equality, across a KV tile boundary too."""
    from vllm_treespec.attn import cpu_fast, cpu_kernel

    fast = _fast(dtype)
    assert fast.exact and fast.max_abs_diff == 0.0
    assert (fast.avx512, fast.rne) == cpu_fast.expected_profile()
    assert fast.vector_exp == (not fast.avx512 and cpu_kernel.vector_expf_agrees())
    # Independently of the check: a batch of chains of several widths and contexts, some over one KV tile.
    from vllm import _custom_ops as ops

    widths = [2, 5, 17, 33]  # root + nodes
    tile = cpu_kernel.kv_tile_length(17, HQ // HKV, D, torch.tensor([], dtype=dtype).element_size(), "vec")
    contexts = [0, 200, tile + 40, 700]
    trees = [DraftTree.chain(list(range(1, w))) for w in widths]
    kv_cache, block_table, query, batch, _ = _batch(dtype, contexts, trees)
    query_start = torch.tensor([0, 3] + [int(s + w) for s, w in zip(batch.query_start, widths)], dtype=torch.int32)
    seq_lens = torch.tensor([3] + [c + w for c, w in zip(contexts, widths)], dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=HQ, num_kv_heads=HKV, head_dim=D, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=True)
    key_cache, value_cache = kv_cache.view(kv_cache.shape[0], HKV, 2 * BS, D).chunk(2, dim=2)
    kernel_out = torch.zeros(query.shape[0], HQ * D, dtype=dtype)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=kernel_out, query_start_loc=query_start,
        seq_lens=seq_lens, scale=SCALE, causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    from vllm_treespec.attn.plan import build_plan

    plan = build_plan(batch, block_table, BS)
    out = torch.full_like(kernel_out, float("nan"))
    cpu_fast.attend(plan, query, kv_cache, out, SCALE, HQ, D, "vec", fast)
    rows = slice(3, None)
    assert torch.equal(out[rows], kernel_out[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_reference_and_torch_path_on_trees(dtype):
    from vllm_treespec.attn import cpu_fast, cpu_kernel
    from vllm_treespec.attn.cpu import tree_attention_cpu
    from vllm_treespec.attn.plan import build_plan

    rng = np.random.default_rng(3)
    tile = cpu_kernel.kv_tile_length(34, HQ // HKV, D, torch.tensor([], dtype=dtype).element_size(), "vec")
    contexts = [0, 5, 127, 300, tile + 77]
    trees = [random_tree(rng, n) for n in (3, 1, 12, 33, 16)]
    kv_cache, block_table, query, batch, raw = _batch(dtype, contexts, trees, seed=1)
    plan = build_plan(batch, block_table, BS)
    fast_out = torch.full((query.shape[0], HQ * D), float("nan"), dtype=dtype)
    cpu_fast.attend(plan, query, kv_cache, fast_out, SCALE, HQ, D, "vec", _fast(dtype))
    torch_out = torch.full_like(fast_out, float("nan"))
    tree_attention_cpu(plan, query, kv_cache, torch_out, SCALE, HQ, D)
    reference = _reference(query, raw, batch, contexts, trees)
    # fp32: both paths within float rounding of float64. bf16: inputs are the same bf16 values, accumulation is fp32,
    # so the error is within one bf16 ulp of the output: 2^-8 to 2^-7 of the value, by where it lies in its binade
    # (vLLM's kernel on AVX2 reaches one ulp at values just above a power of two; on AVX512 it stayed within 2^-8)
    tol = dict(atol=2e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=1e-5, rtol=2 ** -7)
    for r, t in enumerate(trees):
        rows = slice(int(batch.query_start[r]), int(batch.query_start[r]) + t.num_nodes + 1)
        got = fast_out[rows].view(-1, HQ, D).double()
        torch.testing.assert_close(got, reference[r], **tol)
        if dtype == torch.float32:
            torch.testing.assert_close(got, torch_out[rows].view(-1, HQ, D).double(), atol=2e-6, rtol=2e-6)
    assert fast_out[:3].isnan().all()  # rows of other requests are left alone


def test_vector_expf_is_libm_bit_for_bit():
    """The AVX2 profile's exponentials, 16 at a time, are libm's expf: on a sweep of every 61st float of the range a
    softmax sees (and of the tails, where the result underflows or overflows), bit for bit. (Every float of
    [-104, 89] agreed with glibc 2.36 when it was written.)"""
    import platform

    from vllm_treespec.attn import cpu_kernel

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the vector expf follows glibc's; elsewhere the kernel keeps libm's scalar expf")
    negative = np.arange(0x80000000, 0xC2D80000, 61, dtype=np.uint64).astype(np.uint32)  # -0.0 .. -108
    positive = np.arange(0, 0x42B80000, 61, dtype=np.uint64).astype(np.uint32)  # 0 .. 92
    x = np.concatenate([negative, positive]).view(np.float32)
    x = x[: x.size // 16 * 16]
    vector, libm = np.empty_like(x), np.empty_like(x)
    cpu_kernel._vector_and_libm_expf(x, vector, libm)
    differ = np.flatnonzero(vector.view(np.uint32) != libm.view(np.uint32))
    assert differ.size == 0, (x[differ[:5]], vector[differ[:5]], libm[differ[:5]])
    assert cpu_kernel.vector_expf_agrees()
    # step-cost curves are keyed by it: timed with scalar exponentials, they are timed again
    assert cpu_kernel.kernel_summary() == f"{cpu_kernel.KERNEL_VERSION} vector-expf"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_exponentials_change_no_output_bit(dtype):
    """The AVX2 profile with libm's exponentials 16 at a time and one at a time: the same outputs, on trees with
    masked positions, tails of every length and KV tiles whose max moves."""
    from vllm_treespec.attn import cpu_fast, cpu_kernel
    from vllm_treespec.attn.plan import build_plan

    rng = np.random.default_rng(5)
    elem = torch.tensor([], dtype=dtype).element_size()
    tile = cpu_kernel.kv_tile_length(34, HQ // HKV, D, elem, "vec")
    contexts = [0, 7, 129, 2 * tile + 3, tile + 77]
    trees = [random_tree(rng, n) for n in (3, 1, 12, 33, 16)]
    kv_cache, block_table, query, batch, _ = _batch(dtype, contexts, trees, seed=2)
    query = query * 4  # sharper softmaxes: maxes that move by more than 8 within a row
    plan = build_plan(batch, block_table, BS)
    outs = []
    for vector_exp in (False, True):
        out = torch.full((query.shape[0], HQ * D), float("nan"), dtype=dtype)
        cpu_fast.attend(plan, query, kv_cache, out, SCALE, HQ, D, "vec",
                        cpu_fast.FastPath(False, False, False, 0.0, vector_exp=vector_exp))
        outs.append(out)
    assert not outs[0][3:].isnan().any()  # rows 0-2 belong to no tree
    assert torch.equal(outs[0][3:], outs[1][3:])


def test_fast_path_gives_the_same_rows_for_both_query_layouts():
    """A contiguous query (a compiled engine's) gives what the eager engine's strided one does."""
    from vllm_treespec.attn import cpu_fast
    from vllm_treespec.attn.plan import build_plan

    rng = np.random.default_rng(5)
    trees = [random_tree(rng, 7)]
    outs = []
    for strided in (True, False):
        kv_cache, block_table, query, batch, _ = _batch(torch.float32, [50], trees, seed=2, query_stride_pad=strided)
        out = torch.zeros(query.shape[0], HQ * D)
        cpu_fast.attend(build_plan(batch, block_table, BS), query, kv_cache, out, SCALE, HQ, D, "vec",
                        _fast(torch.float32))
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


_LAYOUT_CHECK = """
import torch
from vllm_treespec.attn import cpu_fast, cpu_kernel
torch.set_num_threads(1)
assert cpu_fast.decide("vec", getattr(torch, "{dtype}"), 128, 64, 3, 9) is not None
print(sorted({{signature[0].layout for signature in cpu_kernel.tree_attention_rows.signatures}}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_check_compiles_the_kernel_for_both_query_layouts(dtype):
    """Numba compiles one kernel per query layout (eager engines hand it over strided, compiled ones contiguous): the
    check at start-up compiles both, so no first tree step compiles one (4.3 s on a Zen 1 core with a cold cache).
    A fresh process: its dispatcher holds only what that process compiled or loaded from the cache."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LAYOUT_CHECK.format(dtype=dtype)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['A', 'C']"


@pytest.mark.parametrize("dtype, isa, forced, reason", [
    (torch.float16, "vec", False, "float16"),
    (torch.float32, "amx", False, "'amx'"),
    (torch.float32, "vec", True, "VLLM_TREESPEC_CPU_TREE_PATH=torch"),
])
def test_unreadable_layout_falls_back_to_torch_path_with_one_log_line(dtype, isa, forced, reason, monkeypatch):
    from vllm_treespec.attn import cpu_fast
    from vllm_treespec.attn.cpu import tree_attention_cpu, tree_rows
    from vllm_treespec.attn.plan import build_plan

    key = (isa, dtype, BS, D, HKV, HQ, torch.get_num_threads())
    saved = cpu_fast._decisions.pop(key, None)
    if forced:
        monkeypatch.setenv(cpu_fast.FORCE_PATH_ENV, "torch")
    rng = np.random.default_rng(4)
    contexts = [20, 140]
    trees = [random_tree(rng, n) for n in (6, 11)]
    kv_cache, block_table, query, batch, raw = _batch(dtype, contexts, trees, seed=3)
    plan = build_plan(batch, block_table, BS)
    out = torch.zeros(query.shape[0], HQ * D, dtype=dtype)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("vllm.treespec")
    logger.addHandler(handler)
    try:
        for _ in range(3):  # three layers of the same geometry
            tree_rows(plan, query, kv_cache, out, SCALE, HQ, D, isa)
    finally:
        logger.removeHandler(handler)
        cpu_fast._decisions.pop(key, None)
        if saved is not None:
            cpu_fast._decisions[key] = saved
    lines = [rec.getMessage() for rec in records if "torch path" in rec.getMessage()]
    assert len(lines) == 1 and reason in lines[0]
    expected = torch.zeros_like(out)
    tree_attention_cpu(plan, query, kv_cache, expected, SCALE, HQ, D)
    assert torch.equal(out, expected)
    reference = _reference(query, raw, batch, contexts, trees)
    for r, t in enumerate(trees):
        rows = slice(int(batch.query_start[r]), int(batch.query_start[r]) + t.num_nodes + 1)
        torch.testing.assert_close(out[rows].view(-1, HQ, D).double(), reference[r], atol=2e-2, rtol=2e-2)


_BUILD_CHECK = """
import importlib, sys
import torch
try:
    importlib.import_module("vllm._C_{build}")  # registers torch.ops._C from this build only
except ImportError as exc:
    assert "export function" in str(exc), exc
import numpy as np
from vllm_treespec.attn import cpu_kernel
torch.set_num_threads(1)
ops = torch.ops._C
hq, hkv, d, bs, dtype = 9, 3, 64, 128, getattr(torch, "{dtype}")
widths, contexts = [5, 17], [300, cpu_kernel.kv_tile_length(17, 3, d, dtype.itemsize, "vec") + 50]
lengths = [c + w for c, w in zip(contexts, widths)]
blocks = [-(-n // bs) for n in lengths]
cache = torch.zeros(sum(blocks) + 1, hkv, bs, 2 * d, dtype=dtype)
kc, vc = cache.view(cache.shape[0], hkv, 2 * bs, d).chunk(2, dim=2)
table = torch.zeros(2, max(blocks), dtype=torch.int32)
table[0, :blocks[0]] = torch.arange(1, blocks[0] + 1)
table[1, :blocks[1]] = torch.arange(blocks[0] + 1, sum(blocks) + 1)
g = torch.Generator().manual_seed(0)
for r, n in enumerate(lengths):
    pos = torch.arange(n)
    ops.cpu_attn_reshape_and_cache(torch.randn(n, hkv, d, generator=g).to(dtype), torch.randn(n, hkv, d, generator=g)
                                   .to(dtype), kc, vc, table[r, pos // bs].long() * bs + pos % bs, "vec", 1.0, 1.0,
                                   "auto")
query = (2 * torch.randn(sum(widths), hq, d, generator=g)).to(dtype)
qsl = torch.tensor([0, widths[0], sum(widths)], dtype=torch.int32)
seq = torch.tensor(lengths, dtype=torch.int32)
md = ops.get_scheduler_metadata(2, hq, hkv, d, seq, dtype, qsl, True, -1, "vec", True, None, "auto")
ref = torch.empty(sum(widths), hq * d, dtype=dtype)
ops.cpu_attention_with_kv_cache(query, kc, vc, ref, qsl, seq, d ** -0.5, True, None, -1, table, 0.0, md, None, None,
                                1.0, 1.0, "auto")
anc = np.zeros((2, 17, 17), np.bool_)
for r, w in enumerate(widths):
    anc[r, :w, :w] = np.tril(np.ones((w, w), np.bool_))
tiles = np.array([cpu_kernel.kv_tile_length(w, 3, d, dtype.itemsize, "vec") for w in widths], np.int64)
out = torch.zeros_like(ref)
view = (lambda t: t.view(torch.uint16).numpy()) if dtype == torch.bfloat16 else (lambda t: t.numpy())
cpu_kernel.run(view(query), view(cache.view(cache.shape[0], hkv, -1)), view(out.view(-1, hq, d)),
               np.array([0, widths[0]]), np.array(widths), np.array(contexts), table.numpy(), anc, tiles, d ** -0.5,
               bs, {avx512}, {rne}, {vector_exp})
print("EQUAL" if torch.equal(out, ref) else "DIFFER %g" % (out.float() - ref.float()).abs().max())
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("build, avx512, rne, vector_exp", [("AVX2", False, False, False),
                                                            ("AVX2", False, False, True),
                                                            ("AVX512", True, False, False)])
def test_profiles_match_the_other_vllm_builds(build, avx512, rne, vector_exp, dtype):
    """vLLM ships three x86 builds; the one this CPU loads is checked above. The others load in a fresh process (each
    registers the same ops) and must equal the fast path's profile for them, bit for bit."""
    import subprocess
    import sys

    if build == "AVX512" and not torch.cpu._is_avx512_supported():
        pytest.skip("this CPU cannot run vLLM's AVX-512 build")
    code = _BUILD_CHECK.format(build=build, dtype=dtype, avx512=avx512, rne=rne, vector_exp=vector_exp)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.stdout.strip().endswith("EQUAL"), result.stdout[-2000:] + result.stderr[-3000:]


# --- KV compaction on the CPU cache -----------------------------------------------------------------------------------

def _filled_cache(isa, dtype, block_size, num_blocks=6, heads=2, head_dim=32, seed=0):
    from vllm_treespec.attn import layout

    generator = torch.Generator().manual_seed(seed)
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.arange(num_blocks * block_size)
    layout.write_slots(cache, slots, torch.randn(slots.numel(), heads, head_dim, generator=generator).to(dtype),
                       torch.randn(slots.numel(), heads, head_dim, generator=generator).to(dtype), isa)
    return cache


MOVES = {  # (source slots, destination slots)
    "one": ([40], [3]),
    "across blocks": ([17, 33, 50, 95], [16, 17, 18, 19]),  # 17 is a destination and, first, a source
    "swap": ([5, 9], [9, 5]),
}


@pytest.mark.parametrize("moves", MOVES)
@pytest.mark.parametrize("isa,block_size", [("vec", 32), ("vec16", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_slots_is_read_then_vllms_write(moves, isa, block_size, dtype):
    """layout.move_slots (in place, numba) leaves the cache's bytes as reading the slots through the adapter and
    writing them back with vLLM's cache-write op do."""
    from vllm_treespec.attn import layout

    if not layout.self_check(isa, dtype, block_size, 32, 2):
        pytest.skip(f"vLLM's CPU cache-write op does not support {isa}/{dtype} here")
    src, dst = (torch.tensor(m, dtype=torch.int64) for m in MOVES[moves])
    cache = _filled_cache(isa, dtype, block_size)
    expected = cache.clone()
    key, value = layout.read_slots(expected, src)
    layout.write_slots(expected, dst, key, value, isa)
    assert layout.can_move_slots(cache, isa)
    layout.move_slots(cache, src.numpy(), dst.numpy())
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


def test_compact_layers_moves_every_cpu_layer_in_place_or_through_vllms_op():
    from types import SimpleNamespace

    from vllm_treespec.attn import layout
    from vllm_treespec.attn.compact import compact_layers

    src, dst = (torch.tensor(m, dtype=torch.int64) for m in MOVES["across blocks"])

    def cpu_layer(kv_cache_dtype, seed):
        impl = SimpleNamespace(kv_cache_dtype=kv_cache_dtype)  # no compact_tree_kv: the CPU backend's impl
        return SimpleNamespace(kv_cache=_filled_cache("vec", torch.bfloat16, 32, seed=seed), impl=impl, isa="vec",
                               _k_scale_float=1.0, _v_scale_float=1.0)

    layers = [cpu_layer("auto", 0), cpu_layer("auto", 1)]
    expected = []
    for layer in layers:
        cache = layer.kv_cache.clone()
        key, value = layout.read_slots(cache, src)
        layout.write_slots(cache, dst, key, value, "vec")
        expected.append(cache)
    compact_layers(layers, src, dst)
    assert all(torch.equal(layer.kv_cache, e) for layer, e in zip(layers, expected))
    assert not layout.can_move_slots(layers[0].kv_cache, "vec", "fp8_e4m3")  # vLLM's op converts: not in place
    assert not layout.can_move_slots(layers[0].kv_cache, "amx")


def test_a_layer_without_tree_rows_is_vllms_forward_alone(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_treespec.attn import cpu

    calls = []

    def vllm_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                     output_block_scale=None):
        calls.append(attn_metadata)
        return output.fill_(1.0)

    def no_tree_rows(*args, **kwargs):
        raise AssertionError("tree rows written on a step without trees")

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", vllm_forward)
    monkeypatch.setattr(cpu.TreeCPUAttentionImpl, "_tree_rows", no_tree_rows)
    impl = cpu.TreeCPUAttentionImpl.__new__(cpu.TreeCPUAttentionImpl)
    impl.attn_type = AttentionType.DECODER
    before = dict(cpu.stats)
    output = torch.zeros(2, 4)
    plain = SimpleNamespace(num_actual_tokens=2)  # a step without trees: no tree_plan at all
    assert impl.forward(None, output, None, None, None, plain, output) is output and bool((output == 1).all())
    impl.attn_type = AttentionType.ENCODER_ONLY  # a plan never reaches a non-decoder layer
    impl.forward(None, output, None, None, None, SimpleNamespace(tree_plan=object(), num_actual_tokens=2), output)
    assert len(calls) == 2 and cpu.stats == before  # the tree timers count tree steps only
