"""Our settings: the cache folder for models and heads, and the proposer options inside vLLM's config (process 0
stores them in ``additional_config["vllm_treespec"]``, see :mod:`vllm_treespec.config`; every process reads them back
here)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec

ADDITIONAL_CONFIG_KEY = "vllm_treespec"
CACHE_DIR_ENV = "VLLM_TREESPEC_CACHE"
#: the shared speculative-config key that switches the measured step-cost budget (vllm_treespec.cost) off
COST_BUDGET_KEY = "cost_budget"
#: "1": tree verifiers never draft; every step takes the path of a step the gate refuses (the proposer only observes
#: it): what a speculative engine's plain steps cost against no speculation's (``bench serve --plain``)
NEVER_DRAFT_ENV = "VLLM_TREESPEC_NEVER_DRAFT"


def default_cache_dir() -> Path:
    """``$VLLM_TREESPEC_CACHE`` if set, else ``~/.cache/vllm_treespec``: converted models, trained heads, work files."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_treespec"


def write_json_atomically(path: Path, value: Any) -> None:
    """``value`` as indented JSON (msgspec) at ``path``, through a temporary file renamed into place, so that a reader
    never sees half a file; creates the folder. Raises OSError (the temporary file removed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(value), indent=1))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def treespec_settings(vllm_config: Any) -> dict[str, Any] | None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    return extra.get(ADDITIONAL_CONFIG_KEY)


def cost_budget_enabled(vllm_config: Any) -> bool:
    """The speculative config's ``cost_budget`` (default on): trim trees to the nodes the measured step cost pays."""
    return bool((treespec_settings(vllm_config) or {}).get(COST_BUDGET_KEY, True))


def options_from_vllm_config(vllm_config: Any, options_type: type[msgspec.Struct] | None) -> Any:
    """The proposer's typed options, as translated in process 0 (defaults when none were given)."""
    if options_type is None:
        return None
    settings = treespec_settings(vllm_config) or {}
    raw = settings.get("options") or {}
    return msgspec.convert(raw, options_type, strict=False)
