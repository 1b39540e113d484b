"""The CPU top-k-only fix: zero rows no longer crash, other inputs give exactly vLLM's result (no engine)."""

from __future__ import annotations

import pytest


def test_top_k_only_with_zero_rows_and_unchanged_otherwise():
    import torch
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    from vllm_treespec.patches import topk_topp_sampler

    original = getattr(tts.apply_top_k_only, "__vllm_treespec_original__", tts.apply_top_k_only)
    with pytest.raises(RuntimeError, match="numel"):  # what the soak hit: keep the test honest about the cause
        original(torch.zeros(0, 16), torch.zeros(0, dtype=torch.int32))

    topk_topp_sampler.apply()
    empty = torch.zeros(0, 16)
    assert tts.apply_top_k_top_p_pytorch(empty, torch.zeros(0, dtype=torch.int32), None, allow_cpu_sync=True) is empty

    torch.manual_seed(0)
    logits = torch.randn(3, 16)
    k = torch.tensor([2, 16, 5], dtype=torch.int32)
    got = tts.apply_top_k_top_p_pytorch(logits.clone(), k, None, allow_cpu_sync=True)
    want = original(logits.clone(), k)
    assert torch.equal(got, want)
    assert [int(torch.isfinite(row).sum()) for row in got] == [2, 16, 5]
