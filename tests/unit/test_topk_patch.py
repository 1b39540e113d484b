"""The CPU top-k / top-p patches: zero rows no longer crash, other inputs keep exactly what vLLM keeps (no engine)."""

from __future__ import annotations

import pytest


@pytest.fixture
def sampler():
    """(vLLM's patched module, the original apply_top_k_top_p_pytorch, our patch module)."""
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    from vllm_treespec.patches import topk_topp_sampler

    topk_topp_sampler.apply()
    return tts, tts.apply_top_k_top_p_pytorch.__vllm_treespec_original__, topk_topp_sampler


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


@pytest.mark.parametrize("case", ["distinct", "ties", "masked entries", "a row without top-k", "k beyond the limit"])
def test_top_k_then_top_p_keeps_exactly_what_vllm_keeps(case, sampler):
    """The fast top-k + top-p path (topk over the survivors instead of a full sort) against vLLM's original."""
    import torch

    tts, original, topk_topp_sampler = sampler
    generator = torch.Generator().manual_seed(1)
    rows, vocab = 257, 4096
    logits = torch.randn(rows, vocab, generator=generator) * 3
    k = torch.randint(1, 60, (rows,), generator=generator, dtype=torch.int32)
    p = torch.rand(rows, generator=generator) * 0.6 + 0.4
    p[::7] = 1.0  # top-p off for some rows
    k[::11] = 1
    if case == "ties":  # coarse logits: the k-th value ties with others, inside and beyond the first max(k) columns
        logits = logits.round()
    elif case == "masked entries":  # -inf from logits processors (bad words, min tokens); fewer finite than k
        logits[:, ::2] = -float("inf")
        logits[3, :] = -float("inf")
        logits[3, 5:8] = 1.0
    elif case == "a row without top-k":
        k[10] = vocab
    elif case == "k beyond the limit":
        k[10] = vocab // 2
    got = tts.apply_top_k_top_p_pytorch(logits.clone(), k.clone(), p.clone(), allow_cpu_sync=True)
    want = original(logits.clone(), k.clone(), p.clone(), allow_cpu_sync=True)
    kept = torch.isfinite(got).sum(dim=1)
    assert torch.equal(kept, torch.isfinite(want).sum(dim=1)) and int(kept.min()) >= 1
    if case == "ties":  # top-p may cut through equal logits: which of them survive is the sort's arbitrary order
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
        assert bool((kept > k).any())  # ties beyond the k-th value were kept, as vLLM keeps them
    else:
        assert torch.equal(got, want)
    if case == "distinct":  # the fast path itself answered: vLLM's full sort is not called
        def no_sort(*args):
            raise AssertionError("fell back to vLLM's full sort")

        fast = topk_topp_sampler.top_k_then_top_p(logits.clone(), k.clone(), p.clone(), no_sort, True)
        assert torch.equal(fast, want)


@pytest.mark.parametrize("case", ["peaked", "flat", "mixed rows", "ties", "masked entries"])
def test_top_p_alone_keeps_exactly_what_vllm_keeps(case, sampler):
    """The top-p-only path (nucleus searched in each row's most likely tokens) against vLLM's full sort."""
    import torch

    tts, original, topk_topp_sampler = sampler
    generator = torch.Generator().manual_seed(2)
    rows, vocab = 33, 8192
    scale = {"flat": 0.5}.get(case, 6.0)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    p = torch.rand(rows, generator=generator) * 0.5 + 0.45
    if case == "mixed rows":  # flat rows and rows without top-p (p = 1) beside peaked ones: those go to the original
        logits[::3] *= 0.1
        p[::4] = 1.0
    elif case == "ties":
        logits = (logits * 0.5).round()
    elif case == "masked entries":
        logits[:, ::2] = -float("inf")
        logits[3, :] = -float("inf")
        logits[3, 5:8] = 1.0
    got = tts.apply_top_k_top_p_pytorch(logits.clone(), None, p.clone(), allow_cpu_sync=True)
    want = original(logits.clone(), None, p.clone(), allow_cpu_sync=True)
    kept = torch.isfinite(got).sum(dim=1)
    assert torch.equal(kept, torch.isfinite(want).sum(dim=1)) and int(kept.min()) >= 1
    if case == "ties":  # which of equal logits survive a cut through them is the sort's arbitrary order
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    else:
        assert torch.equal(got, want)
    if case == "peaked":  # every row's nucleus is in its head: vLLM's full sort is never called
        def no_sort(*args):
            raise AssertionError("fell back to vLLM's full sort")

        assert torch.equal(topk_topp_sampler.top_p_in_head(logits.clone(), p.clone(), no_sort, True), want)
    if case == "flat":  # the nucleus is wider than the head: the original answers
        assert int(kept.min()) > topk_topp_sampler.TOP_P_HEAD_COLUMNS
