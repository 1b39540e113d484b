"""The draft-tree contract checked in one compiled pass (:class:`vllm_treespec.api.DraftTree` builds every
proposer's tree through it, every step). A module of its own: ``vllm_treespec.api`` must not import numba, which
vLLM's CPU worker cannot start beside where the plugin is off (``patches.triton_dispatcher``)."""

from __future__ import annotations

from numba import njit

BAD_PARENT, NEGATIVE_TOKEN = 1, 2


@njit(cache=True)
def tree_problem(tokens, parents):  # pragma: no cover - compiled
    """0, or what is wrong with a tree's arrays: a parent outside ``-1 <= parents[i] < i`` (:data:`BAD_PARENT`, named
    first), else a negative token (:data:`NEGATIVE_TOKEN`). One pass, where the NumPy checks cost ~30 us a tree."""
    negative = False
    for i in range(parents.shape[0]):
        if parents[i] < -1 or parents[i] >= i:
            return BAD_PARENT
        negative = negative or tokens[i] < 0
    return NEGATIVE_TOKEN if negative else 0
