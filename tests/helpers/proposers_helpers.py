"""Shared test helpers."""

import numpy as np

from vllm_treespec.api import DraftTree


def random_tree(rng: np.random.Generator, n: int, vocab: int = 1000) -> DraftTree:
    parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], np.int32)
    return DraftTree(rng.integers(0, vocab, n), parents)
