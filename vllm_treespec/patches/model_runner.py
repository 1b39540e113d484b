"""Patches of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (inherited by ``CPUModelRunner``).

Each wrapper is a pass-through unless the runner's drafter is a TreeProposer; the tree logic itself lives in
:mod:`vllm_treespec.verify` (:class:`~vllm_treespec.verify.verifier.TreeVerifier`).
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_treespec.patches import is_patched, wrap_method


def _verifier(runner):
    return getattr(runner, "_treespec_verifier", None)


def prepare_inputs_of_step(original, runner, scheduler_output, num_scheduled_tokens):
    """vLLM's ``_prepare_inputs`` for a tree verifier's runner. A CPU step without drafts (most steps once the budget
    stops drafting) is prepared as a non-speculative engine's: vLLM would build spec-decode metadata for every
    request's zero drafts (~0.2 ms of a CPU step's host work), which neither a plain step's sampler nor our proposer
    reads. On GPUs that metadata also carries per-request draft counts some attention backends read: left as vLLM
    builds it."""
    if scheduler_output.scheduled_spec_decode_tokens or runner.device.type != "cpu":
        return original(runner, scheduler_output, num_scheduled_tokens)
    speculative_config, runner.speculative_config = runner.speculative_config, None
    try:
        return original(runner, scheduler_output, num_scheduled_tokens)
    finally:
        runner.speculative_config = speculative_config


def apply() -> None:
    if is_patched(GPUModelRunner, "__init__"):
        return

    @wrap_method(GPUModelRunner, "__init__", ("self", "vllm_config", "device"))
    def __init__(original, self, vllm_config, device):
        original(self, vllm_config, device)
        from vllm_treespec.api import TreeProposer
        from vllm_treespec.verify.verifier import TreeVerifier

        drafter = getattr(self, "drafter", None)
        self._treespec_verifier = TreeVerifier(self, drafter) if isinstance(drafter, TreeProposer) else None
        if self._treespec_verifier is not None and drafter.aux_hidden_state_layers:
            # The target returns these layers' hidden states; TreeProposer.load_model selects them on the model.
            self.use_aux_hidden_state_outputs = True

    @wrap_method(GPUModelRunner, "_setup_eagle3_aux_hidden_state_outputs", ("self",))
    def _setup_eagle3_aux_hidden_state_outputs(original, self):
        # vLLM would select its default EAGLE-3 layers (or a draft config's); a tree proposer names its own.
        verifier = _verifier(self)
        if verifier is None or not verifier.proposer.aux_hidden_state_layers:
            return original(self)
        self.model.set_aux_hidden_state_layers(tuple(verifier.proposer.aux_hidden_state_layers))

    @wrap_method(GPUModelRunner, "propose_draft_token_ids",
                 ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
                  "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
                  "slot_mappings"))
    def propose_draft_token_ids(original, self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states, *args, **kwargs):
        verifier = _verifier(self)
        if verifier is None or not isinstance(sampled_token_ids, list):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, aux_hidden_states, *args, **kwargs)
        self._draft_probs = None
        self._draft_prob_req_ids = None
        wants_hidden = verifier.proposer.needs_hidden_states
        if wants_hidden:
            verifier.chainize_rows([hidden_states, *(aux_hidden_states or [])])
        else:
            verifier.last_moves = None
        return verifier.propose(sampled_token_ids, hidden_states if wants_hidden else None,
                                aux_hidden_states if wants_hidden else None, self.query_start_loc.np,
                                scheduler_output.scheduled_spec_decode_tokens)

    @wrap_method(GPUModelRunner, "_input_fits_in_drafter", ("self", "common_attn_metadata"))
    def _input_fits_in_drafter(original, self, common_attn_metadata):
        # Once any request of the batch is within num_speculative_tokens of max_model_len, vLLM skips the drafter
        # for the whole batch and hands the scheduler num_speculative_tokens zeros per request as drafts: every
        # request then verified (and rejected) that many filler tokens a step, for as long as the long one ran (graft,
        # 32: 4.7x slower offline at 16 requests in bf16). A tree verifier cuts each request's tree to what it can
        # still commit (committable_depths), so it always drafts. (vLLM issues #34734, #52756: the zeros are
        # scheduled as drafts.)
        if _verifier(self) is None or common_attn_metadata is None:
            return original(self, common_attn_metadata)
        return True

    @wrap_method(GPUModelRunner, "_prepare_inputs", ("self", "scheduler_output", "num_scheduled_tokens"))
    def _prepare_inputs(original, self, scheduler_output, num_scheduled_tokens):
        verifier = _verifier(self)
        if verifier is None:
            return original(self, scheduler_output, num_scheduled_tokens)
        result = prepare_inputs_of_step(original, self, scheduler_output, num_scheduled_tokens)
        verifier.attach(scheduler_output, num_scheduled_tokens)
        return result

    @wrap_method(GPUModelRunner, "_sample", ("self", "logits", "spec_decode_metadata"))
    def _sample(original, self, logits, spec_decode_metadata):
        verifier = _verifier(self)
        if verifier is None:
            return original(self, logits, spec_decode_metadata)
        return verifier.sample(lambda lg, md: original(self, lg, md), logits, spec_decode_metadata)

    @wrap_method(GPUModelRunner, "_update_states", ("self", "scheduler_output"))
    def _update_states(original, self, scheduler_output):
        verifier = _verifier(self)
        if verifier is not None:
            verifier.finished(scheduler_output.finished_req_ids)
        return original(self, scheduler_output)
