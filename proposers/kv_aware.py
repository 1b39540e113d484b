"""``kv_aware``: draft trees from a KV-aware head (KVShot, arXiv 2604.26412) — public tree API only.

The head (:class:`vllm_treespec.eagle.kv_head.KVAwareHead`, trained by ``vllm-treespec train-eagle --mode kv|hybrid``)
is the EAGLE-3 head plus cross-attention over the target's own K/V of a few layers, which the proposer reads through
the read-only paged-cache view the tree API hands to proposers that set ``needs_kv_cache``. Drafting is
``eagle_tree``'s (EAGLE-2 dynamic trees; ``top_k=1`` drafts a chain); only the head differs. ``mode`` picks the
default trained head when no ``checkpoint`` is given; ``mode: hidden`` is the plain EAGLE-3 head, for side-by-side runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import msgspec

from vllm_treespec.proposers.eagle_tree import EagleTreeOptions, EagleTreeProposer, resolve_checkpoint


def _checkpoint_mode(folder: str) -> str:
    from vllm_treespec.eagle.kv_head import is_kv_aware_config

    cfg = json.loads((Path(folder) / "config.json").read_text())
    return (cfg.get("kv_aware") or {}).get("mode", "hybrid") if is_kv_aware_config(cfg) else "hidden"


class KVAwareOptions(EagleTreeOptions, kw_only=True):
    #: which trained head to use when ``checkpoint`` is not given; checked against the checkpoint when it is
    mode: Literal["hybrid", "kv", "hidden"] | None = None

    def __post_init__(self) -> None:
        for name in ("depth", "top_k", "max_cached_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_aware option {name!r} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint not in (None, "auto"):
            if not os.path.exists(self.checkpoint):
                raise ValueError(f"kv_aware option 'checkpoint': no such file or directory {self.checkpoint!r}")
            folder = resolve_checkpoint(self.checkpoint, "kv_aware option 'checkpoint'")
            found = _checkpoint_mode(folder)
            if self.mode is not None and found != self.mode:
                raise ValueError(f"kv_aware option 'mode' is {self.mode!r} but checkpoint {self.checkpoint!r} is a "
                                 f"{found!r} head; drop 'mode' or pick a matching checkpoint")
        else:
            resolve_checkpoint(None, "kv_aware option 'checkpoint'", self.mode or "hybrid")


class KVAwareProposer(EagleTreeProposer):
    options_type = KVAwareOptions

    def __init__(self, vllm_config: Any = None, options: KVAwareOptions | None = None) -> None:
        super().__init__(vllm_config, options)

    def _checkpoint(self, opts: KVAwareOptions) -> str:
        return resolve_checkpoint(opts.checkpoint, "kv_aware option 'checkpoint'", opts.mode or "hybrid")
