"""Patches of ``vllm.v1.sample.ops.topk_topp_sampler`` (module functions), CPU only.

``apply_top_k_only``: on CPU, top-k without top-p starts with ``k.max()``. When the rejection sampler constrains the
target logits of a step whose batch has no draft token to score (zero rows) but a request uses top-k, that reduction
over an empty tensor raises "max(): Expected reduction dim to be specified for input.numel() == 0" and kills the
engine. The soak (``tests/test_server_reliability.py``) hits it with a streamed top-k-only request among greedy ones.
With zero rows there is nothing to mask: the wrapper returns the logits unchanged and calls the original otherwise.

``apply_top_k_top_p_pytorch``: with top-k *and* top-p the original sorts every row over the whole vocabulary. A tree
step at T > 0 constrains 1 + budget rows per request (twice: vLLM's rejection sampler, then tree acceptance), and
on CPU those sorts were 85% of the worker's time (py-spy, ``tests/test_sampling_lossless.py``). When every row has
a top-k well below the vocabulary, the wrapper takes ``topk`` over ``max(k) + 1`` columns instead of a full sort,
masks below each row's k-th largest logit and applies top-p to the survivors only. A row whose k-th value ties with
a logit beyond those columns (the original keeps every tie) is masked on the full row and gets top-p from the
original. Same kept set as the original up to float rounding at the top-p boundary (the survivors' softmax is summed
in another order); the original handles every other case, including callers that forbid a CPU sync.

Top-p *alone* (the usual chat setting, e.g. temperature 0.7 / top-p 0.9) sorted every row too: 46 ms per call for
17 rows of SmolLM2's 49,152-token vocabulary on 2 cores, twice per tree step (a ~60 ms forward). When the tokens
outside a row's ``TOP_P_HEAD_COLUMNS`` most likely ones hold at most 1 - p of its mass and are all strictly less
likely, vLLM drops all of them whatever the order, so the wrapper finds the cut among the head only (3.1 ms for the
same 17 peaked rows); other rows (flat distributions, ties at the head's edge, p = 1) go to the original.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.ops import topk_topp_sampler

from vllm_treespec.patches import is_patched, wrap_function

# Above this max(k) (as a fraction of the vocabulary) topk costs about as much as a full sort: leave it to the original.
MAX_SURVIVORS_FRACTION = 1 / 16
# Top-p alone looks for the nucleus among this many most likely tokens of a row before sorting the whole row.
TOP_P_HEAD_COLUMNS = 256


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or is_patched(topk_topp_sampler, "apply_top_k_only"):
        return

    @wrap_function(topk_topp_sampler, "apply_top_k_only", ("logits", "k"))
    def apply_top_k_only(original, logits, k):
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)

    @wrap_function(topk_topp_sampler, "apply_top_k_top_p_pytorch", ("logits", "k", "p", "allow_cpu_sync"))
    def apply_top_k_top_p_pytorch(original, logits, k, p, allow_cpu_sync=False):
        if p is None or logits.shape[0] == 0 or not allow_cpu_sync:  # max(k), ties and masses need a sync
            return original(logits, k, p, allow_cpu_sync)
        if k is None:
            return top_p_in_head(logits, p, original, allow_cpu_sync)
        return top_k_then_top_p(logits, k, p, original, allow_cpu_sync)


def top_k_then_top_p(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor, original, allow_cpu_sync: bool
                     ) -> torch.Tensor:
    """Top-k then top-p over the top-k survivors only (in place, like the original)."""
    limit = max(1, int(logits.shape[1] * MAX_SURVIVORS_FRACTION))
    max_k = int(k.max())
    if max_k > limit:
        return original(logits, k, p, allow_cpu_sync)
    values, index = logits.topk(max_k + 1, dim=1)  # descending; one extra column to see ties beyond max_k
    kth = values.gather(1, (k.to(torch.long) - 1).unsqueeze(1))
    if bool((values[:, -1:] == kth).any()):
        # a row's k-th value ties with logits outside the first max_k columns (the original keeps all ties): mask on
        # the full row, then top-p as vLLM does it
        logits.masked_fill_(logits < kth, -float("inf"))
        return original(logits, None, p, allow_cpu_sync)
    values, index = values[:, :-1], index[:, :-1]
    values.masked_fill_(values < kth, -float("inf"))
    values, index = values.flip(1), index.flip(1)  # ascending, as the original's cumulative sum runs
    cumulative = values.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # at least one token
    values.masked_fill_(drop, -float("inf"))
    return logits.fill_(-float("inf")).scatter_(1, index, values)


def top_p_in_head(logits: torch.Tensor, p: torch.Tensor, original, allow_cpu_sync: bool) -> torch.Tensor:
    """Top-p alone (in place, like the original) over the ``TOP_P_HEAD_COLUMNS`` most likely tokens of each row.

    vLLM drops the tokens whose ascending cumulative probability is <= 1 - p. When the tokens outside the head hold
    at most 1 - p of the mass and are all strictly less likely than the head's last token, they are dropped whatever
    the order, so the cut lies inside the head: the head's ascending cumulative sum starts from the tail's mass.
    Rows where that does not hold (a flat distribution, ties at the head's edge, -inf-masked rows) go to the original.
    """
    head = min(TOP_P_HEAD_COLUMNS, logits.shape[1] - 1)
    values, index = logits.topk(head + 1, dim=1)  # descending; one extra column to see ties at the head's edge
    probs = (values[:, :-1] - logits.logsumexp(dim=1, keepdim=True)).exp()
    tail = 1 - probs.sum(dim=1)
    inside = (tail <= 1 - p) & (values[:, -2] > values[:, -1])
    rows = None  # the rows answered here (None: all of them)
    if not bool(inside.all()):
        outside = torch.nonzero(~inside).squeeze(1)
        logits[outside] = original(logits[outside], None, p[outside], allow_cpu_sync)
        rows = torch.nonzero(inside).squeeze(1)
        if rows.numel() == 0:
            return logits
        values, index, probs, tail, p = values[rows], index[rows], probs[rows], tail[rows], p[rows]
    values, index, probs = values[:, :-1].flip(1), index[:, :-1].flip(1), probs.flip(1)  # ascending
    drop = tail.unsqueeze(1) + probs.cumsum(dim=-1) <= 1 - p.unsqueeze(1)
    drop[:, -1] = False  # at least one token
    values.masked_fill_(drop, -float("inf"))
    if rows is None:
        return logits.fill_(-float("inf")).scatter_(1, index, values)
    logits[rows] = torch.full_like(values[:, :1], -float("inf")).expand(-1, logits.shape[1]).scatter(1, index, values)
    return logits
