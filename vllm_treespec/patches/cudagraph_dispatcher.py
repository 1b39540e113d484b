"""Patch of ``vllm.v1.cudagraph_dispatcher.CudagraphDispatcher.dispatch``, CUDA only.

A FULL CUDA graph replays the attention call it captured. A tree step whose requests all verify
``1 + num_speculative_tokens`` rows looks exactly like a uniform decode batch, so vLLM would replay a captured
FlashAttention decode graph and the tree rows' attention (``attn.flash``) would never run: silently wrong tokens.
While a tree batch is published (between the verifier's attach and its acceptance) the wrapper therefore adds FULL to
``invalid_modes``; PIECEWISE graphs stay allowed (attention is a splitting op there, run eagerly). Chain steps, and
the drafter's own dispatchers (they dispatch after acceptance, when no batch is published), are unchanged.
Lowering the builder's ``_cudagraph_support`` instead would downgrade every step of the run.

Data parallelism re-dispatches with the mode agreed across ranks; tree verification is off there (chains).
"""

from __future__ import annotations

from vllm.config import CUDAGraphMode
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_treespec.attn import plan
from vllm_treespec.patches import expect_signature, is_patched, wrap_method

DISPATCH_PARAMS = ("self", "num_tokens", "uniform_decode", "has_lora", "num_active_loras", "valid_modes",
                   "invalid_modes")
expect_signature(CudagraphDispatcher, "dispatch", DISPATCH_PARAMS)  # checked on CPU too, where it is not wrapped


def tree_step_active() -> bool:
    batch = plan.current_batch()
    return batch is not None and batch.num_reqs > 0


def install() -> None:
    """Wrap ``dispatch`` (idempotent). :func:`apply` calls it on CUDA; tests call it directly."""
    if is_patched(CudagraphDispatcher, "dispatch"):
        return

    @wrap_method(CudagraphDispatcher, "dispatch", DISPATCH_PARAMS)
    def dispatch(original, self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        if tree_step_active():
            invalid_modes = set(invalid_modes or ()) | {CUDAGraphMode.FULL}
        return original(self, num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        install()
