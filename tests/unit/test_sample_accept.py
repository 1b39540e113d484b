"""Lossless acceptance without an engine: the committed first token is distributed as the target's p."""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from vllm_treespec.sampling import sample_accept


def test_sample_accept_is_exact_on_a_known_distribution():
    """With a fixed target p at the root and three candidate children, the first committed token follows p."""
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    probs = p.expand(4, 4).contiguous()  # root + 3 children rows
    tokens = np.array([1, 0, 3])
    parents = np.array([-1, -1, -1], np.int32)
    generator = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(20000):
        path, bonus = sample_accept(tokens, parents, probs, generator)
        counts[int(tokens[path[0]]) if path else bonus] += 1
    from scipy.stats import chisquare

    observed = np.array([counts[i] for i in range(4)])
    assert chisquare(observed, p.numpy() * observed.sum()).pvalue > 0.01
