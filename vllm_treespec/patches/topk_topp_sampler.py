"""Patch of ``vllm.v1.sample.ops.topk_topp_sampler`` (module function), CPU only.

On CPU, top-k without top-p goes through ``apply_top_k_only``, which starts with ``k.max()``. When the rejection
sampler constrains the target logits of a step whose batch has no draft token to score (zero rows) but a request
uses top-k, that reduction over an empty tensor raises "max(): Expected reduction dim to be specified for
input.numel() == 0" and kills the engine. The soak (``tests/test_server_reliability.py``) hits it with a streamed
top-k-only request among greedy ones. With zero rows there is nothing to mask: the wrapper returns the logits
unchanged and calls the original otherwise.
"""

from __future__ import annotations

from vllm.v1.sample.ops import topk_topp_sampler

from vllm_treespec.patches import is_patched, wrap_function


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or is_patched(topk_topp_sampler, "apply_top_k_only"):
        return

    @wrap_function(topk_topp_sampler, "apply_top_k_only", ("logits", "k"))
    def apply_top_k_only(original, logits, k):
        if logits.shape[0] == 0:
            return logits
        return original(logits, k)
