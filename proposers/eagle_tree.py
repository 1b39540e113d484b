"""``eagle_tree``: EAGLE-2 dynamic draft trees (arXiv 2406.16858) from an EAGLE-3 head (arXiv 2503.01840) — public
tree API only.

The head (:class:`vllm_treespec.eagle.model.Eagle3Head`: any llama-family EAGLE-3 checkpoint vLLM's ``eagle3``
method loads, e.g. one trained by ``vllm-treespec train-eagle``) runs in plain torch inside the proposer, with its
own per-request KV cache, through :class:`vllm_treespec.eagle.drafter.EagleDrafter`: every step it ingests the
target's aux hidden states of the newly committed rows, expands the tree level by level (the ``top_k`` best nodes of
each level get their ``top_k`` most likely children) and reranks all candidates by cumulative log-probability, the
best ``num_speculative_tokens`` forming the tree. Verification is exact whatever the head drafts, so a weak or
mismatched head costs speed, never correctness.

A KV-aware head (:mod:`vllm_treespec.eagle.kv_head`, method ``kv_aware``) also cross-attends to the target's own
K/V of a few layers, which the drafter reads from the paged cache (``ctx.kv_cache``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Sequence

import msgspec

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer
from vllm_treespec.device_defaults import DEFAULT_MIN_NODE_CONFIDENCE, device_kind
from vllm_treespec.eagle.target import check_head_target, served_identity


def default_head_path() -> Path:
    """The default EAGLE-3 head for the embedded SmolLM2 model: the one trained into the cache folder, else the one
    shipped with the package; where ``vllm-treespec train-eagle`` would write it when there is neither."""
    from vllm_treespec.eagle.default_head import find_default_head, trained_head_path

    return find_default_head() or trained_head_path()


def default_kv_head_path(mode: str) -> Path:
    """The default head of ``mode``: the EAGLE-3 head for "hidden" (:func:`default_head_path`), else where
    ``vllm-treespec train-eagle --mode MODE`` writes the KV-aware head for the embedded model (none is shipped)."""
    from vllm_treespec.settings import default_cache_dir

    return default_head_path() if mode == "hidden" else default_cache_dir() / f"kv-aware-smollm2-135m-{mode}"


def resolve_checkpoint(value: str | None, what: str, mode: str = "hidden") -> str:
    """``value`` or, for None / "auto", the default head of ``mode``; a clear error when there is none."""
    if value in (None, "auto"):
        path = default_kv_head_path(mode)
        if not (path / "config.json").is_file():
            flag = "" if mode == "hidden" else f" --mode {mode}"
            shipped = "" if mode == "hidden" else ', or set "mode": "hidden" to draft with the shipped EAGLE-3 head'
            raise ValueError(f"{what}: no checkpoint given and no default head at {path}; train one with "
                             f"`vllm-treespec train-eagle{flag} -o {path}` or pass a checkpoint folder{shipped}")
        return str(path)
    if not (Path(value) / "config.json").is_file():
        raise ValueError(f"{what}: {value!r} is not a draft-head checkpoint folder (no config.json)")
    return value


class EagleTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: EAGLE-3 checkpoint folder, refused at start-up if trained for another model than the served one; None = the
    #: default head for the embedded SmolLM2 model (one trained into the cache folder, else the shipped one)
    checkpoint: str | None = None
    #: levels below the root
    depth: int = 6
    #: children per expanded node, and nodes expanded per level
    top_k: int = 8
    #: the head's compute dtype: "fastest" = bf16 or fp32, whichever runs the head's layers faster on this CPU (timed
    #: at load: bf16 halves the weights' bytes where the CPU has a bf16 GEMM, and costs several times fp32 where
    #: vLLM falls back to torch's, as on AVX2), "auto" = the target's, "int8" = int8 weights with fp32 activations
    #: (fbgemm; about half fp32's time on an AVX2 CPU, not chosen by "fastest"). Verification stays exact whatever
    #: it is
    dtype: Literal["fastest", "auto", "float32", "bfloat16", "float16", "int8"] = "fastest"
    #: requests whose draft KV is kept (least recently used ones are dropped first)
    max_cached_requests: int = 1024
    #: nodes whose path probability under the head (cumulative draft probability) is below this are neither verified
    #: nor expanded, even within the budget: on a compute-bound device each verified token costs forward time that
    #: only a likely node pays back. 0 = fill the budget; None = the device default (CPU 0.05, else 0)
    min_node_confidence: float | None = None

    def __post_init__(self) -> None:
        method = self.method_name()
        for name in ("depth", "top_k", "max_cached_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{method} option {name!r} must be >= 1, got {getattr(self, name)}")
        if self.min_node_confidence is not None and not 0.0 <= self.min_node_confidence < 1.0:
            raise ValueError(f"{method} option 'min_node_confidence' must be in [0, 1) (0 fills the budget), "
                             f"got {self.min_node_confidence}")
        if self.checkpoint not in (None, "auto") and not os.path.exists(self.checkpoint):
            raise ValueError(f"{method} option 'checkpoint': no such file or directory {self.checkpoint!r}")
        self.resolved_checkpoint()

    def method_name(self) -> str:
        return "eagle_tree"

    def resolved_checkpoint(self) -> str:
        """The head folder these options name (None / "auto": the default trained head); a clear error if none."""
        return resolve_checkpoint(self.checkpoint, f"{self.method_name()} option 'checkpoint'")


class EagleTreeProposer(TreeProposer):
    """EAGLE-2 dynamic trees from an EAGLE-3 head (or a KV-aware head given as ``checkpoint``)."""

    options_type = EagleTreeOptions
    needs_hidden_states = True

    def __init__(self, vllm_config: Any = None, options: EagleTreeOptions | None = None) -> None:
        from vllm_treespec.eagle.drafter import EagleDrafter  # torch: only once the method is used

        super().__init__(vllm_config, options)
        opts: EagleTreeOptions = self.options
        checkpoint = opts.resolved_checkpoint()
        self.check_served_model(opts, vllm_config)
        self.drafter = EagleDrafter.for_target(checkpoint, vllm_config, depth=opts.depth,
                                               top_k=opts.top_k, dtype=opts.dtype,
                                               max_cached_requests=opts.max_cached_requests)
        self.aux_hidden_state_layers = self.drafter.aux_layers
        self.needs_kv_cache = self.drafter.reads_target_kv
        self.min_node_confidence = (opts.min_node_confidence if opts.min_node_confidence is not None else
                                    DEFAULT_MIN_NODE_CONFIDENCE[device_kind(vllm_config)])

    @classmethod
    def check_served_model(cls, options: EagleTreeOptions, vllm_config: Any) -> None:
        option = f"{options.method_name()} option 'checkpoint'"
        if options.checkpoint in (None, "auto"):
            option += " (not given: the default head for the embedded SmolLM2 model)"
        check_head_target(options.resolved_checkpoint(), served_identity(vllm_config), option)

    def load_model(self, model: Any) -> None:
        super().load_model(model)
        self.drafter.load_from_target(model, self.vllm_config)

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        ready = self.drafter.ingest(ctx)
        ctx.deferred_seconds = self.drafter.catch_up_seconds  # rows earlier steps left: not this call's price
        want = [i for i in ready if ctx.needs_draft(i)]
        trees: list[DraftTree | None] = [None] * ctx.num_reqs
        if want and ctx.max_nodes > 0:
            for i, tree in self.drafter.draft(ctx, want, ctx.useful_max_nodes,
                                              min_confidence=self.min_node_confidence,
                                              max_depth=ctx.useful_depth).items():
                trees[i] = tree
        return trees

    def observe(self, ctx: ProposeContext) -> None:
        self.drafter.observe(ctx)

    def catch_up_price(self, ctx: ProposeContext, rows: Sequence[int]) -> float:
        return self.drafter.backlog_seconds([ctx.req_ids[i] for i in rows])

    def on_requests_finished(self, req_ids: set[str]) -> None:
        self.drafter.release(req_ids)
