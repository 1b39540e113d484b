"""The start-up warm-up compiles the tree step's kernels with the argument types a real step calls them with: a real
call after it adds no compiled signature (else the first request would still compile, on a fresh install)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vllm_treespec.api import DraftTree
from vllm_treespec.attn import layout
from vllm_treespec.tree import TreeBatch, _greedy_accept_kernel, _layout_kernel, greedy_accept
from vllm_treespec.verify import accept, topk, warmup


def _signatures(*dispatchers) -> list[int]:
    return [len(d.signatures) for d in dispatchers]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_kernels_are_compiled_for_a_real_step(dtype):
    warmup.compile_logits_kernels({dtype})
    kernels = (topk._topk32_kernel, topk._topk_bf16_kernel, accept._argmax32_kernel, accept._argmax16_kernel)
    before = _signatures(*kernels)
    logits = torch.randn(7, 49152).to(dtype)  # a verify step's logits: one row per tree row
    rows = np.array([0, 2, 3], np.int64)
    ids, probs = topk.target_topk(logits, rows, 8)
    assert ids.shape == (3, 8) and probs.shape == (3, 8)
    np.testing.assert_array_equal(accept.argmax_rows(logits, rows), logits[rows].argmax(dim=-1).numpy())
    assert _signatures(*kernels) == before


def test_acceptance_kernels_are_compiled_for_a_real_step():
    warmup.compile_acceptance_kernels()
    before = _signatures(_layout_kernel, _greedy_accept_kernel)
    trees = [DraftTree(np.array([11, 12, 13]), np.array([-1, 0, 0])), DraftTree(np.array([21]), np.array([-1]))]
    batch = TreeBatch.build([0, 1], ["a", "b"], trees, [0, 4], [10, 20])
    argmax = np.array([11, 99, 5, 5, 21, 8])  # request a accepts node 0, b its only node
    _, _, out_len = greedy_accept(batch.tokens, batch.parents, batch.depth, batch.node_offsets,
                                  np.array([0, 4]), argmax, 2)
    assert out_len.tolist() == [1, 1]
    assert _signatures(_layout_kernel, _greedy_accept_kernel) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compaction_kernel_is_compiled_for_the_engine_cache(dtype):
    cache = torch.randn(6, 3, 16, 128).to(dtype)  # [blocks, kv heads, block size, 2 * head dim]: vLLM's CPU layout
    warmup.compile_compaction_kernels([cache, cache])
    before = _signatures(layout._move_slots_kernel)
    expected = layout.read_slots(cache, torch.tensor([17]))
    layout.move_slots(cache, np.array([17]), np.array([40]))
    moved = layout.read_slots(cache, torch.tensor([40]))
    assert all(torch.equal(a, b) for a, b in zip(expected, moved))
    assert _signatures(layout._move_slots_kernel) == before


def test_a_runner_without_a_verifier_or_config_is_not_an_error(caplog):
    class Bare:
        pass

    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        assert warmup.compile_step_kernels(Bare()) >= 0.0
    assert "could not compile" not in caplog.text


def test_a_failing_warm_up_logs_one_line_and_does_not_raise(caplog, monkeypatch):
    def broken():
        raise RuntimeError("no kernels here")

    monkeypatch.setattr(warmup, "compile_acceptance_kernels", broken)
    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        warmup.compile_step_kernels(object())
    assert "could not compile the tree step's kernels" in caplog.text and "no kernels here" in caplog.text


def test_only_caches_that_compaction_moves_in_place_are_warmed():
    class Impl:
        kv_cache_dtype = "auto"

    class Layer:
        def __init__(self, cache, isa, impl=None):
            self.kv_cache, self.isa, self.impl = cache, isa, impl or Impl()

    class DeviceImpl(Impl):
        def compact_tree_kv(self, *args):
            pass

    cache = torch.zeros(4, 3, 16, 128)
    layers = [Layer(cache, "vec"), Layer(cache, "amx"), Layer(cache, "vec", DeviceImpl())]
    assert [c is cache for c in warmup.movable_caches(layers)] == [True]
