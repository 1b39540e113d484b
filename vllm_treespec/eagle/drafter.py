"""EAGLE-2 dynamic draft trees (EAGLE-2, arXiv 2406.16858) from a runtime draft head: an EAGLE-3 head
(:mod:`.model`, arXiv 2503.01840) or a KV-aware head (:mod:`.kv_head`), run in plain torch with its own per-request
KV cache. The drafter of the ``eagle_tree`` and ``kv_aware`` methods, and graft's model drafter.

1. **Ingest.** Every step, the target's aux hidden states of the request's newly committed rows and the committed
   tokens after them go through the head's layer; their K/V are written at their positions. Only the last row needs a
   query: its output is the depth-1 distribution.
2. **Expand** (EAGLE-2). Level by level, the ``top_k`` best nodes of the newest level (by cumulative draft
   log-probability) are run through the head together, each attending to the committed cache plus its own
   ancestors (the tree mask), and each gets its ``top_k`` most likely children.
3. **Rerank.** All candidates of all levels are ranked by cumulative log-probability and the best ``budget`` form the
   tree (a child never outranks its parent, so the set is a tree).

Draft KV beyond the committed length is scratch: the next ingest overwrites it. A KV-aware head also cross-attends to
the target's own K/V of a few layers; the drafter copies each request's newly committed positions out of the paged
cache (``ctx.kv_cache``) every step, so every draft row sees all committed positions.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vllm_treespec.api import DraftTree, ProposeContext
from vllm_treespec.eagle.checkpoint import load_draft_head
from vllm_treespec.eagle.cpu_gemm import linear_seconds, use_int8_weights, use_vllm_cpu_gemm
from vllm_treespec.eagle.kv_head import is_kv_aware_config
from vllm_treespec.eagle.model import default_aux_layers
from vllm_treespec.pruning import below_checkpoint


@dataclass
class _RequestState:
    k: Any  # [Hk, cap, D]
    v: Any
    written: Any  # [cap] bool: positions whose K/V came from committed rows
    length: int = 0  # committed rows ingested (positions 0 .. length-1 may be written)
    last_normed: Any = None  # head output at the last ingested row: depth-1 distribution
    last_r2: Any = None  # its prenorm hidden: the depth-1 nodes' input hidden
    last_position: int = -1
    tick: int = 0
    target_k: Any = None  # KV-aware heads: [L, cap, Hk, D] target K of the committed positions
    target_v: Any = None
    target_len: int = 0  # positions 0 .. target_len-1 copied from the target's cache


@dataclass
class _Growing:
    """One request's tree under construction."""
    state: _RequestState
    tokens: list[int]
    parents: list[int]
    scores: list[float]  # cumulative log-prob
    logps: list[float]  # conditional log-prob
    depths: list[int]
    slot: dict[int, int]  # expanded node -> its scratch KV position
    frontier: list[int]
    frontier_r2: Any = None
    stop_score: float = -math.inf  # stopped at a checkpoint: its best path score there (keep nodes scoring >= it)


logger = logging.getLogger("vllm.treespec")

#: the compute modes a head's ``dtype: "fastest"`` chooses between, by timing its linear layers at load. Not "int8"
#: (int8 weights, fp32 activations: :func:`~vllm_treespec.eagle.cpu_gemm.use_int8_weights`): on the AVX2 CPU it
#: halves the head's linear time and drafts as well offline, yet graft at its defaults ran slower with it (0.94x no
#: speculation against 1.03x with the fp32 head, docs/benchmarks.md), so it is chosen by name only
HEAD_DTYPE_CANDIDATES = ("bfloat16", "float32")


def activation_dtype(mode: str) -> torch.dtype:
    """The dtype of a head's activations and draft cache in compute ``mode`` (int8 weights compute in fp32)."""
    return torch.float32 if mode == "int8" else getattr(torch, mode)


#: observed rows (all requests) kept before their K/V are written anyway: bounds the memory of a long spell without
#: drafts (a row holds the target's aux hidden states: 3 x 576 values for SmolLM2, 7 KB in fp32)
DEFERRED_ROWS = 8192
#: one request's newest observed rows kept for a later write; older ones are dropped unwritten, masked out of the
#: head's later drafts for it (a long prompt's first rows: the shipped head was trained on 640-token sequences). A
#: request the head never drafts for then costs no write however long its prompt, and one it drafts for later catches
#: up on this many rows at most. (Written at once instead, as before 2026-12-06, the rows of prompts past it were a
#: never-drafting graft server's only writes at 16 requests in bf16: 150-340 ms a round, 0.4-0.8% of its time.)
DEFERRED_ROWS_PER_REQUEST = 1024
#: weight of the newest batched write in the running price of a written row, learnt from writes of at least
#: ROW_PRICE_MIN_ROWS rows (a prompt's, a catch-up's)
ROW_PRICE_ALPHA = 0.2
ROW_PRICE_MIN_ROWS = 32


class EagleDrafter:
    """The head plus per-request caches. ``draft(ctx, rows, budget)`` returns EAGLE-2 trees."""

    def __init__(self, checkpoint: str, *, depth: int, top_k: int, dtype: str = "float32",
                 max_cached_requests: int = 1024, num_target_layers: int | None = None) -> None:
        cfg = json.loads((Path(checkpoint) / "config.json").read_text())
        #: the head cross-attends to the target's KV cache (the proposer must set ``needs_kv_cache``)
        self.reads_target_kv = is_kv_aware_config(cfg)
        self.kv_layers: tuple[int, ...] = tuple((cfg.get("kv_aware") or {}).get("kv_layers") or ())
        self._view_layers: list[int] | None = None
        eagle = cfg.get("eagle_config") or {}
        aux = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if not aux:  # as vLLM: the target's default EAGLE-3 layers
            if num_target_layers is None:
                raise ValueError(f"{checkpoint}: config.json names no eagle_aux_hidden_state_layer_ids")
            aux = default_aux_layers(num_target_layers)
        self.checkpoint = checkpoint
        #: the target layers whose hidden states the head reads, in its fc input order
        self.aux_layers: tuple[int, ...] = tuple(aux)
        self.depth, self.top_k, self.dtype_name = depth, top_k, dtype
        self.max_cached_requests = max_cached_requests
        self.head = None
        self.states: dict[str, _RequestState] = {}
        self._tick = 0
        #: committed rows not written yet, by request: (aux hidden rows, tokens, positions), in order. A request's
        #: rows are written when the head drafts for it (or past DEFERRED_ROWS; past DEFERRED_ROWS_PER_REQUEST the
        #: oldest are dropped), so a request the head never drafts for again (a busy server's) never costs their writes
        self._deferred: dict[str, list[tuple[Any, np.ndarray, np.ndarray]]] = {}
        self._deferred_rows = 0  # rows in _deferred
        self._deferred_count: dict[str, int] = {}  # rows in _deferred, by request
        #: seconds the last ingest spent writing rows deferred from earlier steps and a prefill's prompt rows (their
        #: share of its batched write): work written once per row, not a price of this step's drafts
        self.catch_up_seconds = 0.0
        #: seconds a written row costs (its K/V through the head's layer inputs), a running mean over batched writes
        #: of ROW_PRICE_MIN_ROWS rows or more; None before one: prices a draft's catch-up (backlog_seconds)
        self.row_write_seconds: float | None = None
        #: skip frontier nodes that cannot reach the kept tree (exact; off only to test that it is exact)
        self.prune_frontier = True
        #: head rows drafted past depth 1 (expansion work), for tests and profiling
        self.expanded_rows = 0

    # --- loading ----------------------------------------------------------------------------------------------
    @classmethod
    def for_target(cls, checkpoint: str, vllm_config: Any, **kwargs: Any) -> "EagleDrafter":
        """A drafter for the target of ``vllm_config`` (its layer count names the default aux layers)."""
        model_config = getattr(vllm_config, "model_config", None)
        layers = model_config.get_total_num_hidden_layers() if model_config is not None else None
        return cls(checkpoint, num_target_layers=layers, **kwargs)

    def load_from_target(self, model: Any, vllm_config: Any) -> None:
        """Load the head with the loaded target model's input embedding (shared, as in vLLM)."""
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embed is None or not hasattr(embed, "weight"):
            embed = model.model.embed_tokens
        self.load(embed.weight, getattr(getattr(vllm_config, "model_config", None), "dtype", None))

    def load(self, embed, target_dtype=None) -> None:
        embed = embed.detach().to("cpu", torch.float32)
        if self.dtype_name == "fastest":
            mode, self.head = self._fastest_head(embed)
        else:
            mode = str(target_dtype or torch.float32).removeprefix("torch.") if self.dtype_name == "auto" \
                else self.dtype_name
            self.head = self._load_head(embed, mode)
            if self.head is None:
                raise RuntimeError("the draft head's dtype 'int8' needs torch's int8 GEMM (fbgemm), which this CPU "
                                   "build lacks: use 'fastest' or 'float32'")
        #: how the head computes: "bfloat16", "float32", "float16" or "int8" (int8 weights, fp32 activations)
        self.compute = mode
        dtype = activation_dtype(mode)
        cfg = self.head.cfg
        self.kv_heads, self.heads, self.head_dim = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.d2t = self.head.draft_to_target.numpy()  # draft id -> target id
        self.dtype = dtype

    def _load_head(self, embed: torch.Tensor, mode: str) -> torch.nn.Module | None:
        """The head computing in ``mode`` (a dtype name, or "int8": int8 weights, fp32 activations); None for "int8"
        where torch has no int8 GEMM."""
        head = load_draft_head(self.checkpoint, embed=embed, dtype=activation_dtype(mode),
                               default_aux_layers=self.aux_layers)
        head.eval().requires_grad_(False)
        if mode == "int8":
            return head if use_int8_weights(head) else None
        use_vllm_cpu_gemm(head)
        return head

    def _fastest_head(self, embed: torch.Tensor) -> tuple[str, torch.nn.Module]:
        """The head in whichever of :data:`HEAD_DTYPE_CANDIDATES` runs its linear layers faster here, timed at a
        level's rows: bf16 halves the weights' bytes where the CPU has a bf16 GEMM (AVX-512 BF16, AMX), and costs
        several times fp32 where vLLM falls back to torch's bf16 GEMM (AVX2). Only the drafts depend on it, never
        exactness."""
        timed = {}
        for mode in HEAD_DTYPE_CANDIDATES:
            head = self._load_head(embed, mode)
            timed[mode] = (linear_seconds(head, rows=max(1, self.top_k)), head)
        best = min(timed, key=lambda m: timed[m][0])
        logger.info("vllm_treespec: the draft head computes in %s (its linear layers at %d rows: %s)", best,
                    max(1, self.top_k), ", ".join(f"{m} {s * 1e3:.2f} ms" for m, (s, _) in timed.items()))
        return best, timed[best][1]

    # --- per-request KV ---------------------------------------------------------------------------------------
    def _state(self, req_id: str, need: int) -> _RequestState:
        st = self.states.get(req_id)
        if st is None:
            if len(self.states) >= self.max_cached_requests:
                oldest = min(self.states, key=lambda r: self.states[r].tick)
                del self.states[oldest]
            cap = max(256, 1 << (need - 1).bit_length())
            st = _RequestState(k=torch.zeros(self.kv_heads, cap, self.head_dim, dtype=self.dtype),
                               v=torch.zeros(self.kv_heads, cap, self.head_dim, dtype=self.dtype),
                               written=torch.zeros(cap, dtype=torch.bool))
            self.states[req_id] = st
        elif st.k.shape[1] < need:
            cap = 1 << (need - 1).bit_length()
            grow = cap - st.k.shape[1]
            st.k = torch.cat([st.k, st.k.new_zeros(self.kv_heads, grow, self.head_dim)], 1)
            st.v = torch.cat([st.v, st.v.new_zeros(self.kv_heads, grow, self.head_dim)], 1)
            st.written = torch.cat([st.written, st.written.new_zeros(grow)])
        self._tick += 1
        st.tick = self._tick
        return st

    def release(self, req_ids) -> None:
        for r in req_ids:
            self.states.pop(r, None)
            self._deferred.pop(r, None)
            self._deferred_rows -= self._deferred_count.pop(r, 0)

    # --- the target's K/V (KV-aware heads) ---------------------------------------------------------------------
    def _sync_target_kv(self, ctx: ProposeContext, i: int, st: _RequestState, end: int) -> None:
        """Copy positions [target_len, end) of request row ``i`` out of the target's paged cache."""
        view = ctx.kv_cache
        if view is None:
            raise RuntimeError("a KV-aware head needs the target's KV cache: set needs_kv_cache on the proposer")
        if self._view_layers is None:
            self._view_layers = [view_layer_index(view.layer_names, layer) for layer in self.kv_layers]
        end = min(end, int(view.num_computed[i]))
        if st.target_len > end:  # e.g. a preempted request recomputed: its committed prefix is unchanged
            st.target_len = end
        if end <= st.target_len:
            return
        chunks = [view.read(layer, i, st.target_len, end) for layer in self._view_layers]
        if st.target_k is None or st.target_k.shape[1] < end:
            cap = max(256, 1 << (end - 1).bit_length())
            k = torch.zeros(len(chunks), cap, *chunks[0][0].shape[1:], dtype=self.dtype)
            v = torch.zeros_like(k)
            if st.target_k is not None:
                k[:, : st.target_len] = st.target_k[:, : st.target_len]
                v[:, : st.target_len] = st.target_v[:, : st.target_len]
            st.target_k, st.target_v = k, v
        for j, (k, v) in enumerate(chunks):
            st.target_k[j, st.target_len: end] = k.to(self.dtype)
            st.target_v[j, st.target_len: end] = v.to(self.dtype)
        st.target_len = end

    # --- the head's layer -------------------------------------------------------------------------------------
    def _outputs(self, attn, hidden, groups):
        """The head's outputs for attention rows grouped per request: ``groups`` = [(state, rows, position)]."""
        if not self.reads_target_kv:
            return self.head.layer_outputs(attn, hidden)
        normed, r = [], []
        offset = 0
        for st, n, position in groups:
            kv = (st.target_k[None, :, : st.target_len], st.target_v[None, :, : st.target_len])
            pos = torch.full((n,), position, dtype=torch.long)
            a, b = self.head.step_outputs(attn[offset: offset + n], hidden[offset: offset + n], pos, kv)
            normed.append(a)
            r.append(b)
            offset += n
        return torch.cat(normed), torch.cat(r)

    def _attend(self, q, st: _RequestState, length: int, mask):
        """q: [F, H, D]; keys st.k[:, :length]; mask [F, length] bool → [F, H, D]. In float32 matmuls: a bf16
        einsum built a new oneDNN primitive for every context length it met, and the length grows every call (about
        2 ms an attention instead of 0.3-0.6 at ~1,000 positions on one CPU thread)."""
        f, kv, d = q.shape[0], self.kv_heads, self.head_dim
        g = self.heads // kv
        qh = q.permute(1, 0, 2).reshape(kv, g * f, d).float()
        scores = torch.matmul(qh, st.k[:, :length].float().transpose(1, 2)).view(kv, g, f, length) * self.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv, g * f, length)
        out = torch.matmul(probs, st.v[:, :length].float()).to(q.dtype)
        return out.view(self.heads, f, d).permute(1, 0, 2)

    def _top_children(self, normed, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` most likely draft tokens after each output row: (log-probs float32, draft ids)."""
        logp = torch.log_softmax(self.head.logits(normed).float(), dim=-1)
        top_lp, top_id = logp.topk(min(k, logp.shape[-1]), dim=-1)
        return top_lp.numpy(), top_id.numpy()

    # --- step 1: ingest committed rows ------------------------------------------------------------------------
    def observe(self, ctx: ProposeContext) -> None:
        """A step that does not draft: keep its committed rows (the target's aux hidden states, tokens, positions)
        to write their K/V when the head next drafts for their request, in one batch with that step's rows (a
        request's newest ``DEFERRED_ROWS_PER_REQUEST``). A row never written stays masked out of every later draft.
        Writing every request's rows each step cost ~3% of a 16-request step in small GEMMs and op dispatch, and a
        busy server's head drafts for few of them again."""
        if ctx.aux_hidden_states is None or ctx.hidden_row_start is None or self.head is None:
            return
        self._defer(ctx, self._segments(ctx))

    def _defer(self, ctx: ProposeContext, segments: list[tuple[int, Any, np.ndarray, np.ndarray]]) -> None:
        """Keep ``segments`` for a later write, each request's newest ``DEFERRED_ROWS_PER_REQUEST`` rows; write every
        request's now past the total's limit."""
        for i, aux, tokens, positions in segments:
            req_id = ctx.req_ids[i]
            self._deferred.setdefault(req_id, []).append((aux, tokens, positions))
            self._deferred_rows += len(positions)
            self._deferred_count[req_id] = count = self._deferred_count.get(req_id, 0) + len(positions)
            if count > DEFERRED_ROWS_PER_REQUEST:
                self._drop_oldest(req_id, count - DEFERRED_ROWS_PER_REQUEST)
        if self._deferred_rows >= DEFERRED_ROWS:
            self._write_segments(ctx, [])

    def _drop_oldest(self, req_id: str, rows: int) -> None:
        """Drop the oldest ``rows`` of ``req_id``'s waiting rows unwritten (they stay masked out of its drafts)."""
        waiting = self._deferred[req_id]
        self._deferred_count[req_id] -= rows
        self._deferred_rows -= rows
        while rows > 0:
            aux, tokens, positions = waiting[0]
            if len(positions) <= rows:
                waiting.pop(0)
                rows -= len(positions)
            else:
                waiting[0] = (aux[rows:], tokens[rows:], positions[rows:])
                rows = 0

    def backlog_seconds(self, req_ids: Sequence[str]) -> float:
        """What drafting for ``req_ids`` now would spend first writing the rows their steps without drafts left:
        their deferred rows at the measured price of a written row (0 before any write was timed)."""
        if self.row_write_seconds is None:
            return 0.0
        return self.row_write_seconds * sum(self._deferred_count.get(r, 0) for r in req_ids)

    def _segments(self, ctx: ProposeContext) -> list[tuple[int, Any, np.ndarray, np.ndarray]]:
        """(batch row, aux hidden rows [n, n_aux * H] (a copy), tokens, positions) of every request's newly
        committed rows. Runs on every step, drafting or not: one gather for the whole batch (a slice where the rows
        are consecutive, as in a plain decode step) and one split; the per-request arithmetic on Python ints, where
        NumPy's per-call overhead cost more (on Zen 1 ~60 against ~160 us a step at one request, ~140 against ~230 at
        16)."""
        num_reqs = ctx.num_reqs
        first = ctx.hidden_row_start[:num_reqs].tolist()
        last = ctx.hidden_row_index[:num_reqs].tolist()
        start = ctx.hidden_position_start[:num_reqs].tolist()
        picked: list[tuple[int, int]] = []  # (batch row, committed rows)
        consecutive, expected = True, None  # expected: the row after the last picked request's
        for i in range(num_reqs):
            count = last[i] - first[i] + 1
            if count <= 0:
                continue
            consecutive = consecutive and expected in (None, first[i])
            expected = first[i] + count
            picked.append((i, count))
        if not picked:
            return []
        layers = ctx.aux_hidden_states[: len(self.aux_layers)]
        if consecutive:  # a plain decode step: one slice per layer
            low = first[picked[0][0]]
            aux = torch.cat([a[low: expected] for a in layers], -1)
        else:
            index = torch.from_numpy(np.concatenate([np.arange(first[i], first[i] + count, dtype=np.int64)
                                                     for i, count in picked]))
            aux = torch.cat([a.index_select(0, index) for a in layers], -1)
        pieces = aux.split([count for _, count in picked])  # one call for every request's view, not one slice each
        token_ids = ctx.token_ids
        return [(i, piece, token_ids[i, start[i] + 1: start[i] + 1 + count].astype(np.int64),
                 np.arange(start[i], start[i] + count, dtype=np.int64))
                for (i, count), piece in zip(picked, pieces)]

    def _write_segments(self, ctx: ProposeContext, current: list[tuple[int, Any, np.ndarray, np.ndarray]],
                        asked: Sequence[int] = (), requests: set[str] | None = None):
        """Write the K/V of ``current`` (this step's rows) and of the deferred segments of their requests (and of
        ``requests``; None: of every request in ``ctx``) in one batch through the head's layer inputs, a request's
        consecutive segments as one write. Returns the head's hidden rows and queries at the last row of the current
        segments of batch rows ``asked`` (the rows :meth:`ingest` attends from), in that order; queries of the other
        rows are never computed. Sets :attr:`catch_up_seconds` to the share of its time of the deferred rows and of
        a prefill's rows beyond the token it committed."""
        started = time.perf_counter()
        row_of = {req_id: i for i, req_id in enumerate(ctx.req_ids)}
        current_of = {ctx.req_ids[segment[0]]: segment for segment in current}
        writes = set(current_of) | (set(row_of) if requests is None else set(requests) & set(row_of))
        pieces: list[tuple[int, Any, np.ndarray, np.ndarray]] = []
        current_piece: dict[str, int] = {}  # request -> index of its current segment in pieces
        caught_up = 0  # deferred rows among the pieces
        for req_id in [r for r in self._deferred if r in writes] + [r for r in current_of if r not in self._deferred]:
            deferred = [(row_of[req_id], *segment) for segment in self._deferred.pop(req_id, ())]
            rows = self._deferred_count.pop(req_id, 0)
            self._deferred_rows -= rows
            caught_up += rows
            pieces += deferred
            if req_id in current_of:
                current_piece[req_id] = len(pieces)
                segment = current_of[req_id]
                pieces.append(segment)
                # rows beyond the tokens the step committed are a prefill's (the prompt): written once per request,
                # so not a price of drafting calls. Priced as one, the 949-2152 rows of long prompts (25-148 ms)
                # had moved the head's price per call by a fifth of that and kept it from drafting for hundreds of
                # steps after (slice CQ, docs/benchmarks.md)
                caught_up += max(0, len(segment[3]) - len(ctx.sampled_token_ids[segment[0]]))
        self.catch_up_seconds = 0.0
        if not pieces:
            return None, None
        ends = np.cumsum([len(p) for _, _, _, p in pieces])  # one past each piece's last row in the batch
        head = self.head
        with torch.inference_mode():
            hidden = head.combine(torch.cat([aux for _, aux, _, _ in pieces]).to(self.dtype))
            tok = torch.from_numpy(np.concatenate([t for _, _, t, _ in pieces]).astype(np.int64))
            pos = torch.from_numpy(np.concatenate([p for _, _, _, p in pieces]))
            query_rows = torch.tensor([ends[current_piece[ctx.req_ids[i]]] - 1 for i in asked], dtype=torch.long)
            q, k, v = head.layer_inputs(tok, hidden, pos, query_rows)
            offset = 0
            for i, p0, n in _contiguous_runs(pieces):
                self._write_committed(ctx, i, p0, n, k[offset: offset + n], v[offset: offset + n])
                offset += n
        elapsed, rows = time.perf_counter() - started, int(ends[-1])
        self.catch_up_seconds = elapsed * caught_up / rows
        if rows >= ROW_PRICE_MIN_ROWS:  # a catch-up's size: a step's few rows would price in the call's overheads
            per_row = elapsed / rows
            self.row_write_seconds = per_row if self.row_write_seconds is None else \
                (1 - ROW_PRICE_ALPHA) * self.row_write_seconds + ROW_PRICE_ALPHA * per_row
        return hidden[query_rows], q

    def ingest(self, ctx: ProposeContext) -> list[int]:
        """Feed the committed rows of the requests that need a draft (``ctx.needs_draft``), with those deferred by
        :meth:`observe`, and keep the other requests' rows as :meth:`observe` does; returns the batch rows whose
        depth-1 output is ready: those that need a draft."""
        self.catch_up_seconds = 0.0
        if ctx.aux_hidden_states is None or ctx.hidden_row_start is None or self.head is None:
            return []
        segments = self._segments(ctx)
        current = [segment for segment in segments if ctx.needs_draft(segment[0])]
        rows = [segment[0] for segment in current]
        hidden, q = self._write_segments(ctx, current, rows, requests=set())
        caught_up, started = self.catch_up_seconds, time.perf_counter()
        self._defer(ctx, [segment for segment in segments if not ctx.needs_draft(segment[0])])
        self.catch_up_seconds = caught_up + time.perf_counter() - started  # a limit's write is observed rows' too
        if not rows:
            return []
        with torch.inference_mode():
            outs, groups = [], []
            for j, i in enumerate(rows):
                st = self.states[ctx.req_ids[i]]
                groups.append((st, 1, st.last_position))
                mask = st.written[: st.length][None, :]
                outs.append(self._attend(q[j: j + 1], st, st.length, mask))
            normed, r2 = self._outputs(torch.cat(outs), hidden, groups)
            for j, i in enumerate(rows):
                st = self.states[ctx.req_ids[i]]
                st.last_normed, st.last_r2 = normed[j], r2[j]
        return rows

    def _write_committed(self, ctx: ProposeContext, i: int, p0: int, n: int, k, v) -> _RequestState:
        """Write the K/V of request row ``i``'s ``n`` committed rows from position ``p0`` into its cache."""
        st = self._state(ctx.req_ids[i], p0 + n + self.depth * self.top_k + 1)
        if self.reads_target_kv:  # the root row (position p0+n-1) sees the target's K/V up to itself
            self._sync_target_kv(ctx, i, st, p0 + n)
        if p0 > st.length:  # rows we never saw (e.g. a prefix-cache hit): keep them masked out
            st.written[st.length: p0] = False
        st.k[:, p0: p0 + n] = k.transpose(0, 1)
        st.v[:, p0: p0 + n] = v.transpose(0, 1)
        st.written[p0: p0 + n] = True
        st.length = p0 + n
        st.last_position = p0 + n - 1
        return st

    # --- steps 2 and 3: expand and rerank ---------------------------------------------------------------------
    def draft(self, ctx: ProposeContext, rows: Sequence[int], budget: int,
              stop_below: dict[int, float] | None = None, min_confidence: float = 0.0,
              max_depth: int | None = None) -> dict[int, DraftTree]:
        """EAGLE-2 trees of at most ``budget`` nodes for ``rows`` (those ingested this step). ``stop_below``
        (depth -> confidence) stops a request's expansion after that depth when its best path there is less likely
        (graft's checkpoints: the levels it would prune are never drafted). Nodes whose path probability is below
        ``min_confidence`` are left out and not expanded (their descendants are less likely still). ``max_depth``
        (e.g. ``ctx.useful_depth``) caps the levels below the head's own depth: each level is a head forward."""
        # The kept tree is the top `budget` nodes by score, closed under ancestors (a child scores below its parent):
        # a node deeper than `budget`, or ranked below `budget` among its siblings or its level, is never kept, so
        # growing past those bounds only costs time (exact: the same tree either way).
        k = min(self.top_k, max(budget, 1))
        max_depth = min(self.depth, max(budget, 1), max_depth if max_depth is not None else self.depth)
        min_log = math.log(min_confidence) if min_confidence > 0 else -math.inf
        with torch.inference_mode():
            grows = self._root_children(ctx, rows, k, min_log, stop_below)
            for depth in range(1, max_depth):
                active = [g for g in grows.values() if g.frontier]
                if not active:
                    break
                r2, top_lp, top_id = self._expand_level(active, depth, k)
                offset = 0
                for g in active:
                    f = len(g.frontier)
                    new_nodes, new_scores = _add_children(g, depth + 1, top_lp[offset: offset + f],
                                                          top_id[offset: offset + f])
                    stop = _stop_at_checkpoint(g, stop_below, depth + 1, max(new_scores), min_log)
                    if depth + 1 < max_depth and not stop:
                        floor = max(_kth_best(g.scores, budget) if self.prune_frontier else -np.inf, min_log)
                        _next_frontier(g, new_nodes, new_scores, k, floor, r2, offset)
                    else:
                        g.frontier = []
                    offset += f
        return {i: self._rerank(g, budget) for i, g in grows.items()}

    def _root_children(self, ctx: ProposeContext, rows: Sequence[int], k: int, min_log: float,
                       stop_below: dict[int, float] | None) -> dict[int, _Growing]:
        """Depth 1 of each ready row's tree: the ``k`` best children of the root from the last ingested row's
        output."""
        ready = [i for i in rows if self.states.get(ctx.req_ids[i]) is not None
                 and self.states[ctx.req_ids[i]].last_normed is not None]
        if not ready:
            return {}
        top_lp, top_id = self._top_children(torch.stack([self.states[ctx.req_ids[i]].last_normed for i in ready]), k)
        grows: dict[int, _Growing] = {}
        for j, i in enumerate(ready):
            st = self.states[ctx.req_ids[i]]
            g = _Growing(state=st, tokens=top_id[j].tolist(), parents=[-1] * top_id.shape[1],
                         scores=top_lp[j].astype(np.float64).tolist(), logps=top_lp[j].tolist(),
                         depths=[1] * top_id.shape[1], slot={}, stop_score=min_log,
                         frontier=[n for n in range(top_id.shape[1]) if top_lp[j, n] >= min_log])
            g.frontier_r2 = st.last_r2[None].expand(len(g.frontier), -1)
            _stop_at_checkpoint(g, stop_below, 1, float(top_lp[j].max()), min_log)
            grows[i] = g
        return grows

    def _expand_level(self, active: list[_Growing], depth: int, k: int):
        """One level for every growing tree, in one batched head forward: each frontier node attends to the committed
        cache and its own ancestors. Returns its prenorm hiddens and its ``k`` best children (log-probs float64)."""
        head = self.head
        toks, hid, pos = [], [], []
        for g in active:
            toks.append(np.asarray([g.tokens[n] for n in g.frontier], np.int64))
            hid.append(g.frontier_r2)
            pos.append(np.full(len(g.frontier), g.state.last_position + depth, np.int64))
        hidden = torch.cat(hid)
        self.expanded_rows += hidden.shape[0]
        q, kk, vv = head.layer_inputs(torch.from_numpy(self._target_ids(np.concatenate(toks))),
                                      hidden, torch.from_numpy(np.concatenate(pos)))
        outs, offset, groups = [], 0, []
        for g in active:
            st, f = g.state, len(g.frontier)
            groups.append((st, f, st.last_position + depth))
            total = _write_frontier(g, kk[offset: offset + f], vv[offset: offset + f])
            outs.append(self._attend(q[offset: offset + f], st, total, _tree_mask(g, total)))
            offset += f
        normed, r2 = self._outputs(torch.cat(outs), hidden, groups)
        top_lp, top_id = self._top_children(normed, k)
        return r2, top_lp.astype(np.float64), top_id

    def _target_ids(self, draft_ids: np.ndarray) -> np.ndarray:
        return self.d2t[draft_ids]

    def _rerank(self, g: _Growing, budget: int) -> DraftTree:
        scores = np.asarray(g.scores)
        order = np.argsort(-scores, kind="stable")[: max(0, budget)]  # parents precede children (ties: creation)
        # Stopped at a checkpoint: only nodes at least as likely as its best path, i.e. nodes a fully grown tree would
        # rank above every node it could have added below; the rest of the budget is the caller's (graft: retrieval).
        # stop_score is also at least the confidence floor.
        order = order[scores[order] >= g.stop_score]
        chosen = np.sort(order)  # creation order is topological
        new_index = np.full(len(g.tokens), -1, np.int64)
        new_index[chosen] = np.arange(chosen.size)
        parents = np.asarray(g.parents, np.int64)[chosen]
        out_parents = np.where(parents < 0, -1, new_index[np.maximum(parents, 0)])
        if np.any((parents >= 0) & (out_parents < 0)):
            raise AssertionError("EAGLE rerank dropped a parent of a kept node")
        tokens = self.d2t[np.asarray(g.tokens, np.int64)[chosen]]
        return DraftTree(tokens, out_parents, np.exp(np.asarray(g.logps)[chosen]).astype(np.float32))


def _contiguous_runs(pieces: list[tuple[int, Any, np.ndarray, np.ndarray]]) -> list[tuple[int, int, int]]:
    """(batch row, first position, rows) of each run of consecutive pieces of one request whose positions follow on
    (a run is written as one)."""
    runs: list[list[int]] = []
    for i, _, _, positions in pieces:
        p0, n = int(positions[0]), len(positions)
        if runs and runs[-1][0] == i and runs[-1][1] + runs[-1][2] == p0:
            runs[-1][2] += n
        else:
            runs.append([i, p0, n])
    return [(i, p0, n) for i, p0, n in runs]


def _write_frontier(g: _Growing, k, v) -> int:
    """Give each frontier node the next scratch KV slot after the committed rows and write its K/V there; returns the
    cache length the level attends to."""
    st, f = g.state, len(g.frontier)
    base = st.length + len(g.slot)
    for j, node in enumerate(g.frontier):
        g.slot[node] = base + j
    st.k[:, base: base + f] = k.transpose(0, 1)
    st.v[:, base: base + f] = v.transpose(0, 1)
    return base + f


def _tree_mask(g: _Growing, total: int):
    """[frontier, total] bool: each frontier node sees the committed rows and the slots of itself and its ancestors."""
    st = g.state
    mask = torch.zeros(len(g.frontier), total, dtype=torch.bool)
    mask[:, : st.length] = st.written[: st.length]
    for j, node in enumerate(g.frontier):
        a = node
        while a >= 0:  # the node and its ancestors (the root's row is the last committed one)
            mask[j, g.slot[a]] = True
            a = g.parents[a]
    return mask


def _add_children(g: _Growing, depth: int, top_lp: np.ndarray, top_id: np.ndarray) -> tuple[list[int], list[float]]:
    """Add the best children of each frontier node (rows of ``top_lp`` / ``top_id``, in frontier order) at ``depth``,
    scored by cumulative log-prob; returns the new nodes and their scores."""
    new_nodes, new_scores = [], []
    for j, parent in enumerate(g.frontier):
        for c in range(top_id.shape[1]):
            g.tokens.append(int(top_id[j, c]))
            g.parents.append(parent)
            s = g.scores[parent] + top_lp[j, c]
            g.scores.append(s)
            g.logps.append(float(top_lp[j, c]))
            g.depths.append(depth)
            new_nodes.append(len(g.tokens) - 1)
            new_scores.append(s)
    return new_nodes, new_scores


def _stop_at_checkpoint(g: _Growing, stop_below: dict[int, float] | None, depth: int, best_score: float,
                        min_log: float) -> bool:
    """Stop the tree at ``depth`` if its best path there falls below the checkpoint; it then keeps only nodes at least
    as likely as that path (and the confidence floor)."""
    if not below_checkpoint(stop_below, depth, best_score):
        return False
    g.frontier, g.stop_score = [], max(best_score, min_log)
    return True


def _next_frontier(g: _Growing, new_nodes: list[int], new_scores: list[float], k: int, floor: float, r2,
                   offset: int) -> None:
    """The ``k`` best new nodes scoring at least ``floor`` are expanded next, with their parents' prenorm hiddens
    (rows of ``r2`` from ``offset``, in the old frontier's order)."""
    row_of = {parent: offset + j for j, parent in enumerate(g.frontier)}
    best = np.argsort(-np.asarray(new_scores), kind="stable")[:k]
    # A child scores at most its parent, so a node below the budget-th best score so far has no descendant in the kept
    # tree: not expanding it changes no tree and saves head rows/levels.
    g.frontier = [new_nodes[b] for b in best if new_scores[b] >= floor]
    g.frontier_r2 = r2[[row_of[g.parents[n]] for n in g.frontier]]


def _kth_best(scores: list[float], k: int) -> float:
    """The k-th largest of ``scores`` (-inf while there are fewer than k)."""
    if len(scores) < k:
        return -np.inf
    return float(np.partition(np.asarray(scores), len(scores) - k)[len(scores) - k])


def view_layer_index(layer_names: Sequence[str], layer: int) -> int:
    """Index in the KV view of the target's decoder layer ``layer`` (names like ``model.layers.15.self_attn.attn``)."""
    for j, name in enumerate(layer_names):
        if f"layers.{layer}." in name:
            return j
    if layer < len(layer_names):
        return layer
    raise ValueError(f"KV-aware head: the target has no attention layer {layer} (layers: {len(layer_names)})")
