"""Translation of ``--speculative-config`` / ``LLM(speculative_config=...)`` for our methods.

vLLM validates ``method`` against a Literal before any of its own hooks run, so a tree method is rewritten before
``SpeculativeConfig`` is built: ``{"method": "graft", "budget": 48, ...}`` becomes
``{"method": "custom_class", "model": "<proposer class path>", ...vLLM's own keys}`` and our options travel to every
process in ``additional_config["vllm_treespec"]``. Options are typed msgspec Structs declared by each proposer
(``TreeProposer.options_type``); unknown keys and wrong types fail here, at startup, with one message that names the
field, the bad value and the valid choices.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Any

import msgspec

from vllm_treespec import api, registry
from vllm_treespec.settings import ADDITIONAL_CONFIG_KEY, COST_BUDGET_KEY

TREE_MODE_ENV = "VLLM_TREESPEC_TREE_MODE"
DEFAULT_NUM_SPECULATIVE_TOKENS = 32
MAX_NUM_SPECULATIVE_TOKENS = 128  # vLLM's RejectionSampler MAX_SPEC_LEN


class TreeSpecConfigError(ValueError):
    """A speculative config that vllm-treespec cannot accept; the message names the field and the fix."""


def _vllm_spec_fields() -> set[str]:
    from vllm.config.speculative import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def _vllm_methods() -> list[str]:
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flatten(t):
        for a in get_args(t):
            if isinstance(a, str):
                yield a
            else:
                yield from flatten(a)

    return sorted(set(flatten(SpeculativeMethod)))


def _is_tree_proposer_path(path: str) -> bool:
    try:
        return issubclass(registry.load_proposer_class(path), api.TreeProposer)
    except (ImportError, TypeError):
        return False


def resolve_method(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(method name as given, proposer class path) if ``spec`` selects one of our tree proposers, else None."""
    method = spec.get("method")
    if method is None or method == "custom_class":
        model = spec.get("model")
        if isinstance(model, str) and registry.is_dotted_path(model) and _is_tree_proposer_path(model):
            return model, model
        return None
    if not isinstance(method, str):
        raise TreeSpecConfigError(f"speculative_config.method must be a string, got {method!r}")
    if method in _vllm_methods():
        return None
    known = registry.registered_proposers()
    if method in known:
        return method, known[method]
    if registry.is_dotted_path(method):
        try:
            cls = registry.load_proposer_class(method)
        except ImportError as e:
            raise TreeSpecConfigError(
                f"speculative_config.method={method!r}: {e}. A dotted path must name an importable TreeProposer "
                "subclass (is its package installed / on PYTHONPATH in every vLLM process?)") from e
        if not issubclass(cls, api.TreeProposer):
            raise TreeSpecConfigError(
                f"speculative_config.method={method!r} is not a subclass of vllm_treespec.api.TreeProposer")
        return method, method
    raise TreeSpecConfigError(
        f"speculative_config.method={method!r} is not a known method. Tree methods: {sorted(known)}; "
        f"vLLM methods: {_vllm_methods()}; or a dotted path to a TreeProposer subclass.")


def parse_options(method: str, options_type: type[msgspec.Struct] | None, raw: dict[str, Any]) -> Any:
    if options_type is None:
        if raw:
            raise TreeSpecConfigError(
                f"speculative_config: method {method!r} takes no options, got unknown key(s) {sorted(raw)}")
        return None
    valid = sorted(options_type.__struct_fields__)
    unknown = sorted(set(raw) - set(valid))
    if unknown:
        raise TreeSpecConfigError(
            f"speculative_config: unknown key(s) {unknown} for method {method!r}. Valid keys: {valid} "
            "(plus vLLM's own SpeculativeConfig fields).")
    try:
        return msgspec.convert(raw, options_type, strict=True)
    except msgspec.ValidationError as e:
        raise TreeSpecConfigError(f"speculative_config (method {method!r}): {_readable(e)}") from e
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise TreeSpecConfigError(f"speculative_config (method {method!r}): {e}") from e


def _readable(e: msgspec.ValidationError) -> str:
    # msgspec says "Expected `int`, got `str` - at `$.budget`"; name the field the way users wrote it.
    msg = str(e)
    if " - at `$." in msg:
        what, _, where = msg.partition(" - at `$.")
        return f"field {where.rstrip('`')!r}: {what}"
    return msg


def translate(spec: dict[str, Any] | None, additional_config: dict[str, Any] | None,
              model_config: Any = None) -> tuple[dict[str, Any] | None, dict[str, Any] | None, bool]:
    """Rewrite a speculative-config dict for vLLM. Returns (spec, additional_config, is_tree_method). With the
    served ``model_config``, the method's options are also checked against the model
    (``TreeProposer.check_served_model``: e.g. a draft head trained for another model)."""
    if not spec:
        return spec, additional_config, False
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    resolved = resolve_method(spec)
    if resolved is None:
        return spec, additional_config, False
    method, class_path = resolved
    cls = registry.load_proposer_class(class_path)

    vllm_fields = _vllm_spec_fields() - {"method", "model"}
    ours = {k: v for k, v in spec.items() if k not in vllm_fields and k not in ("method", "model", COST_BUDGET_KEY)}
    options = parse_options(method, cls.options_type, ours)
    if model_config is not None and options is not None:
        cls.check_served_model(options, SimpleNamespace(model_config=model_config))
    cost_budget = spec.get(COST_BUDGET_KEY, True)
    if not isinstance(cost_budget, bool):
        raise TreeSpecConfigError(
            f"speculative_config.{COST_BUDGET_KEY}={cost_budget!r}: must be true (verify the draft nodes that pay "
            "under this engine's measured step cost, the default) or false (every tree as proposed)")

    n = spec.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NUM_SPECULATIVE_TOKENS:
        raise TreeSpecConfigError(
            f"speculative_config.num_speculative_tokens={n!r}: the tree node budget must be an integer in "
            f"[1, {MAX_NUM_SPECULATIVE_TOKENS}] (vLLM verifies at most {MAX_NUM_SPECULATIVE_TOKENS} drafts per step)")

    new_spec = {k: v for k, v in spec.items() if k in vllm_fields}
    new_spec.update(method="custom_class", model=class_path, num_speculative_tokens=n)
    extra = dict(additional_config or {})
    extra[ADDITIONAL_CONFIG_KEY] = {
        "method": method,
        "class_path": class_path,
        "options": msgspec.to_builtins(options) if options is not None else None,
        COST_BUDGET_KEY: cost_budget,
    }
    return new_spec, extra, True


def check_parallelism(parallel_config: Any) -> None:
    """Every rank must verify the same tree; until the topology is broadcast across ranks, tree mode is TP=1, PP=1."""
    tp = getattr(parallel_config, "tensor_parallel_size", 1)
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if tp > 1 or pp > 1:
        raise TreeSpecConfigError(
            f"tree speculative methods need tensor_parallel_size=1 and pipeline_parallel_size=1 (got TP={tp}, "
            f"PP={pp}): draft-tree topology is not yet shared across ranks. Use one rank, or a vLLM chain method.")


def tree_mode_requested() -> bool:
    return os.environ.get(TREE_MODE_ENV) == "1"
