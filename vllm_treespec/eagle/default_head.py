"""The default EAGLE-3 head for the embedded SmolLM2 model: one trained into the cache folder
(``vllm-treespec train-eagle -o <cache>/eagle3-smollm2-135m``) wins, otherwise the one shipped inside the package
(``vllm_treespec/heads/eagle3-smollm2-135m``, see its MODEL_CARD.md).

Used when no head path is given: ``eagle_tree`` / ``kv_aware`` (mode ``hidden``) without ``checkpoint``, graft's
``"eagle_checkpoint": "auto"``, ``vllm-treespec model smollm2-eagle3``. Which one is used is logged once per process.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("vllm.treespec")

#: the folder name of the head, in the cache folder and in the package alike
DEFAULT_HEAD_NAME = "eagle3-smollm2-135m"
#: heads shipped inside the installed package (package data)
SHIPPED_HEADS_DIR = Path(__file__).resolve().parent.parent / "heads"
#: what the shipped head may weigh (config + weights), so that the repository and the wheel stay small
MAX_SHIPPED_HEAD_BYTES = 20 * 1000 * 1000

_logged: set[Path] = set()


def trained_head_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where ``vllm-treespec train-eagle`` writes the default head (it need not exist)."""
    from vllm_treespec.settings import default_cache_dir

    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return cache / DEFAULT_HEAD_NAME


def shipped_head_path() -> Path:
    """The head shipped with the package (present once its weights are committed)."""
    return SHIPPED_HEADS_DIR / DEFAULT_HEAD_NAME


def is_head_folder(folder: Path) -> bool:
    """A complete head checkpoint: config.json and weights (the trainer writes the weights first)."""
    return (folder / "config.json").is_file() and (
        any(folder.glob("*.safetensors")) or (folder / "pytorch_model.bin").is_file())


def find_default_head(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The head trained into the cache if there is one, else the shipped one, else None; the choice is logged once."""
    for folder, origin in ((trained_head_path(cache_dir), "trained into the cache folder"),
                           (shipped_head_path(), "shipped with vllm-treespec")):
        if is_head_folder(folder):
            if folder not in _logged:
                _logged.add(folder)
                logger.info("vllm-treespec: default EAGLE-3 head: %s (%s)", folder, origin)
            return folder
    return None
