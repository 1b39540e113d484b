"""``kv_aware``: draft trees from a KV-aware head (KVShot, arXiv 2604.26412) — public tree API only.

The head (:class:`vllm_treespec.eagle.kv_head.KVAwareHead`, trained by ``vllm-treespec train-eagle --mode kv|hybrid``)
is the EAGLE-3 head plus cross-attention over the target's own K/V of a few layers, which the proposer reads through
the read-only paged-cache view the tree API hands to proposers that set ``needs_kv_cache``. Drafting is
``eagle_tree``'s (EAGLE-2 dynamic trees; ``top_k=1`` drafts a chain); only the head differs. ``mode`` picks the
default trained head when no ``checkpoint`` is given; ``mode: hidden`` is the plain EAGLE-3 head, for side-by-side runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from vllm_treespec.proposers.eagle_tree import EagleTreeOptions, EagleTreeProposer, resolve_checkpoint


def _checkpoint_mode(folder: str) -> str:
    from vllm_treespec.eagle.kv_head import is_kv_aware_config

    cfg = json.loads((Path(folder) / "config.json").read_text())
    return (cfg.get("kv_aware") or {}).get("mode", "hybrid") if is_kv_aware_config(cfg) else "hidden"


class KVAwareOptions(EagleTreeOptions, kw_only=True):
    #: which trained head to use when ``checkpoint`` is not given; checked against the checkpoint when it is
    mode: Literal["hybrid", "kv", "hidden"] | None = None

    def method_name(self) -> str:
        return "kv_aware"

    def resolved_checkpoint(self) -> str:
        folder = resolve_checkpoint(self.checkpoint, "kv_aware option 'checkpoint'", self.mode or "hybrid")
        if self.checkpoint not in (None, "auto") and self.mode is not None:
            found = _checkpoint_mode(folder)
            if found != self.mode:
                raise ValueError(f"kv_aware option 'mode' is {self.mode!r} but checkpoint {self.checkpoint!r} is a "
                                 f"{found!r} head; drop 'mode' or pick a matching checkpoint")
        return folder


class KVAwareProposer(EagleTreeProposer):
    options_type = KVAwareOptions
