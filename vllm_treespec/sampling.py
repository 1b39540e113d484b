"""Lossless tree acceptance at temperature > 0 (multi-candidate recursive rejection sampling, SpecInfer style).

At a node with target distribution p, its children are tried in order: child c is accepted with probability
p(c); on rejection p(c) is set to 0 and p renormalised. If no child is accepted, the next token is sampled from the
residual. Each step's token is therefore distributed exactly as p, whatever the drafts are (drafts are treated as
one-hot proposals), so the output distribution equals sampling without speculation.
"""

from __future__ import annotations

import numpy as np
import torch


def children_lists(parents: np.ndarray) -> list[list[int]]:
    """children[w] = node indices whose parent row is w (row 0 = root, row 1+i = node i), in draft order."""
    children: list[list[int]] = [[] for _ in range(parents.size + 1)]
    for i, p in enumerate(parents.tolist()):
        children[p + 1].append(i)
    return children


def sample_accept(tokens: np.ndarray, parents: np.ndarray, probs: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Accept a path in one tree. ``probs[w]`` is the target distribution at row w (after temperature/top-k/top-p).

    Returns (accepted node indices root-first, the token sampled after them).
    """
    children = children_lists(parents)
    path: list[int] = []
    row = 0
    while True:
        p = probs[row].to(torch.float64).clone()
        accepted = None
        for c in children[row]:
            t = int(tokens[c])
            total = float(p.sum())
            pc = float(p[t]) / total if total > 0 else 0.0
            if pc > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < pc:
                accepted = c
                break
            p[t] = 0.0
        if accepted is None:
            if float(p.sum()) <= 0:  # every token with mass was a rejected candidate: impossible unless p is degenerate
                p = probs[row].to(torch.float64)
            token = int(torch.multinomial(p / p.sum(), 1, generator=generator))
            return path, token
        path.append(accepted)
        row = accepted + 1
