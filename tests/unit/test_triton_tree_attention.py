"""The CUDA tree path, checked on CPU tensors: the Triton tree kernel (under Triton's interpreter) against the float64
reference, the FLASH_ATTN glue with a torch stand-in for FlashAttention, the CUDA-graph dispatch patch, and KV
compaction on the logical cache view against the CPU backend's own path.

The interpreter only takes effect if ``TRITON_INTERPRET=1`` is set before triton is first imported, and other tests
import it (through vLLM) earlier in the same process; so every check that runs the kernel runs in one subprocess
(this file run as a script), and the parametrized tests read its results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# name -> (dtype, layout, group, num_kv_heads, head_dim, block_size, [(context_len, num_nodes, shape), ...])
KERNEL_CASES = {
    "random_fp32_gqa1_nhd": ("float32", "nhd", 1, 2, 32, 16, [(37, 9, "random"), (5, 20, "random"), (1, 3, "random")]),
    "random_fp32_gqa1_flash": ("float32", "flash", 1, 2, 32, 16, [(37, 9, "random"), (0, 6, "random")]),
    "random_fp32_gqa4_nhd": ("float32", "nhd", 4, 2, 40, 8, [(50, 12, "random"), (17, 5, "random")]),
    "random_fp32_gqa4_flash": ("float32", "flash", 4, 2, 32, 16, [(23, 15, "random"), (64, 2, "random")]),
    "random_fp32_gqa8_nhd": ("float32", "nhd", 8, 1, 32, 16, [(40, 10, "random"), (3, 17, "random")]),
    "random_fp32_gqa8_flash": ("float32", "flash", 8, 2, 16, 32, [(70, 7, "random")]),
    "wide_fp32_two_words": ("float32", "flash", 1, 1, 16, 16, [(100, 70, "random")]),
    "w1_root_only": ("float32", "nhd", 4, 2, 32, 16, [(30, 0, "random"), (9, 0, "random")]),
    "chains_fp32": ("float32", "flash", 4, 2, 32, 16, [(45, 8, "chain"), (12, 16, "chain")]),
    "random_fp16_gqa4": ("float16", "flash", 4, 2, 32, 16, [(60, 13, "random"), (20, 6, "chain")]),
    "random_fp16_gqa8_nhd": ("float16", "nhd", 8, 1, 64, 16, [(33, 11, "random")]),
    # split-KV (SPLITS): contexts longer and shorter than the splits, none at all, two ancestor words
    "split4_fp32_gqa4_nhd": ("float32", "nhd", 4, 2, 32, 16, [(200, 9, "random"), (3, 5, "random"),
                                                              (0, 4, "chain")]),
    "split3_fp32_two_words": ("float32", "flash", 1, 1, 16, 16, [(130, 70, "random")]),
    "split7_fp16_gqa8_flash": ("float16", "flash", 8, 1, 32, 16, [(150, 20, "random"), (64, 1, "random")]),
    # a tree of 50 rows x 4 heads after 8,200 tokens: the wide launch (two 32-row tiles of its request, two words)
    "wide_launch_fp32_gqa4": ("float32", "flash", 4, 1, 32, 16, [(8200, 49, "random"), (5, 3, "chain")]),
}
#: cases with a tree of >= 192 (row, head) pairs and a context of >= 8192: plan_for_step launches them wide
WIDE_LAUNCH_CASES = {"wide_launch_fp32_gqa4"}
#: cases run with the context split over this many programs (the rest: one, as on CPU by default)
SPLITS = {"split4_fp32_gqa4_nhd": 4, "split3_fp32_two_words": 3, "split7_fp16_gqa8_flash": 7}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}
SENTINEL = 7.0


def random_parents(rng: np.random.Generator, num_nodes: int, shape: str) -> np.ndarray:
    if shape == "chain":
        return np.arange(-1, num_nodes - 1, dtype=np.int32)
    return np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, num_nodes)], np.int32)[:num_nodes]


def make_case(dtype: str, layout: str, group: int, num_kv_heads: int, head_dim: int, block_size: int,
              requests: list, seed: int = 0) -> SimpleNamespace:
    """A batch where every tree request follows a non-tree request (a chain/prefill of 0-3 rows), a paged cache with
    shuffled blocks whose unused slots hold NaN (a read of them would poison the output), and random queries."""
    from vllm_treespec.api import DraftTree
    from vllm_treespec.attn.compact import flash_kv_views
    from vllm_treespec.tree import TreeBatch

    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    num_heads = group * num_kv_heads
    trees, rows, query_start, contexts = [], [], [], []
    num_tokens, batch_row = 0, 0
    for context_len, num_nodes, shape in requests:
        num_tokens += int(rng.integers(0, 4))  # the non-tree request before it
        batch_row += 1
        parents = random_parents(rng, num_nodes, shape)
        trees.append(DraftTree(np.arange(num_nodes, dtype=np.int64), parents))
        rows.append(batch_row)
        query_start.append(num_tokens)
        contexts.append(context_len)
        num_tokens += num_nodes + 1
        batch_row += 1
    num_tokens += 2
    batch = TreeBatch.build(rows, [f"r{i}" for i in range(len(trees))], trees, query_start, contexts)

    blocks_per_row = max(-(-(c + n + 1) // block_size) for c, n, _ in requests) + 1
    num_blocks = batch_row * blocks_per_row + 3
    block_table = torch.randperm(num_blocks)[: batch_row * blocks_per_row].view(batch_row, blocks_per_row)
    block_table = block_table.to(torch.int32)
    kv_cache = None
    if layout == "flash":  # vLLM's FLASH_ATTN cache [blocks, kv_heads, block_size, 2 * head_dim], split as FA does
        kv_cache = torch.full((num_blocks, num_kv_heads, block_size, 2 * head_dim), float("nan"), dtype=torch_dtype)
        key_cache, value_cache = flash_kv_views(kv_cache, head_dim)
    else:  # separate contiguous [blocks, block_size, kv_heads, head_dim] caches
        key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch_dtype)
        value_cache = torch.full_like(key_cache, float("nan"))
    per_request = []
    for r, tree in enumerate(trees):
        length = contexts[r] + tree.num_nodes + 1
        positions = torch.arange(length)
        blocks = block_table[rows[r]].long()[positions // block_size]
        offsets = positions % block_size
        keys = torch.randn(length, num_kv_heads, head_dim).to(torch_dtype)
        values = torch.randn(length, num_kv_heads, head_dim).to(torch_dtype)
        key_cache[blocks, offsets] = keys
        value_cache[blocks, offsets] = values
        per_request.append((keys, values))
    query = torch.randn(num_tokens, num_heads, head_dim).to(torch_dtype)
    return SimpleNamespace(batch=batch, trees=trees, contexts=contexts, query=query, kv_cache=kv_cache,
                           key_cache=key_cache,
                           value_cache=value_cache, block_table=block_table, per_request=per_request,
                           scale=head_dim ** -0.5, group=group, num_heads=num_heads, head_dim=head_dim)


def reference_rows(case: SimpleNamespace) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(query_start, float64 output [W, Hq, D], float64 LSE [W, Hq]) of every tree request."""
    from vllm_treespec.attn.reference import reference_tree_attention

    out = []
    for r, tree in enumerate(case.trees):
        c, w, start = case.contexts[r], tree.num_nodes + 1, int(case.batch.query_start[r])
        keys, values = case.per_request[r]
        query = case.query[start: start + w]
        expected = reference_tree_attention(query, keys[:c], values[:c], keys[c:], values[c:], tree.parents,
                                            case.scale)
        visible = torch.cat([torch.ones(w, c, dtype=torch.bool),
                             torch.from_numpy(case.batch.mask[r, :w, :w].copy())], dim=1)  # [W, C + W]
        key_heads = keys.double().repeat_interleave(case.group, dim=1)  # [C + W, Hq, D]
        scores = torch.einsum("whd,khd->hwk", query.double(), key_heads) * case.scale
        lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1).T  # [W, Hq]
        out.append((start, expected, lse))
    return out


def run_kernel_case(name: str) -> dict:
    from vllm_treespec.attn.triton_tree import plan_for_step, tree_attention

    case = make_case(*KERNEL_CASES[name])
    kernel_plan = plan_for_step(case.batch, case.group)  # as an engine's step builds it
    output = torch.full_like(case.query, SENTINEL)
    output, lse = tree_attention(case.query, case.key_cache, case.value_cache, case.block_table, kernel_plan,
                                 case.scale, output=output, num_splits=SPLITS.get(name))
    return {**compare(case, output, lse), "launch": list(kernel_plan.launch),
            "rows_per_tile": kernel_plan.rows_per_tile}


def compare(case: SimpleNamespace, output: torch.Tensor, lse: torch.Tensor | None) -> dict:
    tree_row = torch.zeros(output.shape[0], dtype=torch.bool)
    out_error = lse_error = 0.0
    row = 0
    for start, expected, expected_lse in reference_rows(case):
        w = expected.shape[0]
        tree_row[start: start + w] = True
        out_error = max(out_error, (output[start: start + w].double() - expected).abs().max().item())
        if lse is not None:
            lse_error = max(lse_error, (lse[row: row + w].double() - expected_lse).abs().max().item())
        row += w
    return {"output_error": out_error, "lse_error": lse_error,
            "others_untouched": bool((output[~tree_row] == SENTINEL).all()), "finite": bool(output.isfinite().all())}


def run_flash_glue() -> dict:
    """TreeFlashAttentionImpl.forward / the builder with FlashAttention replaced by a stand-in that fills SENTINEL."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadataBuilder

    from vllm_treespec.attn import flash, plan

    case = make_case("float32", "flash", 4, 2, 32, 16, [(29, 10, "random"), (6, 4, "chain")], seed=3)
    calls = []

    def flash_stand_in(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                       output_block_scale=None):
        calls.append(query.shape)
        return output.fill_(SENTINEL)

    def build_stand_in(self, common_prefix_len, common_attn_metadata, fast_build=False):
        return SimpleNamespace(block_table=common_attn_metadata.block_table_tensor)

    original_forward, original_build = FlashAttentionImpl.forward, FlashAttentionMetadataBuilder.build
    FlashAttentionImpl.forward, FlashAttentionMetadataBuilder.build = flash_stand_in, build_stand_in
    try:
        builder = flash.TreeFlashAttentionMetadataBuilder.__new__(flash.TreeFlashAttentionMetadataBuilder)
        builder.num_heads_q, builder.num_heads_kv = case.num_heads, case.num_heads // case.group
        impl = flash.TreeFlashAttentionImpl.__new__(flash.TreeFlashAttentionImpl)
        impl.num_heads, impl.head_size, impl.scale = case.num_heads, case.head_dim, case.scale
        common = SimpleNamespace(block_table_tensor=case.block_table)
        plan.publish(case.batch)
        first, second = builder.build(0, common), builder.build(0, common)
        output = torch.empty(case.query.shape[0], case.num_heads * case.head_dim)
        query = case.query.reshape(case.query.shape[0], -1)
        result = impl.forward(None, query, None, None, case.kv_cache, first, output)
        tree = compare(case, result.view_as(case.query), None)
        plan.publish(None)
        chain_metadata = builder.build(0, common)
        chain_output = impl.forward(None, query, None, None, case.kv_cache, chain_metadata, torch.empty_like(output))
    finally:
        FlashAttentionImpl.forward, FlashAttentionMetadataBuilder.build = original_forward, original_build
        plan.publish(None)
    return {**tree, "plan_shared": first.tree_kernel_plan is second.tree_kernel_plan,
            "result_is_output": result is output, "stand_in_calls": len(calls),
            "chain_plan_none": chain_metadata.tree_kernel_plan is None,
            "chain_all_stand_in": bool((chain_output == SENTINEL).all())}


# --- tests that run the kernel: one interpreter subprocess ------------------------------------------------------------

@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_tree_kernel_matches_reference(interpreter_results, name):
    result = interpreter_results[name]
    tolerance = TOLERANCE[KERNEL_CASES[name][0]]
    assert result["finite"], result
    assert result["output_error"] <= tolerance, result
    assert result["lse_error"] <= tolerance, result
    assert result["others_untouched"], result


def test_launch_goes_wide_only_for_trees_that_fill_a_wide_tile(interpreter_results):
    """Both launch configurations were checked against the reference above: the step's widest tree picks one."""
    from vllm_treespec.attn.triton_tree import DEFAULT_LAUNCH, WIDE_TREE_LAUNCH, launch_config

    for name in KERNEL_CASES:
        wide = name in WIDE_LAUNCH_CASES
        assert interpreter_results[name]["launch"] == list(WIDE_TREE_LAUNCH if wide else DEFAULT_LAUNCH), name
    assert interpreter_results["wide_launch_fp32_gqa4"]["rows_per_tile"] == 32  # 128 pairs of 4 heads
    assert interpreter_results["random_fp32_gqa8_nhd"]["rows_per_tile"] == 8  # 18 rows of 8 heads, short contexts
    # Llama-3-8B's 4 query heads per KV head: 48 rows over 8k tokens go wide; 47 rows, or a 8,191-token context, not
    assert launch_config(48, 4, 8192) == WIDE_TREE_LAUNCH
    assert launch_config(47, 4, 8192) == DEFAULT_LAUNCH and launch_config(48, 4, 8191) == DEFAULT_LAUNCH
    assert launch_config(191, 1, 1 << 20) == DEFAULT_LAUNCH and launch_config(192, 1, 8192) == WIDE_TREE_LAUNCH


def test_split_kv_fills_the_device_only_where_the_programs_are_too_few():
    from vllm_treespec.attn.triton_tree import MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_num_splits

    # one request, 8 KV heads, 4k context on 132 multiprocessors: 33 splits wanted, 8 of 512 keys allowed
    assert choose_num_splits(8, 4096, 132) == 4096 // MIN_KEYS_PER_SPLIT == 8
    assert choose_num_splits(8, 32768, 132) == 33
    assert choose_num_splits(64, 32768, 132) == 5  # eight requests
    assert choose_num_splits(1, 1 << 20, 132) == MAX_SPLITS
    # a program per multiprocessor already, or a context too short to split
    assert choose_num_splits(132, 32768, 132) == 1
    assert choose_num_splits(8, 1000, 132) == 1
    assert choose_num_splits(8, 0, 132) == 1


def test_flash_impl_overwrites_only_tree_rows(interpreter_results):
    result = interpreter_results["flash_glue"]
    assert result["stand_in_calls"] == 2  # FlashAttention ran first for every row, tree step and chain step
    assert result["result_is_output"] and result["plan_shared"] and result["chain_plan_none"]
    assert result["output_error"] <= 1e-5 and result["finite"], result
    assert result["others_untouched"], result  # chain / prefill rows keep FlashAttention's result
    assert result["chain_all_stand_in"]



# --- in-process tests (pure torch) --------------------------------------------------------------------------------------

def test_tree_step_never_dispatches_a_full_cudagraph():
    """vLLM's own dispatch logic on a dispatcher with one FULL (uniform decode) and one PIECEWISE key for 16 tokens."""
    from dataclasses import replace

    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from vllm_treespec.attn import plan
    from vllm_treespec.patches import ORIGINALS, cudagraph_dispatcher

    dispatcher = CudagraphDispatcher.__new__(CudagraphDispatcher)
    dispatcher.keys_initialized = True
    dispatcher.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    dispatcher.compilation_config = SimpleNamespace(max_cudagraph_capture_size=32)
    dispatcher.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8), lora_config=None)
    dispatcher.specialize_lora_count = False
    dispatcher.uniform_decode_query_len = 4
    dispatcher._bs_to_padded_graph_size = list(range(33))
    full_key = dispatcher._create_padded_batch_descriptor(16, True, False, 0)
    dispatcher.cudagraph_keys = {CUDAGraphMode.FULL: {full_key},
                                 CUDAGraphMode.PIECEWISE: {replace(full_key, num_reqs=None, uniform=False)}}
    already_patched = (CudagraphDispatcher, "dispatch") in ORIGINALS
    assert dispatcher.dispatch(16, uniform_decode=True)[0] == CUDAGraphMode.FULL  # vLLM's choice for this batch
    cudagraph_dispatcher.install()
    try:
        assert CudagraphDispatcher.dispatch.__vllm_treespec_original__ is ORIGINALS[(CudagraphDispatcher, "dispatch")]
        assert dispatcher.dispatch(16, uniform_decode=True)[0] == CUDAGraphMode.FULL  # chain step: unchanged
        plan.publish(SimpleNamespace(num_reqs=2))
        mode, descriptor = dispatcher.dispatch(16, uniform_decode=True)
        assert mode == CUDAGraphMode.PIECEWISE and not descriptor.uniform
        assert dispatcher.dispatch(16, True, invalid_modes={CUDAGraphMode.FULL})[0] == CUDAGraphMode.PIECEWISE
        assert dispatcher.dispatch(16, True, valid_modes={CUDAGraphMode.NONE})[0] == CUDAGraphMode.NONE
        assert dispatcher.dispatch(20)[0] == CUDAGraphMode.NONE  # no key for 20 tokens: eager, as vLLM decides
        plan.publish(SimpleNamespace(num_reqs=0))
        assert dispatcher.dispatch(16, uniform_decode=True)[0] == CUDAGraphMode.FULL
    finally:
        plan.publish(None)
        if not already_patched:
            CudagraphDispatcher.dispatch = ORIGINALS.pop((CudagraphDispatcher, "dispatch"))


def test_flash_overrides_keep_vllm_signatures():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadataBuilder

    from vllm_treespec.attn import flash

    import inspect
    for owner, name in ((FlashAttentionImpl, "forward"), (FlashAttentionMetadataBuilder, "build")):
        assert tuple(inspect.signature(vars(owner)[name]).parameters) == flash.OVERRIDDEN_SIGNATURES[name]
    backend = flash.TreeFlashAttentionBackend
    assert backend.get_name() == "FLASH_ATTN"
    assert issubclass(backend.get_impl_cls(), FlashAttentionImpl)
    assert issubclass(backend.get_builder_cls(), FlashAttentionMetadataBuilder)


def cpu_vec_logical_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU VEC layout (attn/layout.py: K column-major, V row-major per block and head) as strided logical views."""
    num_blocks, num_heads, block_size, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.view(num_blocks, num_heads, 2 * block_size * d)
    keys = flat[..., : block_size * d].unflatten(-1, (d, block_size)).permute(0, 3, 1, 2)
    values = flat[..., block_size * d:].unflatten(-1, (block_size, d)).permute(0, 2, 1, 3)
    return keys, values


def accepted_moves(block_table: np.ndarray, block_size: int, context_len: int, nodes: list[int]):
    """Source / destination slots of an accepted path (nodes at context + 1 + node move to context + 1 + k)."""
    nodes_np = np.asarray(nodes)
    k = np.arange(nodes_np.size)
    moved = nodes_np != k
    src, dst = context_len + 1 + nodes_np[moved], context_len + 1 + k[moved]
    return (torch.from_numpy(block_table[src // block_size] * block_size + src % block_size),
            torch.from_numpy(block_table[dst // block_size] * block_size + dst % block_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logical_view_compaction_equals_cpu_backend_path(dtype):
    """Same moves, two mechanisms: the CPU backend's (read through the VEC adapter, rewrite with vLLM's cache-write
    op) and the device-generic gather-then-scatter on strided logical views of the very same cache bytes."""
    from vllm_treespec.attn import layout
    from vllm_treespec.attn.compact import compact_kv

    isa, block_size, num_heads, head_dim, num_blocks = "vec16", 16, 2, 32, 6
    if not layout.self_check(isa, dtype, block_size, head_dim, num_heads):
        pytest.skip(f"vLLM's CPU cache-write op does not support {isa}/{dtype} here")
    generator = torch.Generator().manual_seed(0)
    cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.arange(num_blocks * block_size)
    layout.write_slots(cache, slots, torch.randn(slots.numel(), num_heads, head_dim, generator=generator).to(dtype),
                       torch.randn(slots.numel(), num_heads, head_dim, generator=generator).to(dtype), isa)
    block_table = np.array([4, 1, 5, 0], np.int64)
    # context 13: the path crosses a block boundary; nodes 2 and 3 move onto slots that are themselves sources
    for nodes in ([0, 2, 3], [1, 4, 9, 17], [5]):
        src, dst = accepted_moves(block_table, block_size, 13, nodes)
        expected = cache.clone()
        key, value = layout.read_slots(expected, src)
        layout.write_slots(expected, dst, key, value, isa)
        actual = cache.clone()
        compact_kv(*cpu_vec_logical_views(actual), src, dst)
        assert torch.equal(actual, expected), nodes
        assert not torch.equal(actual, cache)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_logical_view_compaction_on_flash_layout_is_bit_exact(dtype):
    from vllm_treespec.attn.compact import compact_kv, flash_kv_views

    block_size, num_heads, head_dim, num_blocks = 16, 2, 8, 5
    generator = torch.Generator().manual_seed(1)
    cache = torch.randn(num_blocks, num_heads, block_size, 2 * head_dim, generator=generator).to(dtype)
    block_table = np.array([3, 0, 4], np.int64)
    src, dst = accepted_moves(block_table, block_size, 10, [0, 3, 4, 7, 20])
    before = cache.clone()
    compact_kv(*flash_kv_views(cache, head_dim), src, dst)
    raw_before, raw_after = before.view(torch.uint8), cache.view(torch.uint8)
    keys_before, values_before = flash_kv_views(raw_before, head_dim * before.element_size())
    keys_after, values_after = flash_kv_views(raw_after, head_dim * cache.element_size())
    bs = block_size
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(keys_after[d // bs, d % bs], keys_before[s // bs, s % bs])
        assert torch.equal(values_after[d // bs, d % bs], values_before[s // bs, s % bs])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(keys_after.flatten(0, 1)[untouched], keys_before.flatten(0, 1)[untouched])



def test_verifier_compacts_flash_layers_on_the_logical_view():
    """TreeVerifier._compact hands device layers (impls with compact_tree_kv) the moves of the accepted paths."""
    from vllm_treespec.api import DraftTree
    from vllm_treespec.attn.compact import flash_kv_views
    from vllm_treespec.attn.flash import TreeFlashAttentionImpl
    from vllm_treespec.tree import TreeBatch
    from vllm_treespec.verify.verifier import TreeVerifier

    block_size, num_heads, head_dim = 16, 2, 8
    table = np.array([[0, 0, 0], [5, 2, 7], [1, 3, 4]], np.int64)
    runner = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=8), input_batch=SimpleNamespace(
        block_table=[SimpleNamespace(block_size=block_size, block_table=SimpleNamespace(np=table))]))
    impl = TreeFlashAttentionImpl.__new__(TreeFlashAttentionImpl)
    impl.head_size = head_dim
    cache = torch.randn(8, num_heads, block_size, 2 * head_dim).to(torch.bfloat16)
    verifier = TreeVerifier(runner, proposer=None)
    verifier._layers = [SimpleNamespace(kv_cache=cache, impl=impl)]
    trees = [DraftTree(np.arange(4), np.array([-1, -1, 1, 2], np.int32)),
             DraftTree(np.arange(3), np.array([-1, 0, 0], np.int32))]
    batch = TreeBatch.build([1, 2], ["a", "b"], trees, [0, 5], [14, 3])
    out_nodes = np.array([[1, 2, 3], [0, 2, -1]])  # request a: nodes 1,2,3 -> chain 0,1,2; b: node 2 -> chain 1
    before = cache.clone()
    verifier._compact(batch, out_nodes, np.array([3, 2]))
    keys_before, values_before = flash_kv_views(before, head_dim)
    keys, values = flash_kv_views(cache, head_dim)

    def slot(row, position):
        return table[row, position // block_size], position % block_size

    moves = [(1, 14 + 1 + n, 14 + 1 + k) for k, n in enumerate([1, 2, 3])] + [(2, 3 + 1 + 2, 3 + 1 + 1)]
    for row, src, dst in moves:
        assert torch.equal(keys[slot(row, dst)], keys_before[slot(row, src)])
        assert torch.equal(values[slot(row, dst)], values_before[slot(row, src)])
    assert torch.equal(keys[slot(2, 4)], keys_before[slot(2, 4)])  # node 0 of b stays where it is


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {name: run_kernel_case(name) for name in KERNEL_CASES}
    results["flash_glue"] = run_flash_glue()
    print(json.dumps(results))
