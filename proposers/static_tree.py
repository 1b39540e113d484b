"""Static-shape tree proposer (a test and baseline proposer built on the public API only).

Reads the committed tokens of each request. For every branch it finds the most recent earlier occurrences of the
last token (prompt lookup) and drafts the continuation after each as a chain; the chains hang off the root in
order of recency, ``branches`` wide and ``depth`` deep. The shape is fixed, so trees are predictable for tests.
"""

from __future__ import annotations

import msgspec
import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, TreeProposer


class StaticTreeOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    #: root children: the continuations after the most recent earlier occurrences of the last token, newest first
    branches: int = 4
    #: tokens drafted on each branch
    depth: int = 4

    def __post_init__(self) -> None:
        for name in ("branches", "depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"static_tree option {name!r} must be >= 1, got {getattr(self, name)}")


def lookup_branches(context: np.ndarray, branches: int, depth: int) -> list[np.ndarray]:
    """Continuations after the most recent earlier occurrences of the last token, newest first, distinct first tokens."""
    if context.size < 2:
        return []
    last = context[-1]
    hits = np.nonzero(context[:-1] == last)[0][::-1]
    out: list[np.ndarray] = []
    seen: set[int] = set()
    for h in hits:
        cont = context[h + 1: h + 1 + depth]
        if cont.size == 0 or int(cont[0]) in seen:
            continue
        seen.add(int(cont[0]))
        out.append(cont)
        if len(out) == branches:
            break
    return out


class StaticTreeProposer(TreeProposer):
    options_type = StaticTreeOptions

    def propose_trees(self, ctx: ProposeContext) -> list[DraftTree | None]:
        opts: StaticTreeOptions = self.options
        trees: list[DraftTree | None] = []
        for i in range(ctx.num_reqs):
            if not ctx.needs_draft(i):
                trees.append(None)
                continue
            chains = lookup_branches(ctx.committed(i), opts.branches, opts.depth)
            trees.append(DraftTree.from_branches(chains) if chains else None)
        return trees

