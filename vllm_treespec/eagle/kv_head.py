"""A KV-aware draft head (KVShot, arXiv 2604.26412): the EAGLE-3 head plus cross-attention over the target's KV cache.

Hidden-state drafters see the context only through one compressed hidden vector per token; this head also reads the
target's own keys and values of a few layers (``kv_layers``), so what it drafts deep in a chain can still look at the
whole context. Three modes, one class:

- ``hidden``: no cross-attention, i.e. exactly the EAGLE-3 head (:class:`~vllm_treespec.eagle.model.Eagle3Head`;
  the trainer writes a plain EAGLE-3 checkpoint for it).
- ``kv``: no target hidden states at all: the first step's input hidden is zero and the target's context reaches
  the head only through ``r = r2 + cross(r2)``.
- ``hybrid``: the EAGLE-3 backbone plus a gated correction ``r = r2 + sigmoid(gate(r2)) * cross(r2)``.

``cross`` queries every KV head of every chosen layer (``cross_groups`` queries per KV head) with RoPE at the draft
row's position, against the target's post-RoPE keys of all committed positions, and projects the concatenated
outputs back to the hidden size. ``r`` replaces ``r2`` everywhere downstream (logits, next step's input hidden).

Training and drafting see the same keys: the trainer recomputes them from the stored aux hidden states (the
residual stream entering layer L is what layer L normalises and projects), the proposer reads them from the
target's paged cache (:class:`vllm_treespec.kv_view.TargetKVView`). Hence ``kv_layers`` is a subset of the aux layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from vllm_treespec.eagle.model import Eagle3Head, HeadConfig, RMSNorm, apply_rope, param_count, rope_cos_sin

ARCHITECTURE = "TreespecKVAwareHead"
MODES = ("hidden", "kv", "hybrid")


def is_kv_aware_config(cfg: dict) -> bool:
    return ARCHITECTURE in (cfg.get("architectures") or [])


@dataclass
class KVHeadConfig(HeadConfig):
    mode: str = "hybrid"
    kv_layers: tuple[int, ...] = ()
    #: cross-attention queries per target KV head
    cross_groups: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("kv", "hybrid"):
            raise ValueError(f"KV-aware head mode must be 'kv' or 'hybrid' (mode 'hidden' is the EAGLE-3 head), "
                             f"got {self.mode!r}")
        if not self.kv_layers:
            raise ValueError("KV-aware head: kv_layers is empty")
        self.kv_layers = tuple(int(x) for x in self.kv_layers)
        self.aux_layers = tuple(int(x) for x in self.aux_layers)
        if not set(self.kv_layers) <= set(self.aux_layers):
            raise ValueError(f"KV-aware head: kv_layers {list(self.kv_layers)} must be among the aux layers "
                             f"{list(self.aux_layers)} (training recomputes their keys from the aux hidden states)")

    def to_hf(self) -> dict:
        cfg = super().to_hf()
        cfg["architectures"] = [ARCHITECTURE]
        cfg["kv_aware"] = {"mode": self.mode, "kv_layers": list(self.kv_layers), "cross_groups": self.cross_groups}
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict) -> "KVHeadConfig":
        if not is_kv_aware_config(cfg):
            raise ValueError(f"not a KV-aware head: architectures={cfg.get('architectures')} (expected "
                             f"{ARCHITECTURE})")
        kv = cfg.get("kv_aware") or {}
        return cls(**HeadConfig.fields_from_hf(cfg), mode=kv.get("mode", "hybrid"),
                   kv_layers=tuple(kv.get("kv_layers") or ()), cross_groups=int(kv.get("cross_groups", 1)))

    @classmethod
    def from_eagle(cls, base: HeadConfig, mode: str, kv_layers: tuple[int, ...] | None = None,
                   cross_groups: int = 1, match_params: bool = True) -> "KVHeadConfig":
        """The KV-aware variant of ``base``; with ``match_params`` its MLP width is chosen so that it has as
        many parameters as the EAGLE-3 head of ``base`` (the cross-attention is paid for by the MLP)."""
        fields = dict(base.__dict__)
        cfg = cls(**fields, mode=mode, kv_layers=tuple(kv_layers or base.aux_layers), cross_groups=cross_groups)
        if match_params:
            target = _meta_count(Eagle3Head, base)
            per_unit = 3 * base.hidden_size  # gate, up, down rows per intermediate unit
            without_mlp = _meta_count(KVAwareHead, cfg) - per_unit * cfg.intermediate_size
            cfg.intermediate_size = max(1, round((target - without_mlp) / per_unit))
        return cfg


def _meta_count(head_cls, cfg) -> int:
    with torch.device("meta"):
        return param_count(head_cls(cfg))


class KVAwareHead(Eagle3Head):
    config_type = KVHeadConfig
    reads_target_kv = True

    def __init__(self, cfg: KVHeadConfig, embed: torch.Tensor | None = None):
        super().__init__(cfg, embed)
        if cfg.mode == "kv":  # reads no hidden states
            del self.fc
            if cfg.norm_before_fc:
                del self.input_norm
        h, d = cfg.hidden_size, cfg.head_dim
        queries = len(cfg.kv_layers) * cfg.num_key_value_heads * cfg.cross_groups
        self.cross = nn.Module()
        self.cross.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.cross.q_proj = nn.Linear(h, queries * d, bias=False)
        self.cross.o_proj = nn.Linear(queries * d, h, bias=False)
        if cfg.mode == "hybrid":
            self.cross.gate = nn.Linear(h, 1, bias=True)

    @property
    def mode(self) -> str:
        return self.cfg.mode

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        if self.cfg.mode != "kv":
            return super().combine(aux)
        flat = len(self.cfg.aux_layers) * (self.cfg.target_hidden_size or self.cfg.hidden_size)
        lead = aux.shape[:-1] if aux.shape[-1] == flat else aux.shape[:-2]  # [..., n_aux * H] or [..., n_aux, H]
        return torch.zeros(*lead, self.cfg.hidden_size, dtype=self.lm_head.weight.dtype, device=aux.device)

    def cross_delta(self, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, H] at ``positions`` [B, T]; keys/values [B, L, S, Hk, D] (post-RoPE, as the target caches them);
        mask [T, S] or [B, T, S] bool (True = visible) or None → the correction [B, T, H]."""
        cfg, c = self.cfg, self.cross
        b, t, _ = x.shape
        n_layers, hk, g, d = len(cfg.kv_layers), cfg.num_key_value_heads, cfg.cross_groups, cfg.head_dim
        if keys.shape[2] == 0:
            return torch.zeros_like(x)
        xn = c.norm(x)
        q = c.q_proj(xn).view(b, t, n_layers * hk * g, d)
        cos, sin = rope_cos_sin(positions, d, cfg.rope_theta)
        q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)).view(b, t, n_layers, hk, g, d)
        # in float32: a bf16 einsum builds a new oneDNN primitive for every context length it meets (~1 ms on CPU)
        scores = torch.einsum("btlkgd,blskd->blkgts", q.float(), keys.float()) * (1.0 / math.sqrt(d))
        if mask is not None:
            m = mask if mask.dim() == 3 else mask[None]
            scores = scores.masked_fill(~m[:, None, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("blkgts,blskd->btlkgd", probs, values.float()).reshape(b, t, -1).to(x.dtype)
        delta = c.o_proj(out)
        if cfg.mode == "hybrid":
            delta = torch.sigmoid(c.gate(xn)) * delta
        return delta

    def step_outputs(self, attn, hidden, positions=None, target_kv=None, kv_mask=None):
        _normed, r2 = self.layer_outputs(attn, hidden)
        if target_kv is None:
            raise ValueError("a KV-aware head needs the target's K/V (target_kv)")
        squeeze = r2.dim() == 2
        x = r2[None] if squeeze else r2
        pos = positions if positions.dim() == 2 else positions.expand(x.shape[0], -1)
        r = x + self.cross_delta(x, pos, *target_kv, kv_mask)
        r = r[0] if squeeze else r
        return self.norm(r), r


class TargetKVProjector:
    """Recomputes the target's cached K/V of ``kv_layers`` from the residual stream entering those layers
    (the aux hidden states), with the target's own weights: ``K = RoPE(k_proj(input_layernorm(h)))``,
    ``V = v_proj(input_layernorm(h))``. Training uses it where drafting reads the paged cache."""

    def __init__(self, model_dir: str | Path, kv_layers: tuple[int, ...], aux_layers: tuple[int, ...]):
        from safetensors import safe_open

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.heads = cfg["num_attention_heads"]
        self.kv_heads = cfg.get("num_key_value_heads", self.heads)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg.get("rms_norm_eps", 1e-5)
        self.theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if cfg.get("rope_scaling"):
            raise ValueError(f"{model_dir}: rope_scaling is not supported by the KV-aware trainer")
        self.num_aux = len(aux_layers)
        self.slots = [list(aux_layers).index(layer) for layer in kv_layers]
        want = {f"model.layers.{layer}.{name}.weight": (j, name) for j, layer in enumerate(kv_layers)
                for name in ("input_layernorm", "self_attn.k_proj", "self_attn.v_proj")}
        found: dict[tuple[int, str], torch.Tensor] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), "pt") as sf:
                for name in sf.keys():
                    if name in want:
                        found[want[name]] = sf.get_tensor(name).float()
        if len(found) != len(want):
            raise ValueError(f"{model_dir}: missing K/V projection weights of layers {list(kv_layers)}")
        n = len(kv_layers)
        self.norm = torch.stack([found[(j, "input_layernorm")] for j in range(n)])
        self.k_proj = torch.stack([found[(j, "self_attn.k_proj")] for j in range(n)])
        self.v_proj = torch.stack([found[(j, "self_attn.v_proj")] for j in range(n)])

    def __call__(self, aux: torch.Tensor, positions: torch.Tensor | None = None):
        """aux [B, T, n_aux, H] or [B, T, n_aux * H] → (K, V) [B, L, T, Hk, D] (fp32); positions default to 0..T-1."""
        if aux.dim() == 3:
            aux = aux.unflatten(-1, (self.num_aux, -1))
        b, t = aux.shape[:2]
        h = aux[:, :, self.slots].float().transpose(1, 2)  # [B, L, T, H]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm[None, :, None]
        k = torch.einsum("blth,lkh->bltk", h, self.k_proj).view(b, len(self.slots), t, self.kv_heads, self.head_dim)
        v = torch.einsum("blth,lkh->bltk", h, self.v_proj).view(b, len(self.slots), t, self.kv_heads, self.head_dim)
        if positions is None:
            positions = torch.arange(t)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta)
        return apply_rope(k, cos, sin), v
