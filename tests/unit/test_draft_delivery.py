"""Drafts delivered on the step's ModelRunnerOutput (patches/draft_delivery.py), without an engine: the worker side
attaches exactly what vLLM's RPC would return and leaves it in place, the engine core applies it once in post_step
and skips the RPC, and every missing piece falls back to vLLM's own path."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, DraftTokenIds, ModelRunnerOutput

from vllm_treespec.patches import draft_delivery
from vllm_treespec.patches.draft_delivery import OUTPUT_ATTRIBUTE, SCHEDULER_ATTRIBUTE, attach_drafts, take_delivered


class Runner:
    def __init__(self, drafts, tree=True):
        self._treespec_verifier = object() if tree else None
        self.drafts = drafts
        self.taken = 0

    def take_draft_token_ids(self):
        self.taken += 1
        return self.drafts


def output():
    return ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1}, sampled_token_ids=[[5], [6, 7]])


def test_worker_attaches_the_runners_drafts_and_they_survive_the_message_queue():
    drafts = DraftTokenIds(["a", "b"], [[1, 2, 3], []])
    runner, out = Runner(drafts), output()
    attach_drafts(runner, out)
    received = pickle.loads(pickle.dumps(out))  # the multiprocess executor's response queue pickles outputs
    assert getattr(received, OUTPUT_ATTRIBUTE) == drafts
    assert runner.drafts is drafts  # left in place: an engine core without the patch still gets them by RPC


def test_worker_attaches_nothing_without_a_tree_verifier_or_on_the_shared_empty_output():
    attach_drafts(Runner(DraftTokenIds(["a"], [[1]]), tree=False), out := output())
    assert not hasattr(out, OUTPUT_ATTRIBUTE)
    attach_drafts(Runner(DraftTokenIds(["a"], [[1]])), EMPTY_MODEL_RUNNER_OUTPUT)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, OUTPUT_ATTRIBUTE)


class Scheduler:
    def __init__(self):
        self.updates = []

    def update_draft_token_ids(self, drafts):
        self.updates.append(drafts)


class Executor:
    def __init__(self, drafts):
        self.drafts = drafts
        self.rpcs = 0

    def take_draft_token_ids(self):
        self.rpcs += 1
        return self.drafts


def engine_core(drafts_by_rpc, async_scheduling=False):
    return SimpleNamespace(scheduler=Scheduler(), model_executor=Executor(drafts_by_rpc), check_for_draft_tokens=True,
                           async_scheduling=async_scheduling)


@pytest.fixture(scope="module")
def post_step():
    """The installed EngineCore.post_step wrapper (vLLM's original runs for the fallbacks)."""
    from vllm.v1.engine.core import EngineCore

    from vllm_treespec.patches import is_patched

    draft_delivery.apply()
    assert is_patched(EngineCore, "post_step")
    return EngineCore.post_step


def test_engine_core_applies_delivered_drafts_once_and_skips_the_rpc(post_step):
    delivered = DraftTokenIds(["a"], [[4, 5]])
    core, out = engine_core(drafts_by_rpc=DraftTokenIds(["a"], [[9]])), output()
    setattr(out, OUTPUT_ATTRIBUTE, delivered)
    take_delivered(core.scheduler, out)
    assert not hasattr(out, OUTPUT_ATTRIBUTE)  # consumed: an in-process engine may see the same object again
    post_step(core, True)
    assert core.scheduler.updates == [delivered] and core.model_executor.rpcs == 0
    assert not hasattr(core.scheduler, SCHEDULER_ATTRIBUTE)
    post_step(core, True)  # the next step delivered nothing: vLLM's RPC
    assert core.model_executor.rpcs == 1 and core.scheduler.updates[-1].draft_token_ids == [[9]]


def test_delivered_none_means_no_drafts_and_no_rpc(post_step):
    core, out = engine_core(drafts_by_rpc=DraftTokenIds(["a"], [[9]])), output()
    setattr(out, OUTPUT_ATTRIBUTE, None)
    take_delivered(core.scheduler, out)
    post_step(core, True)
    assert core.scheduler.updates == [] and core.model_executor.rpcs == 0


def test_async_scheduling_keeps_vllms_path(post_step):
    core, out = engine_core(drafts_by_rpc=DraftTokenIds(["a"], [[9]]), async_scheduling=True), output()
    setattr(out, OUTPUT_ATTRIBUTE, DraftTokenIds(["a"], [[4]]))
    take_delivered(core.scheduler, out)
    post_step(core, True)
    assert core.scheduler.updates == [] and core.model_executor.rpcs == 0  # vLLM's post_step does nothing then
