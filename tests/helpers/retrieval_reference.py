"""Brute-force references for the retrieval tests: substring counts and a checker of best-first trees."""

from __future__ import annotations

import glob
import os
import re
import sysconfig
from typing import Callable

import numpy as np
import pytest

SEP = -1


def occurrences(text: list[int], pattern: tuple[int, ...]) -> list[int]:
    """End positions (inclusive) of ``pattern`` in ``text``."""
    m = len(pattern)
    return [i + m - 1 for i in range(len(text) - m + 1) if tuple(text[i:i + m]) == pattern]


def followers(text: list[int], pattern: tuple[int, ...]) -> dict[int, float]:
    """Empirical distribution of the token after ``pattern`` (a SEP follower counts in the total, is not returned)."""
    ends = [e for e in occurrences(text, pattern) if e + 1 < len(text)]
    probs: dict[int, float] = {}
    for e in ends:
        t = text[e + 1]
        if t != SEP:
            probs[t] = probs.get(t, 0) + 1
    return {t: c / len(ends) for t, c in probs.items()}


def longest_match(text: list[int], context: list[int]) -> int:
    """Length of the longest suffix of ``context`` that occurs in ``text``."""
    best = 0
    for m in range(1, len(context) + 1):
        if occurrences(text, tuple(context[len(context) - m:])):
            best = m
        else:
            break
    return best


def check_best_first(tree, dist: Callable[[tuple[int, ...]], dict[int, float]], budget: int, max_depth: int,
                     min_prob: float = 0.0, min_score: float = 0.0) -> None:
    """``tree`` = (token_ids, parents, probs) must be the best-first top-``budget`` tree of the distribution
    ``dist(path) -> {token: P(token | path)}`` under the depth and probability limits."""
    tok, par, prob = (np.asarray(a) for a in tree[:3])
    n = tok.shape[0]
    assert tok.dtype == np.int64 and par.dtype == np.int32 and prob.dtype == np.float32
    assert par.shape == (n,) and prob.shape == (n,) and n <= budget
    paths: list[tuple[int, ...]] = []
    scores: list[float] = []
    for i in range(n):
        p = int(par[i])
        assert -1 <= p < i, f"parent {p} of node {i} breaks topological order"
        base = paths[p] if p >= 0 else ()
        parent_score = scores[p] if p >= 0 else 1.0
        path = base + (int(tok[i]),)
        assert len(path) <= max_depth
        d = dist(base)
        assert int(tok[i]) in d, f"path {path} does not occur after the matched suffix"
        assert abs(prob[i] - d[int(tok[i])]) < 1e-6, (path, prob[i], d[int(tok[i])])
        assert prob[i] >= min_prob - 1e-7 and parent_score * prob[i] >= min_score - 1e-7
        paths.append(path)
        scores.append(parent_score * float(prob[i]))
    assert len(set(paths)) == n, "duplicate sibling tokens"
    assert all(scores[i] >= scores[i + 1] - 1e-6 for i in range(n - 1)), "not in best-first order"
    # frontier: nothing left out may beat anything taken (and nothing eligible is left out of a tree below budget)
    taken = set(paths)
    worst = min(scores) if scores else 1.0
    for base, base_score in [((), 1.0)] + list(zip(paths, scores)):
        if len(base) >= max_depth:
            continue
        for t, q in dist(base).items():
            s = base_score * q
            if base + (t,) in taken or q < min_prob or s < min_score:
                continue
            assert n == budget, f"eligible {base + (t,)} left out of a tree below budget"
            assert s <= worst + 1e-6, f"left out {base + (t,)} (score {s}) beats a taken node ({worst})"


def stdlib_token_stream(limit: int = 200_000) -> np.ndarray:
    """Real text as token ids: Python stdlib sources split into words/punctuation, mapped onto 4096 ids."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    words = re.findall(r"\w+|[^\w\s]|\n", "\n".join(open(f, encoding="utf-8", errors="replace").read()
                                                    for f in files[:40]))
    vocab: dict[str, int] = {}
    return np.array([vocab.setdefault(w, len(vocab) % 4096) for w in words[:limit]], np.int32)


@pytest.fixture(scope="session")
def stdlib_tokens() -> np.ndarray:
    return stdlib_token_stream()
