"""The target's top-k at verified rows (vllm_treespec.verify.topk): torch's topk and softmax, read in place."""

import numpy as np
import pytest
import torch

from vllm_treespec.verify.topk import target_topk


def torch_topk(logits: torch.Tensor, index: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    rows = logits[torch.from_numpy(index)].float()
    top, ids = rows.topk(k, dim=-1)
    return ids.numpy(), torch.exp(top - torch.logsumexp(rows.double(), dim=-1, keepdim=True).float()).numpy()


@pytest.mark.parametrize("vocab", [1, 7, 64, 65, 1000, 49152])
@pytest.mark.parametrize("k", [1, 8])
def test_fp32_rows_give_torchs_top_k_and_softmax(vocab, k):
    rng = np.random.default_rng(vocab * 10 + k)
    logits = torch.from_numpy((rng.standard_normal((6, vocab)) * 4).astype(np.float32))
    index = np.array([5, 0, 3, 3, 1], np.int64)  # any order, repeats
    ids, probs = target_topk(logits, index, k)
    want_ids, want_probs = torch_topk(logits, index, min(k, vocab))
    assert ids.tolist() == want_ids.tolist()
    np.testing.assert_allclose(probs, want_probs, rtol=2e-5, atol=1e-7)


def test_bf16_rows_give_the_same_values_as_torch():
    """bf16 ties are common: the top values (and their probabilities) match torch's; equal values come first
    position first."""
    rng = np.random.default_rng(1)
    logits = torch.from_numpy((rng.standard_normal((4, 4099)) * 3).astype(np.float32)).to(torch.bfloat16)
    index = np.arange(4, dtype=np.int64)
    ids, probs = target_topk(logits, index, 8)
    want_ids, want_probs = torch_topk(logits, index, 8)
    rows = logits.float().numpy()
    for r in range(4):
        got = rows[r, ids[r]]
        assert got.tolist() == sorted(got.tolist(), reverse=True)
        assert got.tolist() == rows[r, want_ids[r]].tolist()
        for value in set(got.tolist()):  # ties: the first positions holding that value
            at = ids[r][got == value].tolist()
            assert at == sorted(at) and at == np.nonzero(rows[r] == value)[0][:len(at)].tolist()
    np.testing.assert_allclose(probs, want_probs, rtol=2e-5, atol=1e-7)


def test_rows_strided_in_memory_are_read_in_place():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    sliced = logits[:, 10:250]  # rows contiguous, strided between rows
    index = np.array([4, 2], np.int64)
    ids, probs = target_topk(sliced, index, 3)
    want_ids, want_probs = torch_topk(sliced, index, 3)
    assert ids.tolist() == want_ids.tolist()
    np.testing.assert_allclose(probs, want_probs, rtol=2e-5)


def test_other_dtypes_take_torchs_path():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)).to(torch.float16)
    ids, probs = target_topk(logits, np.array([2, 0], np.int64), 4)
    want_ids, want_probs = torch_topk(logits, np.array([2, 0], np.int64), 4)
    assert ids.tolist() == want_ids.tolist() and ids.dtype == np.int64 and probs.dtype == np.float32
    np.testing.assert_allclose(probs, want_probs, rtol=1e-3)


def test_rows_without_a_finite_maximum_get_zero_probabilities():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    logits[0, 17] = float("nan")  # a NaN ranks above every number: no finite maximum
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")
    ids, probs = target_topk(logits, np.arange(4, dtype=np.int64), 2)
    assert (probs[:3] == 0).all() and ids[0, 0] == 17 and ids[1, 0] == 5
    assert probs[3].sum() > 0 and ids[3].tolist() == torch_topk(logits, np.array([3]), 2)[0][0].tolist()


def test_masked_tokens_get_no_probability():
    """-inf logits (a vocabulary larger than the tokenizer's, masked) add nothing to the normaliser."""
    logits = torch.full((1, 200), float("-inf"))
    logits[0, :3] = torch.tensor([2.0, 1.0, 0.0])
    ids, probs = target_topk(logits, np.array([0], np.int64), 4)
    want = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), -1).numpy()
    assert ids[0, :3].tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs[0, :3], want, rtol=1e-6)
    assert probs[0, 3] == 0


def test_empty_index_and_k_above_the_vocabulary():
    logits = torch.randn(2, 5)
    ids, probs = target_topk(logits, np.zeros(0, np.int64), 3)
    assert ids.shape == (0, 3) and probs.shape == (0, 3)
    ids, probs = target_topk(logits, np.array([1], np.int64), 9)
    assert ids.shape == (1, 5) and probs.sum() == pytest.approx(1.0, rel=1e-5)
