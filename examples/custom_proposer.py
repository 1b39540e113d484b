"""A worked custom tree proposer: "repeat a line you have seen before".

Code and lists often repeat earlier lines with small changes. This proposer looks at the text since the last newline,
finds up to `branches` earlier places where the same tokens occurred, and drafts what followed each of them, one
branch per earlier occurrence. It uses only the public API of vllm_treespec and needs no registration: select it by
dotted path (the `examples` folder must be importable in every vLLM process, e.g. via PYTHONPATH):

    LLM(model=..., speculative_config={"method": "examples.custom_proposer.RepeatLastLineProposer",
                                       "num_speculative_tokens": 24, "branches": 3, "depth": 8})
"""

from __future__ import annotations

import msgspec
import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer


class RepeatLastLineOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options arrive from the speculative config's extra keys, typed and validated at startup."""

    branches: int = 3  # how many earlier occurrences to follow
    depth: int = 8  # how many tokens to draft after each
    min_match: int = 2  # tokens of the current line that must match

    def __post_init__(self) -> None:
        if self.branches < 1 or self.depth < 1 or self.min_match < 1:
            raise ValueError("branches, depth and min_match must all be >= 1")


class RepeatLastLineProposer(TreeProposer):
    options_type = RepeatLastLineOptions

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        return [self._one(ctx.committed(i)) if ctx.needs_draft(i) else None for i in range(ctx.num_reqs)]

    def _one(self, tokens: np.ndarray) -> DraftTree | None:
        o: RepeatLastLineOptions = self.options
        suffix = tokens[-o.min_match:]
        if tokens.size <= o.min_match:
            return None
        # Start positions of earlier occurrences of the suffix, newest first.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], o.min_match)
        starts = np.nonzero((windows == suffix).all(axis=1))[0][::-1]
        branches: list[np.ndarray] = []
        first_tokens: set[int] = set()
        for start in starts:
            continuation = tokens[start + o.min_match: start + o.min_match + o.depth]
            if continuation.size == 0 or int(continuation[0]) in first_tokens:
                continue  # siblings must differ, or the second one could never be accepted
            first_tokens.add(int(continuation[0]))
            branches.append(continuation)
            if len(branches) == o.branches:
                break
        # Breadth-first order: the scheduler may keep only a prefix of the node list, and a breadth-first prefix
        # keeps the shallow nodes of every branch.
        return DraftTree.from_branches(branches) if branches else None
