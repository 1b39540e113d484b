"""The model runner's ``_prepare_inputs`` under a tree verifier (patches/model_runner.py), without an engine: a CPU
step without drafts is prepared as a non-speculative engine's step (no spec-decode metadata), every other step as
vLLM prepares it, and the runner's speculative config is back in place afterwards whatever happens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_treespec.patches.model_runner import prepare_inputs_of_step

SPECULATIVE = object()


def runner(device: str) -> SimpleNamespace:
    return SimpleNamespace(device=SimpleNamespace(type=device), speculative_config=SPECULATIVE)


def step(drafts: dict[str, list[int]]) -> SimpleNamespace:
    return SimpleNamespace(scheduled_spec_decode_tokens=drafts)


def seen_config(r, scheduler_output, num_scheduled_tokens):
    """vLLM's _prepare_inputs builds spec-decode metadata exactly when the runner has a speculative config."""
    return r.speculative_config


@pytest.mark.parametrize(("device", "drafts", "prepared_as"), [
    ("cpu", {}, None),  # a plain CPU step: no metadata
    ("cpu", {"a": [3, 4]}, SPECULATIVE),  # drafts to verify: vLLM's metadata
    ("cuda", {}, SPECULATIVE),  # GPU backends may read the per-request draft counts: as vLLM does it
])
def test_only_a_cpu_step_without_drafts_is_prepared_without_spec_decode_metadata(device, drafts, prepared_as):
    r = runner(device)
    assert prepare_inputs_of_step(seen_config, r, step(drafts), [1]) is prepared_as
    assert r.speculative_config is SPECULATIVE


def test_the_speculative_config_is_restored_when_vllm_raises():
    def failing(r, scheduler_output, num_scheduled_tokens):
        raise RuntimeError("prepare failed")

    r = runner("cpu")
    with pytest.raises(RuntimeError, match="prepare failed"):
        prepare_inputs_of_step(failing, r, step({}), [1])
    assert r.speculative_config is SPECULATIVE
