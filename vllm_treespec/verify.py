"""Worker-side tree verification: "verify as a tree, commit as a chain".

One :class:`TreeVerifier` lives on each model runner whose drafter is a :class:`~vllm_treespec.api.TreeProposer`.
Per step it
1. asks the proposer for trees and hands vLLM the flattened node lists (the scheduler sees ordinary drafts);
2. when those drafts come back scheduled, re-attaches the topology (only if the scheduled tokens are a prefix of
   the registered tree: truncation and placeholder drafts fall back to chains), rewrites the nodes' RoPE positions to
   ``context + depth`` and publishes the tree batch to the attention backend;
3. after the forward, accepts the longest valid path (greedy or lossless sampling), returns it in vLLM's chain form,
   and moves the accepted nodes' K/V to the chain slots, so that everything downstream sees a chain step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np
import torch

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer, VerificationResult
from vllm_treespec.attn import layout, plan
from vllm_treespec.sampling import sample_accept
from vllm_treespec.tree import TreeBatch, greedy_accept

logger = logging.getLogger("vllm.treespec")


class StepTimer:
    """Accumulates the verifier's own host time per phase (for the overhead benchmark)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds


def tree_unsupported_reason(sampling_params: Any) -> str | None:
    """Why a request must run as a chain (its sampling reads draft-order context or draft logprobs), else None."""
    sp = sampling_params
    if sp is None:
        return "not a generation request"
    checks = (
        (sp.logprobs is not None, "logprobs"),
        (sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1, "penalties"),
        (bool(sp.bad_words), "bad_words"),
        (sp.min_tokens > 0, "min_tokens"),
        (sp.min_p > 0, "min_p"),
        (bool(sp.logit_bias), "logit_bias"),
        (sp.allowed_token_ids is not None, "allowed_token_ids"),
        (sp.seed is not None, "per-request seed"),
        (sp.structured_outputs is not None, "structured output"),
    )
    for failed, name in checks:
        if failed:
            return name
    return None


def tree_attention_impls() -> tuple[type, ...]:
    """The attention impls with a tree path on this platform (CPU: the CPU_ATTN override; CUDA: FLASH_ATTN's)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_treespec.attn.cpu import TreeCPUAttentionImpl

        return (TreeCPUAttentionImpl,)
    from vllm_treespec.attn.flash import TreeFlashAttentionImpl

    return (TreeFlashAttentionImpl,)


class TreeVerifier:
    def __init__(self, runner: Any, proposer: TreeProposer) -> None:
        self.runner = runner
        self.proposer = proposer
        self.max_nodes = int(runner.speculative_config.num_speculative_tokens)
        self.pending: dict[str, DraftTree] = {}
        self.batch: TreeBatch | None = None
        self.enabled: bool | None = None  # decided lazily, once the model and KV cache exist
        self.timer = StepTimer()
        self.stats = {"tree_steps": 0, "tree_rows": 0, "accepted": 0}
        self.last_moves: tuple[np.ndarray, np.ndarray] | None = None
        self._layers: list[Any] | None = None

    # --- support -----------------------------------------------------------------------------------------------
    def _decide_support(self) -> bool:
        reason = self._unsupported_model_reason()
        if reason:
            logger.warning("vllm_treespec: tree verification is off for this model (%s); proposals run as chains.",
                           reason)
        return reason is None

    def _unsupported_model_reason(self) -> str | None:
        runner = self.runner
        if getattr(runner, "uses_mrope", False):
            return "M-RoPE positions"
        if runner.vllm_config.parallel_config.pipeline_parallel_size > 1:
            return "pipeline parallelism"
        if getattr(runner.vllm_config.parallel_config, "data_parallel_size", 1) > 1:
            return "data parallelism (ranks re-dispatch CUDA graphs with a mode agreed across ranks)"
        if not runner.vllm_config.model_config.is_attention_free and self._attention_layers() == []:
            return "no attention layers found"
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        kv_config = getattr(runner, "kv_cache_config", None)
        if kv_config is not None:
            for group in kv_config.kv_cache_groups:
                spec = group.kv_cache_spec
                if type(spec) is not FullAttentionSpec:
                    return f"{type(spec).__name__} layers (sliding window / hybrid models)"
        for layer in self._attention_layers():
            impl = layer.impl
            if getattr(impl, "sliding_window", -1) not in (-1, None, (-1, -1)):  # FlashAttention: (-1, -1) = none
                return "sliding-window attention"
            if getattr(impl, "dcp_world_size", 1) > 1:
                return "decode context parallelism"
            if getattr(impl, "alibi_slopes", None) is not None or getattr(impl, "sinks", None) is not None:
                return "ALiBi / attention sinks"
            if getattr(impl, "logits_soft_cap", 0):
                return "logit soft-capping"
            if getattr(impl, "kv_cache_dtype", "auto") != "auto":
                return f"kv_cache_dtype={impl.kv_cache_dtype}"
            if not isinstance(impl, tree_attention_impls()):
                return (f"attention backend {type(impl).__name__} has no tree path; on CUDA trees need FLASH_ATTN "
                        "(--attention-backend FLASH_ATTN)")
        layer = self._attention_layers()[0]
        if hasattr(layer.impl, "compact_tree_kv"):
            return None  # reads and compacts the cache through its logical view: no layout adapter to check
        kv = layer.kv_cache
        if not layout.self_check(layer.isa, kv.dtype, kv.shape[2], kv.shape[3] // 2, kv.shape[1]):
            return f"the KV cache layout of ISA {layer.isa!r} failed the read-back self-check"
        return None

    def _attention_layers(self) -> list[Any]:
        if self._layers is None:
            from vllm.config import get_layers_from_vllm_config
            from vllm.model_executor.layers.attention import Attention

            layers = get_layers_from_vllm_config(self.runner.vllm_config, Attention)
            self._layers = [layer for layer in layers.values() if layer.kv_cache is not None and layer.kv_cache.numel()]
        return self._layers

    # --- hook: propose ---------------------------------------------------------------------------------------
    def propose(self, sampled_token_ids: list[list[int]], hidden_states=None, aux_hidden_states=None,
                query_start_loc=None, scheduled_drafts: dict[str, list[int]] | None = None) -> list[list[int]]:
        if self.enabled is None:
            self.enabled = self._decide_support()
        batch = self.runner.input_batch
        num_reqs = len(sampled_token_ids)
        req_ids = list(batch.req_ids[:num_reqs])
        ctx = ProposeContext(req_ids=req_ids, sampled_token_ids=sampled_token_ids,
                             num_tokens=batch.num_tokens_no_spec, token_ids=batch.token_ids_cpu,
                             max_nodes=self.max_nodes)
        proposer = self.proposer
        if proposer.needs_hidden_states and hidden_states is not None and query_start_loc is not None:
            # Rows were chainized in sample(): the row that produced request i's newest token is its last query row
            # minus the drafts it rejected (prefill chunks have no drafts: their last row).
            ends = np.asarray(query_start_loc[1: num_reqs + 1], np.int64) - 1
            drafts = np.array([len((scheduled_drafts or {}).get(r, ())) for r in req_ids], np.int64)
            accepted = np.array([max(len(s) - 1, 0) for s in sampled_token_ids], np.int64)
            ctx.hidden_states = hidden_states
            layers = tuple(proposer.aux_hidden_state_layers)
            if aux_hidden_states and layers and len(aux_hidden_states) == len(set(layers)):
                # the model returns them in forward (ascending layer) order; hand them over in the asked order
                ascending = sorted(set(layers))
                aux_hidden_states = [aux_hidden_states[ascending.index(layer)] for layer in layers]
            ctx.aux_hidden_states = aux_hidden_states
            ctx.hidden_row_index = ends - (drafts - accepted)
            ctx.hidden_row_start = np.asarray(query_start_loc[:num_reqs], np.int64)
            # computed before this step = position of the step's first row
            ctx.hidden_position_start = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64)
        if proposer.needs_kv_cache and self.enabled:
            from vllm_treespec.kv_view import build_view

            ctx.kv_cache = build_view(self.runner, self._attention_layers(), num_reqs, sampled_token_ids,
                                      query_start_loc)
        trees = self.proposer.propose_trees(ctx)
        if len(trees) != num_reqs:
            raise RuntimeError(f"{type(self.proposer).__name__}.propose_trees returned {len(trees)} trees "
                               f"for {num_reqs} requests")
        drafts: list[list[int]] = []
        pending: dict[str, DraftTree] = {}
        for i, (req_id, tree) in enumerate(zip(req_ids, trees)):
            if tree is None or tree.num_nodes == 0 or not ctx.needs_draft(i):
                drafts.append([])
                continue
            tree = tree.truncate(self.max_nodes)
            if not tree.is_chain():
                if self.enabled and self._request_can_use_tree(req_id):
                    pending[req_id] = tree
                else:
                    tree = tree.first_child_chain()
            drafts.append(tree.token_ids.tolist())
        self.pending = pending
        return drafts

    def _request_can_use_tree(self, req_id: str) -> bool:
        state = self.runner.requests.get(req_id)
        return state is not None and tree_unsupported_reason(state.sampling_params) is None

    # --- hook: after _prepare_inputs -------------------------------------------------------------------------
    def attach(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        started = time.perf_counter()
        pending, self.pending = self.pending, {}
        self.batch = None
        plan.publish(None)
        if not pending:
            return
        input_batch = self.runner.input_batch
        found = []
        for req_id, spec_tokens in scheduler_output.scheduled_spec_decode_tokens.items():
            tree = pending.get(req_id)
            n = len(spec_tokens)
            if tree is None or n == 0 or n > tree.num_nodes:
                continue
            if not np.array_equal(tree.token_ids[:n], np.asarray(spec_tokens, dtype=np.int64)):
                continue
            tree = tree.truncate(n)
            if tree.is_chain():
                continue
            row = input_batch.req_id_to_index[req_id]
            if int(num_scheduled_tokens[row]) != n + 1:
                continue
            found.append((row, req_id, tree))
        if not found:
            return
        found.sort(key=lambda x: x[0])
        rows = np.array([f[0] for f in found], np.int64)
        query_start = self.runner.query_start_loc.np[rows]
        context_len = input_batch.num_computed_tokens_cpu[rows]
        batch = TreeBatch.build(rows, [f[1] for f in found], [f[2] for f in found], query_start, context_len)
        # Slots stay linear (already computed); only RoPE positions follow depth.
        positions = self.runner.positions
        positions[torch.from_numpy(batch.node_token_index()).to(positions.device)] = (
            torch.from_numpy(batch.node_positions()).to(positions.device, positions.dtype))
        self.batch = batch
        plan.publish(batch)
        if self.stats["tree_steps"] == 0:
            logger.info("vllm_treespec: tree verification active (%d tree rows in the first tree step)", batch.num_reqs)
        self.timer.add("attach", time.perf_counter() - started)

    # --- hook: around _sample -----------------------------------------------------------------------------------
    def sample(self, original, logits: torch.Tensor, spec_decode_metadata: Any):
        batch, self.batch = self.batch, None
        plan.publish(None)
        if batch is None or spec_decode_metadata is None:
            return original(logits, spec_decode_metadata)
        started = time.perf_counter()
        num_sampled = np.asarray(spec_decode_metadata.num_draft_tokens, np.int64) + 1
        row_start = np.cumsum(num_sampled) - num_sampled  # first logits row of each batch row
        widths = np.diff(batch.node_offsets) + 1
        tree_rows_start = row_start[batch.rows]
        logits_index = torch.from_numpy(np.repeat(tree_rows_start, widths)
                                        + (np.arange(widths.sum()) - np.repeat(np.cumsum(widths) - widths, widths))
                                        ).to(logits.device)
        row_offsets = np.cumsum(widths) - widths
        greedy = self._greedy_mask(batch)
        # Read what acceptance needs before vLLM's sampler runs (it may modify logits in place): argmax for greedy
        # rows; a float32 copy only where sampling or the proposer needs full distributions.
        tree_logits = None
        if not greedy.all() or self.proposer.wants_target_logits:
            tree_logits = logits.index_select(0, logits_index).to(torch.float32)
            argmax = tree_logits.argmax(dim=-1).cpu().numpy()  # the cast is exact: same argmax, one pass fewer
        else:
            argmax = logits.index_select(0, logits_index).argmax(dim=-1).cpu().numpy()
        self.timer.add("accept", time.perf_counter() - started)

        output = original(logits, spec_decode_metadata)

        started = time.perf_counter()
        max_len = output.sampled_token_ids.shape[1] - 1
        out_tokens, out_nodes, out_len = greedy_accept(
            batch.tokens, batch.parents, batch.depth, batch.node_offsets, row_offsets, argmax, max_len)
        if not greedy.all():
            self._sample_random(batch, ~greedy, tree_logits, row_offsets, out_tokens, out_nodes, out_len)
        sampled = output.sampled_token_ids
        sampled[torch.from_numpy(batch.rows).to(sampled.device)] = torch.from_numpy(out_tokens).to(sampled.device,
                                                                                                  sampled.dtype)
        self.timer.add("accept", time.perf_counter() - started)

        started = time.perf_counter()
        self.last_moves = self._compact(batch, out_nodes, out_len)
        self.timer.add("compact", time.perf_counter() - started)
        self.timer.steps += 1
        self.stats["tree_steps"] += 1
        self.stats["tree_rows"] += batch.num_reqs
        self.stats["accepted"] += int(out_len.sum())
        if os.environ.get("VLLM_TREESPEC_DEBUG"):
            logger.warning("vllm_treespec step: rows=%s accepted=%s", batch.rows.tolist(), out_len.tolist())

        self._notify(batch, out_tokens, out_nodes, out_len, tree_logits, row_offsets, widths)
        return output

    def _greedy_mask(self, batch: TreeBatch) -> np.ndarray:
        from vllm.sampling_params import SamplingType

        requests = self.runner.requests
        return np.array([requests[r].sampling_params.sampling_type == SamplingType.GREEDY for r in batch.req_ids])

    def _sample_random(self, batch: TreeBatch, random_mask: np.ndarray, tree_logits: torch.Tensor,
                       row_offsets: np.ndarray, out_tokens, out_nodes, out_len) -> None:
        from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

        sampling_metadata = self.runner.input_batch.sampling_metadata
        num_batch_rows = self.runner.input_batch.num_reqs
        picked = np.nonzero(random_mask)[0]
        widths = np.diff(batch.node_offsets) + 1
        counts = np.zeros(num_batch_rows, np.int64)
        counts[batch.rows[picked]] = widths[picked]
        index = np.concatenate([np.arange(row_offsets[r], row_offsets[r] + widths[r]) for r in picked])
        # vLLM's own temperature / top-k / top-p, applied to the tree rows of the sampled requests (batch-row order).
        processed = apply_sampling_constraints(tree_logits[torch.from_numpy(index)].clone(),
                                               torch.from_numpy(np.cumsum(counts)).to(tree_logits.device, torch.int32),
                                               sampling_metadata)
        probs = processed.softmax(dim=-1)
        offset = 0
        for r in picked:
            start, end = batch.node_offsets[r], batch.node_offsets[r + 1]
            path, token = sample_accept(batch.tokens[start:end], batch.parents[start:end],
                                        probs[offset: offset + widths[r]])
            offset += widths[r]
            out_tokens[r, :] = -1
            out_nodes[r, :] = -1
            out_tokens[r, : len(path)] = batch.tokens[start + np.asarray(path, np.int64)] if path else []
            out_tokens[r, len(path)] = token
            out_nodes[r, : len(path)] = path
            out_len[r] = len(path)

    # --- KV compaction --------------------------------------------------------------------------------------------
    def _compact(self, batch: TreeBatch, out_nodes: np.ndarray, out_len: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
        """Move accepted nodes' K/V from their linear slots (context + 1 + node) to chain slots (context + 1 + k).
        Returns the (source, destination) flattened-query rows, for chainizing hidden states."""
        src_pos, dst_pos, rows, src_tok, dst_tok = [], [], [], [], []
        for r in range(batch.num_reqs):
            a = int(out_len[r])
            if a == 0:
                continue
            nodes = out_nodes[r, :a]
            k = np.arange(a)
            moved = nodes != k
            if not moved.any():
                continue
            base = int(batch.context_len[r]) + 1
            src_pos.append(base + nodes[moved])
            dst_pos.append(base + k[moved])
            rows.append(np.full(int(moved.sum()), batch.rows[r]))
            src_tok.append(int(batch.query_start[r]) + 1 + nodes[moved])
            dst_tok.append(int(batch.query_start[r]) + 1 + k[moved])
        if not src_pos:
            return None
        rows_np = np.concatenate(rows)
        src = self._slots(rows_np, np.concatenate(src_pos))
        dst = self._slots(rows_np, np.concatenate(dst_pos))
        layers = self._attention_layers()
        src, dst = src.to(layers[0].kv_cache.device), dst.to(layers[0].kv_cache.device)  # one copy for all layers
        for layer in layers:
            compact = getattr(layer.impl, "compact_tree_kv", None)
            if compact is not None:  # device backends: gather-then-scatter on the logical view
                compact(layer.kv_cache, src, dst)
                continue
            key, value = layout.read_slots(layer.kv_cache, src)  # gather all first, then scatter
            layout.write_slots(layer.kv_cache, dst, key, value, layer.isa,
                               layer._k_scale_float, layer._v_scale_float, layer.impl.kv_cache_dtype)
        return np.concatenate(src_tok), np.concatenate(dst_tok)

    def chainize_rows(self, tensors) -> None:
        """Apply this step's accepted-path moves to per-token rows (hidden / aux hidden states) in place."""
        moves, self.last_moves = self.last_moves, None
        if moves is None:
            return
        src, dst = (torch.from_numpy(m) for m in moves)
        for t in tensors:
            if t is not None:
                t[dst] = t[src]  # advanced indexing gathers first, so overlapping moves are safe

    def _slots(self, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        block_table = self.runner.input_batch.block_table[0]
        block_size = block_table.block_size
        blocks = block_table.block_table.np[rows, positions // block_size]
        return torch.from_numpy(blocks.astype(np.int64) * block_size + positions % block_size)

    # --- results to the proposer -------------------------------------------------------------------------------
    def _notify(self, batch, out_tokens, out_nodes, out_len, tree_logits, row_offsets, widths) -> None:
        if type(self.proposer).on_verified is TreeProposer.on_verified:
            return
        want_logits = self.proposer.wants_target_logits
        results = []
        for r in range(batch.num_reqs):
            a = int(out_len[r])
            logits_rows = tree_logits[row_offsets[r]: row_offsets[r] + widths[r]] if want_logits else None
            results.append(VerificationResult(batch.req_ids[r], batch.trees[r], out_nodes[r, :a].tolist(),
                                              int(out_tokens[r, a]), logits_rows))
        self.proposer.on_verified(results)

    # --- hook: finished requests --------------------------------------------------------------------------------
    def finished(self, req_ids: set[str]) -> None:
        if req_ids:
            for req_id in req_ids:
                self.pending.pop(req_id, None)
            self.proposer.on_requests_finished(set(req_ids))


def verifier_report(worker: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: the verifier's host-time breakdown and counters on this worker."""
    verifier = getattr(worker.model_runner, "_treespec_verifier", None)
    if verifier is None:
        return {}
    seconds = dict(verifier.timer.seconds)
    seconds["mask_build"] = plan.build_seconds[0]
    return {"seconds": seconds, "steps": verifier.timer.steps, **verifier.stats}
