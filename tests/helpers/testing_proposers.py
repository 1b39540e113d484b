"""Proposers used only by tests (imported by dotted path inside vLLM's worker processes)."""

from __future__ import annotations

import json

import msgspec
import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer


class CandidateTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    candidates_path: str  # JSON list of token ids the tree is built from
    stochastic: bool = False  # draw a fresh random tree each step (else a fixed one)
    seed: int = 0


class CandidateTreeProposer(TreeProposer):
    """A 3-wide, 3-deep tree over a small candidate set: plausible enough to be accepted often, wrong often enough to
    exercise rejection. Deterministic (one-hot) or random per step (stochastic drafts)."""

    options_type = CandidateTreeOptions

    def __init__(self, vllm_config=None, options=None) -> None:
        super().__init__(vllm_config, options)
        self.candidates = np.array(json.load(open(self.options.candidates_path)), np.int64)
        self.rng = np.random.default_rng(self.options.seed)

    def _pick(self, k: int) -> np.ndarray:
        if self.options.stochastic:
            return self.rng.choice(self.candidates, size=k, replace=False)
        return self.candidates[:k]

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        trees = []
        for i in range(ctx.num_reqs):
            if not ctx.needs_draft(i):
                trees.append(None)
                continue
            tokens, parents = list(self._pick(3)), [-1, -1, -1]
            for level_parent in range(3):  # two children under each root child
                for t in self._pick(2):
                    tokens.append(t)
                    parents.append(level_parent)
            for p in range(3, 9):  # one grandchild under each
                tokens.append(self._pick(1)[0])
                parents.append(p)
            trees.append(DraftTree(np.array(tokens), np.array(parents)))
        return trees


class RandomTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    num_nodes: int = 64
    seed: int = 0


class RandomTreeProposer(TreeProposer):
    """Random trees of exactly ``num_nodes`` nodes whose tokens come from the request's own recent text (so some
    get accepted): a fixed-size load for overhead measurements."""

    options_type = RandomTreeOptions

    def __init__(self, vllm_config=None, options=None) -> None:
        super().__init__(vllm_config, options)
        self.rng = np.random.default_rng(self.options.seed)

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        n = self.options.num_nodes
        trees = []
        for i in range(ctx.num_reqs):
            if not ctx.needs_draft(i):
                trees.append(None)
                continue
            recent = ctx.committed(i)[-64:]
            parents = np.array([-1] + [int(self.rng.integers(-1, j)) for j in range(1, n)], np.int32)
            trees.append(DraftTree(self.rng.choice(recent, size=n), parents).breadth_first())
        return trees


class ProbeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    report_path: str


class HiddenStateProbeProposer(TreeProposer):
    """Checks, inside the worker, what the context hands a proposer that asks for hidden states and KV:
    the chainized hidden row of each request's last accepted position must reproduce the token just committed
    (greedy), and the KV view must read every committed position. Proposes prompt-lookup trees meanwhile."""

    options_type = ProbeOptions
    needs_hidden_states = True
    needs_kv_cache = True
    #: the KV-aware head's layers: their cached K/V must equal what its trainer recomputes from these aux states
    aux_hidden_state_layers = (2, 15, 27)

    def load_model(self, model) -> None:
        from vllm_treespec.eagle.kv_head import TargetKVProjector

        super().load_model(model)
        self.model = model
        self.checked = self.mismatched = self.kv_reads = self.kv_compared = 0
        self.kv_max_rel_err = 0.0
        layers = self.aux_hidden_state_layers
        self.projector = TargetKVProjector(self.vllm_config.model_config.model, layers, layers)

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        import torch

        from vllm_treespec.proposers.static_tree import lookup_branches

        trees = []
        for i in range(ctx.num_reqs):
            if not ctx.needs_draft(i):
                trees.append(None)
                continue
            # every committed row whose prediction was committed this step (greedy: the target's argmax) must
            # reproduce it: rows start..index sit at positions hidden_position_start onwards, row at p predicted p+1
            first, last = int(ctx.hidden_row_start[i]), int(ctx.hidden_row_index[i])
            p0 = int(ctx.hidden_position_start[i])
            new_from = int(ctx.num_tokens[i]) - len(ctx.sampled_token_ids[i])
            rows = [r for r in range(first, last + 1) if p0 + (r - first) + 1 >= new_from]
            with torch.no_grad():
                logits = self.model.compute_logits(ctx.hidden_states[rows])
            want = [int(ctx.token_ids[i, p0 + (r - first) + 1]) for r in rows]
            self.checked += len(rows)
            self.mismatched += int(sum(a != b for a, b in zip(logits.argmax(-1).tolist(), want)))
            self.mismatched += int(want[-1] != ctx.sampled_token_ids[i][-1])
            k, v = ctx.kv_cache.read(0, i)
            self.kv_reads += len(rows) * int(k.shape[0] == int(ctx.num_tokens[i]) - 1 and torch.isfinite(k).all().item())
            self._compare_target_kv(ctx, i, first, last, p0)
            chains = lookup_branches(ctx.committed(i), 4, 6)
            trees.append(DraftTree.from_branches(chains) if chains else None)
        with open(self.options.report_path, "w") as f:
            json.dump({"checked": self.checked, "mismatched": self.mismatched, "kv_reads": self.kv_reads,
                       "kv_compared": self.kv_compared, "kv_max_rel_err": self.kv_max_rel_err}, f)
        return trees

    def _compare_target_kv(self, ctx: ProposeContext, i: int, first: int, last: int, p0: int) -> None:
        """K/V the cache holds for this step's committed rows vs. the KV-aware trainer's recomputation."""
        import torch

        from vllm_treespec.eagle.drafter import view_layer_index

        aux = torch.stack([a[first: last + 1] for a in ctx.aux_hidden_states], dim=1)[None].float()
        positions = torch.arange(p0, p0 + last - first + 1)
        k_ref, v_ref = self.projector(aux, positions)
        for j, layer in enumerate(self.aux_hidden_state_layers):
            k, v = ctx.kv_cache.read(view_layer_index(ctx.kv_cache.layer_names, layer), i, p0, p0 + last - first + 1)
            for got, ref in ((k, k_ref[0, j]), (v, v_ref[0, j])):
                err = float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                self.kv_max_rel_err = max(self.kv_max_rel_err, err)
        self.kv_compared += last - first + 1
