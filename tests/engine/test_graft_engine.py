"""graft end to end: greedy output identical to no speculation (SmolLM2, fp32), at batch 8 and batch 1, in vLLM's
default multiprocess engine (the other engine tests run their engines in-process, which start faster); and the store
of finished outputs saved to its file (``suffix_global_file``) when that engine shuts down."""

from __future__ import annotations

import pytest


@pytest.mark.engine
def test_engine_greedy_identical_to_no_speculation(tmp_path):
    from vllm import SamplingParams

    from engine_helpers import chat_prompts, close, make_llm, spec_counters, token_ids
    from vllm_treespec.retrieval import load_datastore
    from vllm_treespec.retrieval.store_file import documents_of
    from vllm_treespec.tools.models import ensure_smollm2

    model = str(ensure_smollm2())
    prompts = chat_prompts(model, limit_mt=4, limit_he=4)
    params = SamplingParams(temperature=0, max_tokens=40)
    base = make_llm(model)
    try:
        expected = token_ids(base.generate(prompts, params, use_tqdm=False))
    finally:
        close(base)
    store_file = tmp_path / "outputs.tsds"
    llm = make_llm(model, {"method": "graft", "num_speculative_tokens": 16, "graft_position": "both",
                           "suffix_global_file": str(store_file)}, in_process=False)
    try:
        got = token_ids(llm.generate(prompts, params, use_tqdm=False))  # batch 8
        got1 = [token_ids(llm.generate([p], params, use_tqdm=False))[0] for p in prompts[:2]]  # batch 1
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == expected
    assert got1 == expected[:2]
    # trees were verified (how many the step budget admits, and so how many are accepted, depends on what it learns)
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] > 0
    # 10 finished requests, fewer than a periodic save's 256: the worker's shutdown saved them, each output whole
    stored = [tuple(d.tolist()) for d in documents_of(load_datastore(store_file).automaton.tokens)]
    assert sorted(stored[:8]) == sorted(map(tuple, expected))  # the batch of 8, in the order it finished
    assert stored[8:] == list(map(tuple, expected[:2]))  # then the two at batch 1
