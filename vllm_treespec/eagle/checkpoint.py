"""Loading a draft head from a folder in vLLM's ``eagle3`` format: an EAGLE-3 head or a KV-aware one, whichever its
config.json names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_treespec.eagle.kv_head import KVAwareHead, is_kv_aware_config
from vllm_treespec.eagle.model import Eagle3Head


def load_draft_head(path: str | Path, embed: torch.Tensor | None = None, dtype: torch.dtype = torch.float32,
                    default_aux_layers: tuple[int, ...] | None = None) -> Eagle3Head:
    """An EAGLE-3 head or a KV-aware head, whichever the folder's config.json names."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    cls = Eagle3Head
    if cfg_path.is_file() and is_kv_aware_config(json.loads(cfg_path.read_text())):
        cls = KVAwareHead
    return cls.load(folder, embed=embed, dtype=dtype, default_aux_layers=default_aux_layers)
