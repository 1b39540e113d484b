"""EAGLE-3 heads for tests: an oracle head that reproduces the target's own next-token distribution at depth 1."""

from __future__ import annotations

from pathlib import Path


def write_oracle_head(model_dir: str, out: Path) -> Path:
    """A head whose depth-1 distribution is exactly the target's: its single aux layer is the target's last
    residual stream, ``fc`` is the identity, attention and MLP add nothing, and ``norm`` / ``lm_head`` are the
    target's final norm and (tied) embedding. Deeper levels repeat that state, so only depth 1 is informed."""
    import torch
    from transformers import AutoConfig

    from vllm_treespec.eagle.model import Eagle3Head, HeadConfig
    from vllm_treespec.eagle.train import _target_tensors

    target = AutoConfig.from_pretrained(model_dir)
    embed, norm = _target_tensors(model_dir)
    cfg = HeadConfig.from_target(target, draft_vocab_size=target.vocab_size,
                                 aux_layers=(target.num_hidden_layers,))
    head = Eagle3Head(cfg, embed=embed)
    with torch.no_grad():
        head.fc.weight.copy_(torch.eye(cfg.hidden_size))
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.norm.weight.copy_(norm)
        head.lm_head.weight.copy_(embed)
    head.set_draft_vocab(torch.arange(cfg.vocab_size))
    return head.save(out, dtype=torch.float32)
