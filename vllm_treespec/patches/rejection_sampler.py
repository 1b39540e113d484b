"""Patch of ``vllm.v1.sample.rejection_sampler`` (module function), CPU only.

vLLM 0.32's CPU replacement for the Triton ``expand_kernel`` converts its *output* to int64 before writing, so for
float32 temperatures and int32 top-k it writes into a temporary copy and the real output stays uninitialised memory:
speculative decoding with temperature/top-k/top-p on CPU then samples from garbage temperatures or crashes
("index 49152 is out of bounds"). This affects vLLM's own chain methods as well as our chain-fallback rows. The
wrapper expands with ``repeat_interleave`` instead; the original is kept and used on every other platform.
"""

from __future__ import annotations

import torch
from vllm.v1.sample import rejection_sampler

from vllm_treespec.patches import is_patched, wrap_function


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or is_patched(rejection_sampler, "expand_batch_to_tokens"):
        return

    @wrap_function(rejection_sampler, "expand_batch_to_tokens",
                   ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"))
    def expand_batch_to_tokens(original, x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        expanded = torch.repeat_interleave(x, counts, output_size=num_tokens)
        return torch.where(expanded == replace_from, torch.as_tensor(replace_to, dtype=x.dtype), expanded)
