"""KV-aware head: modes, parameter matching, checkpoint format, and the proposer's incremental drafting (reading the
target's K/V through a paged-cache view) equals the trainer's unrolled forward (recomputing K/V from aux states)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from eagle_helpers import HIDDEN, VOCAB, check_chain_matches_unrolled_forward
from vllm_treespec.eagle.kv_head import KVAwareHead, KVHeadConfig, TargetKVProjector
from vllm_treespec.eagle.checkpoint import load_draft_head
from vllm_treespec.eagle.model import Eagle3Head, HeadConfig, param_count
from vllm_treespec.proposers.kv_aware import KVAwareOptions

AUX = (1, 3, 5)


def base_config() -> HeadConfig:
    return HeadConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=VOCAB, draft_vocab_size=120, rope_theta=10000.0,
                      aux_layers=AUX, norm_before_fc=True)


def small_kv_head(tmp_path, mode: str, seed: int = 0, kv_layers=(1, 5)) -> tuple[KVAwareHead, str]:
    cfg = KVHeadConfig.from_eagle(base_config(), mode, kv_layers=kv_layers, cross_groups=2, match_params=False)
    torch.manual_seed(seed)
    head = KVAwareHead(cfg, embed=torch.randn(VOCAB, HIDDEN))
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 0.3)
    head.set_draft_vocab(torch.sort(torch.randperm(VOCAB)[:120]).values)
    return head, str(head.save(tmp_path / f"kv-{mode}", dtype=torch.float32))


class FakeProjector:
    """Target K/V of ``layers`` as random projections of the aux states (what TargetKVProjector does)."""

    def __init__(self, layers, kv_heads=2, head_dim=16, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.slots = [AUX.index(layer) for layer in layers]
        self.wk = torch.randn(len(layers), kv_heads * head_dim, HIDDEN, generator=g) * 0.2
        self.wv = torch.randn(len(layers), kv_heads * head_dim, HIDDEN, generator=g) * 0.2
        self.shape = (kv_heads, head_dim)

    def __call__(self, aux):  # aux [B, T, n_aux, H] → [B, L, T, Hk, D]
        h = aux[:, :, self.slots].transpose(1, 2)
        k = torch.einsum("blth,lkh->bltk", h, self.wk)
        v = torch.einsum("blth,lkh->bltk", h, self.wv)
        return k.unflatten(-1, self.shape), v.unflatten(-1, self.shape)


class FakeKVView:
    """The read-only paged-cache view over all target layers 0..5, K/V from FakeProjector for the head's layers."""

    def __init__(self, projector, kv_layers, aux, num_computed):
        k, v = projector(aux[None])
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
        self.kv = {layer: (k[0, j], v[0, j]) for j, layer in enumerate(kv_layers)}
        self.num_computed = np.array([num_computed])
        self.reads = []

    def read(self, layer, row, start=0, end=None):
        end = int(self.num_computed[row]) if end is None else end
        assert 0 <= start <= end <= int(self.num_computed[row])
        self.reads.append((layer, start, end))
        k, v = self.kv[layer]
        return k[start:end], v[start:end]


def test_modes_match_the_eagle_head_parameter_count():
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         num_hidden_layers=30, vocab_size=49152, head_dim=64)
    base = HeadConfig.from_target(target, draft_vocab_size=8192)
    base.norm_before_fc = True
    with torch.device("meta"):
        eagle = param_count(Eagle3Head(base))
        for mode in ("kv", "hybrid"):
            cfg = KVHeadConfig.from_eagle(base, mode)
            head = KVAwareHead(cfg)
            assert abs(param_count(head) - eagle) <= 3 * 576, mode  # one MLP unit
            assert (mode == "kv") != hasattr(head, "fc")
            assert (mode == "hybrid") == hasattr(head.cross, "gate")
    with pytest.raises(ValueError, match="among the aux layers"):
        KVHeadConfig.from_eagle(base, "kv", kv_layers=(3,))
    with pytest.raises(ValueError, match="mode"):
        KVHeadConfig.from_eagle(base, "hidden")


@pytest.mark.parametrize("mode", ["kv", "hybrid"])
def test_checkpoint_round_trip_and_dispatch(tmp_path, mode):
    head, path = small_kv_head(tmp_path, mode)
    cfg = json.loads((tmp_path / f"kv-{mode}" / "config.json").read_text())
    assert cfg["architectures"] == ["TreespecKVAwareHead"] and cfg["kv_aware"]["mode"] == mode
    loaded = load_draft_head(path, embed=head.embed.weight)
    assert isinstance(loaded, KVAwareHead) and loaded.cfg.kv_layers == (1, 5)
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Head.load(path, embed=head.embed.weight)  # vLLM's eagle3 method cannot run it either


@pytest.mark.parametrize("mode,chunks", [("kv", (40,)), ("hybrid", (17, 30, 35, 40))])
def test_incremental_drafting_matches_unrolled_training_forward(tmp_path, mode, chunks):
    """As for the EAGLE head: a top-1 chain drafted after ingesting the context in steps equals the trainer's
    training-time-test forward, the drafter reading K/V from the paged view, the trainer recomputing them."""
    head, path = small_kv_head(tmp_path, mode)
    projector = FakeProjector(head.cfg.kv_layers)
    drafter = check_chain_matches_unrolled_forward(
        head, path, chunks, projector=projector,
        make_view=lambda aux, n: FakeKVView(projector, head.cfg.kv_layers, aux, num_computed=n))
    assert drafter.reads_target_kv and drafter.kv_layers == (1, 5)


def test_kv_only_head_ignores_hidden_states_of_any_shape(tmp_path):
    head, _ = small_kv_head(tmp_path, "kv")
    for shape in [(3, 3 * HIDDEN), (3, 3, HIDDEN), (1, 5, 3 * HIDDEN), (5, 3, HIDDEN)]:
        out = head.combine(torch.randn(*shape))
        lead = shape[:-1] if shape[-1] == 3 * HIDDEN else shape[:-2]
        assert out.shape == (*lead, HIDDEN), shape
        assert not out.any()


def test_cross_attention_reads_the_context(tmp_path):
    """The correction depends on the target's K/V (a KV-only head drafts differently for different contexts whose
    aux states are identical), and masked-out positions do not leak."""
    head, _ = small_kv_head(tmp_path, "kv")
    x = torch.randn(1, 3, HIDDEN)
    pos = torch.tensor([[10, 11, 12]])
    k = torch.randn(1, 2, 13, 2, 16)
    v = torch.randn(1, 2, 13, 2, 16)
    base = head.cross_delta(x, pos, k, v)
    v2 = v.clone()
    v2[:, :, 5] += 1.0
    assert not torch.allclose(base, head.cross_delta(x, pos, k, v2))
    mask = torch.ones(3, 13, dtype=torch.bool)
    mask[:, 5] = False
    assert torch.allclose(head.cross_delta(x, pos, k, v, mask), head.cross_delta(x, pos, k, v2, mask))


def test_target_kv_projector_matches_transformers(tmp_path):
    """Training's recomputed K/V equal the K/V transformers' llama attention computes (post-RoPE keys)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                      num_hidden_layers=4, vocab_size=100, rope_theta=10000.0, head_dim=16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=True)
    projector = TargetKVProjector(tmp_path / "tiny", kv_layers=(1, 3), aux_layers=(1, 2, 3))
    aux = torch.stack([out.hidden_states[i] for i in (1, 2, 3)], dim=2)
    k, v = projector(aux)
    for j, layer in enumerate((1, 3)):
        cache = out.past_key_values
        ref_k = cache.layers[layer].keys if hasattr(cache, "layers") else cache.key_cache[layer]
        ref_v = cache.layers[layer].values if hasattr(cache, "layers") else cache.value_cache[layer]
        torch.testing.assert_close(k[0, j], ref_k[0].transpose(0, 1), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[0, j], ref_v[0].transpose(0, 1), rtol=1e-4, atol=1e-5)


def test_options_fail_clearly(tmp_path):
    _head, path = small_kv_head(tmp_path, "hybrid")
    with pytest.raises(ValueError, match="'mode' is 'kv'"):
        KVAwareOptions(checkpoint=path, mode="kv")
    assert KVAwareOptions(checkpoint=path).checkpoint == path
    with pytest.raises(ValueError, match="no config.json"):
        KVAwareOptions(checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="top_k"):
        KVAwareOptions(checkpoint=path, top_k=0)


def test_kv_view_stops_at_what_a_prefill_chunk_computed():
    """A request in the middle of a chunked prefill samples nothing and has K/V only up to this step's chunk; a
    request that sampled has K/V for every committed token but the newest."""
    from types import SimpleNamespace

    from vllm_treespec.kv_view import build_view

    table = SimpleNamespace(block_table=SimpleNamespace(np=np.zeros((2, 8), np.int32)), block_size=16)
    batch = SimpleNamespace(block_table=[table], num_tokens_no_spec=np.array([100, 41]),
                            num_computed_tokens_cpu=np.array([32, 37]))
    runner = SimpleNamespace(input_batch=batch)
    view = build_view(runner, [], 2, sampled_token_ids=[[], [5, 6, 7]], query_start_loc=np.array([0, 32, 36]))
    assert view.num_computed.tolist() == [64, 40]
    with pytest.raises(IndexError):
        view.read(0, 0, 0, 65)
