"""Oracle tree proposer for tests: knows the true continuation and hides it in a tree of decoys.

Given reference sequences (prompt + the target's own greedy output, as token ids), it finds the reference that
extends each request's committed tokens and builds a tree of ``branches`` root children, each a chain ``depth``
deep. Branch ``true_branch`` carries the true continuation for its first ``true_depth`` nodes and decoys after that;
every other branch is all decoys (tokens that differ from the truth). Under greedy verification exactly
``min(true_depth, tokens left in the reference)`` drafts are accepted per step, so the mean accepted length is known
in advance. Public API only.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer


class OracleTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    reference_path: str  # JSON list of token-id lists (prompt + continuation)
    #: root children, each a chain ``depth`` deep
    branches: int = 3
    #: nodes per branch
    depth: int = 4
    #: the branch that carries the true continuation (0-based)
    true_branch: int = 0
    #: true tokens at the top of that branch, decoys below: the drafts a greedy step accepts
    true_depth: int = 2

    def __post_init__(self) -> None:
        if not Path(self.reference_path).is_file():
            raise FileNotFoundError(f"oracle_tree option 'reference_path': no such file {self.reference_path!r}")
        if not (1 <= self.branches and 0 <= self.true_branch < self.branches):
            raise ValueError("oracle_tree options need branches >= 1 and 0 <= true_branch < branches")
        if not (1 <= self.depth and 0 <= self.true_depth <= self.depth):
            raise ValueError("oracle_tree options need depth >= 1 and 0 <= true_depth <= depth")


class OracleTreeProposer(TreeProposer):
    options_type = OracleTreeOptions

    def __init__(self, vllm_config=None, options=None) -> None:
        super().__init__(vllm_config, options)
        self.references = [np.asarray(r, np.int64) for r in json.loads(Path(self.options.reference_path).read_text())]
        self.vocab_size = int(getattr(getattr(vllm_config, "model_config", None), "get_vocab_size", lambda: 49152)())

    def _truth(self, committed: np.ndarray) -> np.ndarray | None:
        for ref in self.references:
            if ref.size > committed.size and np.array_equal(ref[: committed.size], committed):
                return ref[committed.size:]
        return None

    def _decoy(self, truth_token: int, salt: int) -> int:
        return (truth_token + 1 + salt) % self.vocab_size

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        o: OracleTreeOptions = self.options
        trees: list[DraftTree | None] = []
        for i in range(ctx.num_reqs):
            truth = self._truth(ctx.committed(i)) if ctx.needs_draft(i) else None
            if truth is None:
                trees.append(None)
                continue
            # Breadth-first: level d holds node d of every branch.
            tokens, parents = [], []
            for d in range(o.depth):
                true_token = int(truth[d]) if d < truth.size else 0
                for b in range(o.branches):
                    if b == o.true_branch and d < o.true_depth and d < truth.size:
                        token = true_token
                    else:
                        token = self._decoy(true_token, b + 1)
                    parents.append(-1 if d == 0 else (d - 1) * o.branches + b)
                    tokens.append(token)
            trees.append(DraftTree(np.array(tokens), np.array(parents)))
        return trees
