"""An EAGLE-3 draft head in plain torch, with vLLM's checkpoint layout.

Parameter names are those of EAGLE-3 checkpoints as vLLM's ``Eagle3LlamaForCausalLM`` loads them (``midlayer.*``,
``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``; embeddings shared with the target), so a head trained here runs
under vLLM's own ``eagle3`` method and under the ``eagle_tree`` proposer alike, and ``eagle_tree`` loads heads
trained elsewhere (llama family, single decoder layer).

One draft step, as in vLLM (``llama_eagle3.py``, ``norm_before_residual`` false):

    h_in    = fc(cat(aux target hidden states))      at the first step, else the previous step's ``r2``
    x       = cat(input_layernorm(embed(token)), hidden_norm(h_in))
    r1      = o_proj(attention(x)) + h_in
    r2      = mlp(post_attention_layernorm(r1)) + r1
    logits  = lm_head(norm(r2))                     over the draft vocabulary; draft id d is target id d + d2t[d]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

CHECKPOINT_WEIGHTS = "model.safetensors"


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE-3 aux layers for a target with ``num_layers`` layers (low, middle, high)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class HeadConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    aux_layers: tuple[int, ...] = (2, 15, 27)
    target_hidden_size: int | None = None
    #: RMSNorm over the concatenated aux states before ``fc`` (vLLM's ``norm_before_fc``): the target's residual
    #: streams carry massive activations (SmolLM2: single dims of 100s to 10^4) that otherwise dominate ``fc``
    norm_before_fc: bool = False
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None):
        layers = target_config.num_hidden_layers
        rope = getattr(target_config, "rope_theta", None)
        if rope is None:
            rope = (getattr(target_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(hidden_size=target_config.hidden_size,
                   num_attention_heads=target_config.num_attention_heads,
                   num_key_value_heads=target_config.num_key_value_heads,
                   head_dim=getattr(target_config, "head_dim", None)
                   or target_config.hidden_size // target_config.num_attention_heads,
                   intermediate_size=target_config.intermediate_size,
                   vocab_size=target_config.vocab_size, draft_vocab_size=draft_vocab_size,
                   rms_norm_eps=target_config.rms_norm_eps, rope_theta=float(rope),
                   max_position_embeddings=target_config.max_position_embeddings,
                   aux_layers=tuple(aux_layers or default_aux_layers(layers)))

    def to_hf(self) -> dict:
        """config.json for vLLM's eagle3 method (architecture LlamaForCausalLMEagle3)."""
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": 1, "hidden_act": "silu",
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": None,
                "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
                "target_hidden_size": self.target_hidden_size or self.hidden_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                 "use_aux_hidden_state": True, "norm_before_fc": self.norm_before_fc},
                "torch_dtype": "bfloat16", **self.extra}

    @classmethod
    def from_hf(cls, cfg: dict) -> "HeadConfig":
        arch = (cfg.get("architectures") or ["?"])[0]
        if "Eagle3" not in arch and "eagle3" not in arch.lower():
            raise ValueError(f"not an EAGLE-3 head: architectures={cfg.get('architectures')} (expected "
                             "LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM)")
        return cls(**cls.fields_from_hf(cfg))

    @staticmethod
    def fields_from_hf(cfg: dict) -> dict:
        """The HeadConfig fields of an EAGLE-3-style config.json (the architecture is checked by the caller)."""
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"EAGLE-3 heads with {cfg['num_hidden_layers']} layers are not supported (expected 1)")
        eagle = cfg.get("eagle_config") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        for flag in ("fc_norm", "norm_before_residual", "norm_output", "attention_bias"):
            if cfg.get(flag) or eagle.get(flag):
                raise ValueError(f"EAGLE-3 variant with {flag}=true is not supported by eagle_tree")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return dict(hidden_size=cfg["hidden_size"], num_attention_heads=heads,
                   num_key_value_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                   draft_vocab_size=cfg.get("draft_vocab_size") or cfg["vocab_size"],
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-5), rope_theta=float(rope),
                   max_position_embeddings=cfg.get("max_position_embeddings", 8192),
                   aux_layers=tuple(aux) if aux else (), target_hidden_size=cfg.get("target_hidden_size"),
                   norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (neox / HF rotate_half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inp = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(inp, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(inp, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(inp, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, query_rows: torch.Tensor | None = None):
        """q, k, v of rows ``x``; q only of ``query_rows`` (indices into the last row dimension) when given."""
        shape = x.shape[:-1]
        k = self.k_proj(x).view(*shape, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(*shape, self.kv_heads, self.head_dim)
        k = apply_rope(k, cos, sin)
        if query_rows is not None:
            x, cos, sin = x[..., query_rows, :], cos[..., query_rows, :], sin[..., query_rows, :]
            if x.shape[-2] == 0:  # no GEMM of zero rows (not every CPU linear takes one)
                return x.new_empty(*x.shape[:-1], self.heads, self.head_dim), k, v
        q = self.q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)
        return apply_rope(q, cos, sin), k, v


class MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(F.silu(self.mlp.gate_proj(x)) * self.mlp.up_proj(x))


class Eagle3Head(nn.Module):
    """The head. ``embed`` is the target's input embedding (shared, not saved)."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        fc_in = len(cfg.aux_layers) * (cfg.target_hidden_size or h)
        if cfg.norm_before_fc:
            self.input_norm = RMSNorm(fc_in, cfg.rms_norm_eps)
        self.fc = nn.Linear(fc_in, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed = nn.Embedding(cfg.vocab_size, h)
        self.embed.weight.requires_grad_(False)
        if embed is not None:
            self.embed.weight.data.copy_(embed)

    # --- vocabulary -------------------------------------------------------------------------------------------
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """``target_ids[d]`` = target id of draft id d (ascending, as vLLM's d2t offsets assume nothing else)."""
        target_ids = torch.as_tensor(target_ids, dtype=torch.long)
        self.d2t.copy_(target_ids - torch.arange(len(target_ids)))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    #: whether the head cross-attends to the target's KV cache (:class:`vllm_treespec.eagle.kv_head.KVAwareHead`)
    reads_target_kv = False

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    # --- one step over a sequence (used by the trainer's unrolled steps and the proposer) ----------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[..., n_aux * H] or [..., n_aux, H] target hidden states → the head's input hidden [..., H]."""
        if aux.dim() >= 2 and aux.shape[-2] == len(self.cfg.aux_layers) and aux.shape[-1] != self.fc.in_features:
            aux = aux.flatten(-2)
        aux = aux.to(self.fc.weight.dtype)
        if self.cfg.norm_before_fc:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def layer_inputs(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     query_rows: torch.Tensor | None = None):
        """q, k, v ([..., T, heads|kv_heads, D]) of the layer for inputs (token, hidden) at ``positions``; q only of
        ``query_rows`` when given (rows written to the cache but never attended from need no query)."""
        layer = self.midlayer
        embeds = layer.input_layernorm(self.embed(tokens).to(hidden.dtype))
        x = torch.cat([embeds, layer.hidden_norm(hidden)], dim=-1)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return layer.self_attn.qkv(x, cos.to(hidden.dtype), sin.to(hidden.dtype), query_rows)

    def layer_outputs(self, attn: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn: [..., T, heads, D] attention output; returns (normed output for logits, prenorm r2 for the next step)."""
        layer = self.midlayer
        r1 = layer.self_attn.o_proj(attn.flatten(-2)) + hidden
        r2 = layer.mlp_forward(layer.post_attention_layernorm(r1)) + r1
        return self.norm(r2), r2

    def step_outputs(self, attn: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                     target_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                     kv_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`layer_outputs`; heads that read the target's KV add their correction here (the extra
        arguments are theirs)."""
        return self.layer_outputs(attn, hidden)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits."""
        return self.lm_head(normed)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def save(self, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> Path:
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(dtype).contiguous() if v.is_floating_point() else v.detach().contiguous()
                 for k, v in self.state_dict().items() if not k.startswith("embed.")}
        save_file(state, str(out / CHECKPOINT_WEIGHTS))
        cfg = self.cfg.to_hf()
        cfg.update(extra_config or {})
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out

    config_type = HeadConfig

    @classmethod
    def load(cls, path: str | Path, embed: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
             default_aux_layers: tuple[int, ...] | None = None) -> "Eagle3Head":
        """Load an EAGLE-3 checkpoint folder (ours or any llama-family EAGLE-3 head vLLM loads)."""
        from safetensors.torch import load_file

        folder = Path(path)
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{folder}: no config.json (expected an EAGLE-3 checkpoint folder)")
        cfg = cls.config_type.from_hf(json.loads(cfg_path.read_text()))
        if not cfg.aux_layers:
            if default_aux_layers is None:
                raise ValueError(f"{folder}: config.json names no eagle_aux_hidden_state_layer_ids")
            cfg.aux_layers = tuple(default_aux_layers)
        state: dict[str, torch.Tensor] = {}
        files = sorted(folder.glob("*.safetensors"))
        if files:
            for f in files:
                state.update(load_file(str(f)))
        elif (folder / "pytorch_model.bin").is_file():
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(f"{folder}: no *.safetensors or pytorch_model.bin")
        state = {k.removeprefix("model."): v for k, v in state.items()}
        head_embed = state.pop("embed_tokens.weight", None)
        head = cls(cfg, embed=head_embed if head_embed is not None else embed)
        if "d2t" not in state:
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
            t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True
            state["t2d"] = t2d
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("embed.")]
        if missing or unexpected:
            raise ValueError(f"{folder}: checkpoint does not match a {cls.__name__} "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        if head_embed is None and embed is None:
            raise ValueError(f"{folder}: the head has no embed_tokens; pass the target's embedding")
        return head.to(dtype)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T, H, D] x [B, S, Hk, D] → [B, T, H, D] with GQA and an additive or boolean mask [.., T, S]."""
    groups = q.shape[-2] // k.shape[-2]
    qt, kt, vt = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)
    if groups > 1:
        kt = kt.repeat_interleave(groups, dim=-3)
        vt = vt.repeat_interleave(groups, dim=-3)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(-3, -2)


def param_count(head: nn.Module) -> int:
    """Trainable-size parameters of a head, without the shared (frozen) target embedding."""
    return sum(p.numel() for name, p in head.named_parameters() if not name.startswith("embed."))
