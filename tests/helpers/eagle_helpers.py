"""Small random EAGLE-3 heads and the check that incremental drafting equals the trainer's unrolled forward (shared
by the EAGLE-3 and KV-aware head tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_treespec.api import ProposeContext
from vllm_treespec.eagle.model import Eagle3Head, HeadConfig
from vllm_treespec.eagle.drafter import EagleDrafter
from vllm_treespec.training.train import ttt_forward

VOCAB, HIDDEN = 300, 64


def small_head(tmp_path, draft_vocab=120, seed=0, norm_before_fc=False) -> tuple[Eagle3Head, str]:
    cfg = HeadConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, vocab_size=VOCAB, draft_vocab_size=draft_vocab, rope_theta=10000.0,
                     aux_layers=(1, 3, 5), norm_before_fc=norm_before_fc)
    torch.manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN)
    head = Eagle3Head(cfg, embed=embed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    head.set_draft_vocab(torch.sort(torch.randperm(VOCAB)[:draft_vocab]).values)
    path = head.save(tmp_path / "head", dtype=torch.float32)
    return head, str(path)


def drafter_on_random_sequence(tmp_path, seed: int, length: int, depth: int, top_k: int
                               ) -> tuple[EagleDrafter, np.ndarray, torch.Tensor]:
    """A drafter on :func:`small_head` (``seed``), a random token sequence of ``length`` and its random aux rows
    ``[length, 3, HIDDEN]``."""
    head, path = small_head(tmp_path, seed=seed)
    seq = np.random.default_rng(seed).integers(0, VOCAB, size=length)
    aux = torch.randn(length, 3, HIDDEN)
    drafter = EagleDrafter(path, depth=depth, top_k=top_k)
    drafter.load(head.embed.weight)
    return drafter, seq, aux


def draft_context(seq: np.ndarray, aux: torch.Tensor, start: int, stop: int, sampled: list[int]) -> ProposeContext:
    """Rows for positions start..stop-1 (the target read tokens start..stop-1; tokens up to stop are committed)."""
    tokens = np.zeros((1, 256), np.int64)
    tokens[0, : stop + 1] = seq[: stop + 1]
    n = stop - start
    return ProposeContext(req_ids=["r"], sampled_token_ids=[sampled], num_tokens=np.array([stop + 1]),
                          token_ids=tokens, max_nodes=64,
                          aux_hidden_states=[aux[start:stop, j] for j in range(aux.shape[1])],
                          hidden_row_index=np.array([n - 1]), hidden_row_start=np.array([0]),
                          hidden_position_start=np.array([start]))


def check_chain_matches_unrolled_forward(head, path: str, chunks: tuple[int, ...], depth: int = 4,
                                         projector=None, make_view=None) -> EagleDrafter:
    """Ingest a random context in ``chunks``, draft a top-1 chain (top_k=1) and check that the trainer's
    training-time-test forward over the context followed by that chain gives the same tokens and probabilities at
    every depth. KV-aware heads: ``projector(aux)`` gives the trainer's target K/V, ``make_view(aux, n)`` the paged view
    the drafter reads, holding ``n`` positions (one more than committed, as during a chunked prefill: the drafter must
    not read past the committed rows)."""
    rng = np.random.default_rng(0)
    end = chunks[-1]
    seq = rng.integers(0, VOCAB, size=end + 1 + depth + 1)
    aux = torch.randn(len(seq), 3, HIDDEN)
    drafter = EagleDrafter(path, depth=depth, top_k=1)
    drafter.load(head.embed.weight)
    start = 0
    for stop in chunks:
        ctx = draft_context(seq, aux, start, stop, sampled=[int(seq[stop])])
        if make_view is not None:
            ctx.kv_cache = view = make_view(aux, stop + 1)
        assert drafter.ingest(ctx) == [0]
        if make_view is not None:
            assert max(e for _, _, e in view.reads) == stop  # positions 0..stop-1: the root row and before
        start = stop
    tree = drafter.draft(ctx, [0], budget=depth)[0]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    # the chain continues the committed text: feed it to the unrolled forward as the following tokens
    full = seq.copy()
    full[end + 1: end + 1 + depth] = tree.token_ids
    target_kv = None if projector is None else projector(aux[None])
    with torch.no_grad():
        steps = list(ttt_forward(head, torch.from_numpy(full[None]), aux[None].flatten(-2), depth, target_kv))
    d2t = head.draft_to_target.numpy()
    for k, logits in steps:
        probs = torch.softmax(logits[0, end - 1], -1)  # row end-1: the last committed row
        best = int(probs.argmax())
        assert int(d2t[best]) == int(tree.token_ids[k]), f"depth {k + 1}"
        assert float(probs[best]) == pytest.approx(float(tree.node_probs[k]), rel=1e-4, abs=1e-6)
    return drafter
