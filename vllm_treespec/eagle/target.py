"""Which target model a draft head was trained for, and whether it fits the served model.

A head shares the target's input embedding and reads its hidden states, so it only works for a target with the same
vocabulary, hidden size and enough layers for its aux layers; a head trained for another model of the same shapes
would run but draft poorly. The trainer records its target in the head's ``config.json`` under
:data:`TARGET_KEY` (name, architecture, vocabulary and hidden size, layers); heads trained elsewhere record only what
every EAGLE-3 config has (``vocab_size``, ``target_hidden_size``, the aux layers), and only that is compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: the head config.json key under which the trainer records the target model
TARGET_KEY = "treespec_target"


class HeadTargetMismatch(ValueError):
    """A draft head trained for another model than the served one."""


@dataclass(frozen=True)
class ModelIdentity:
    """What decides whether a head fits a model. None = not known (not compared)."""

    name: str | None
    architecture: str | None
    vocab_size: int | None
    hidden_size: int | None
    num_hidden_layers: int | None

    def describe(self) -> str:
        parts = [self.architecture or "architecture not recorded",
                 f"vocab {self.vocab_size}" if self.vocab_size is not None else "vocab size not recorded",
                 f"hidden {self.hidden_size}" if self.hidden_size is not None else "hidden size not recorded"]
        if self.num_hidden_layers is not None:
            parts.append(f"{self.num_hidden_layers} layers")
        return f"{self.name or 'unnamed model'} ({', '.join(parts)})"


def identity_from_hf_config(cfg: Any, name: str | None = None) -> ModelIdentity:
    """A model's identity from its Hugging Face config (a ``PretrainedConfig`` or the ``config.json`` dict)."""
    get = cfg.get if isinstance(cfg, dict) else (lambda key, default=None: getattr(cfg, key, default))
    text = get("text_config")  # multimodal configs keep the language model's shapes here
    if text is not None and get("hidden_size") is None:
        get = text.get if isinstance(text, dict) else (lambda key, default=None: getattr(text, key, default))
    architectures = (cfg.get("architectures") if isinstance(cfg, dict) else getattr(cfg, "architectures", None)) or []
    return ModelIdentity(name=name, architecture=architectures[0] if architectures else None,
                         vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
                         num_hidden_layers=get("num_hidden_layers"))


def served_identity(vllm_config: Any) -> ModelIdentity | None:
    """The served model's identity from vLLM's config (None without a model config, e.g. in unit tests)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    hf_config = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    identity = identity_from_hf_config(hf_config, name=str(getattr(model_config, "model", None) or "") or None)
    architectures = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    if architectures and identity.architecture is None:
        identity = ModelIdentity(identity.name, architectures[0], identity.vocab_size, identity.hidden_size,
                                 identity.num_hidden_layers)
    return identity


def target_record(hf_config: Any, name: str) -> dict:
    """What the trainer writes under :data:`TARGET_KEY` in the head's config.json."""
    t = identity_from_hf_config(hf_config, name)
    return {"name": t.name, "architecture": t.architecture, "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers}


def head_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the head's config ({e})") from e


def head_target(cfg: dict) -> ModelIdentity:
    """The target a head's config.json says it was trained for: the trainer's record, else what any EAGLE-3 config
    implies (the vocabulary its ``t2d`` covers; the hidden size its ``fc`` reads)."""
    record = cfg.get(TARGET_KEY) or {}
    hidden = cfg.get("target_hidden_size") or cfg.get("hidden_size")
    return ModelIdentity(name=record.get("name"), architecture=record.get("architecture"),
                         vocab_size=record.get("vocab_size", cfg.get("vocab_size")),
                         hidden_size=record.get("hidden_size", hidden),
                         num_hidden_layers=record.get("num_hidden_layers"))


def _aux_layers(cfg: dict) -> list[int]:
    eagle = cfg.get("eagle_config") or {}
    return list(cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or [])


def mismatches(cfg: dict, served: ModelIdentity) -> list[str]:
    """Why the head of config ``cfg`` does not fit ``served`` (empty: it fits). Only known values are compared."""
    head = head_target(cfg)
    why = []
    if head.architecture and served.architecture and head.architecture != served.architecture:
        why.append(f"architecture {head.architecture} vs {served.architecture}")
    if head.vocab_size is not None and served.vocab_size is not None and head.vocab_size != served.vocab_size:
        why.append(f"vocab size {head.vocab_size} vs {served.vocab_size}")
    if served.hidden_size is not None:
        # the head's own width must be the target's too: it embeds tokens with the target's embedding
        for what, size in (("hidden size", head.hidden_size), ("embedding width", cfg.get("hidden_size"))):
            if size is not None and size != served.hidden_size:
                why.append(f"{what} {size} vs {served.hidden_size}")
                break
    if head.num_hidden_layers is not None and served.num_hidden_layers is not None \
            and head.num_hidden_layers != served.num_hidden_layers:
        why.append(f"{head.num_hidden_layers} layers vs {served.num_hidden_layers}")
    elif served.num_hidden_layers is not None and any(layer >= served.num_hidden_layers for layer in _aux_layers(cfg)):
        why.append(f"aux layers {_aux_layers(cfg)} vs {served.num_hidden_layers} layers")
    return why


def mismatch_message(folder: str | Path, served: ModelIdentity | None) -> str | None:
    """"the draft head F was trained for X, but the served model is Y (why)", or None when the head fits (or the
    served model is not known)."""
    if served is None:
        return None
    cfg = head_config(folder)
    why = mismatches(cfg, served)
    if not why:
        return None
    return (f"the draft head {str(folder)!r} was trained for {head_target(cfg).describe()}, but the served model is "
            f"{served.describe()} ({'; '.join(why)})")


def check_head_target(folder: str | Path, served: ModelIdentity | None, option: str, alternative: str = "") -> None:
    """Refuse a head whose target is not the served model, naming ``option`` and both models; ``alternative`` is
    appended to the fix (e.g. how to run without a head)."""
    message = mismatch_message(folder, served)
    if message:
        raise HeadTargetMismatch(f"{option}: {message}. Pass a head trained for the served model (`vllm-treespec "
                                 f"train-eagle --model <served model folder> -o <head folder>`){alternative}")
