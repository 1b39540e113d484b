"""End-to-end tree verification in a real vLLM engine on the embedded SmolLM2 model, fp32.

The default suite runs a modest prompt set; `-m slow` (scripts/exactness.py) runs >= 100 real prompts.
"""

from __future__ import annotations

import json

import pytest

from engine_helpers import chat_prompts, close, make_llm, spec_counters, token_ids

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
#: one full batch (max_num_seqs): the head-drafting tests' cost grows with every verified row
BATCH = 8


@pytest.fixture(scope="module")
def model():
    from vllm_treespec.tools.models import ensure_smollm2

    return str(ensure_smollm2())


@pytest.fixture(scope="module")
def prompts(model):
    return chat_prompts(model, limit_mt=6, limit_he=6)


# Engines that live across tests run multiprocess; each test's own engine runs in-process (engine_helpers.make_llm).
@pytest.fixture(scope="module")
def base(model):
    llm = make_llm(model, in_process=False)
    yield llm
    close(llm)


@pytest.fixture(scope="module")
def tree(model):
    llm = make_llm(model, {"method": "static_tree", "num_speculative_tokens": 24, "branches": 4, "depth": 6},
                   in_process=False)
    yield llm
    close(llm)


def greedy(max_tokens=MAX_TOKENS, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_greedy_identical_batch8(base, tree, prompts):
    before = spec_counters(tree)
    expected = token_ids(base.generate(prompts, greedy(), use_tqdm=False))
    got = token_ids(tree.generate(prompts, greedy(), use_tqdm=False))
    assert got == expected
    after = spec_counters(tree)
    assert after["num_drafts"] > before["num_drafts"]  # speculation really ran
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]


def test_greedy_identical_batch1(base, tree, prompts):
    for prompt in prompts[:3]:
        assert token_ids(tree.generate([prompt], greedy(), use_tqdm=False)) == \
            token_ids(base.generate([prompt], greedy(), use_tqdm=False))


def test_mixed_tree_chain_and_no_draft_rows(base, tree, prompts):
    """Tree rows, chain-fallback rows (logprobs, penalties, min_tokens) and rows that end at once share a batch."""
    params = [greedy(), greedy(logprobs=2), greedy(presence_penalty=0.5), greedy(min_tokens=5),
              greedy(max_tokens=1), greedy(max_tokens=7), greedy(), greedy(repetition_penalty=1.2)]
    batch = prompts[: len(params)]
    expected = base.generate(batch, params, use_tqdm=False)
    got = tree.generate(batch, params, use_tqdm=False)
    assert token_ids(got) == token_ids(expected)
    assert got[1].outputs[0].logprobs is not None and len(got[1].outputs[0].logprobs) == MAX_TOKENS


def near_limit_prompt(model: str, room: int) -> list[int]:
    """Token ids of a repetitive code prompt that leaves ``room`` tokens of make_llm's max_model_len (1024)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)("def f(x):\n    return x + 1\n" * 80)["input_ids"][: 1024 - room]


def test_near_max_model_len(base, tree, model):
    """Generation that runs into max_model_len: trees are cut to what the request can still commit (the verifier's
    committable_depths) and drafts to the slots left (the scheduler)."""
    from vllm.inputs import TokensPrompt

    ids = near_limit_prompt(model, room=30)
    prompt = [TokensPrompt(prompt_token_ids=ids)]
    expected = token_ids(base.generate(prompt, greedy(max_tokens=100), use_tqdm=False))
    got = token_ids(tree.generate(prompt, greedy(max_tokens=100), use_tqdm=False))
    assert got == expected
    assert len(ids) + len(got[0]) <= 1024


def test_a_request_near_max_model_len_does_not_fill_the_batch_with_filler_drafts(base, model, prompts):
    """While one request is within num_speculative_tokens of max_model_len, vLLM's runner would skip the drafter for
    the whole batch and schedule num_speculative_tokens zeros (token 0 is in no prompt here) for every request:
    with the tree verifier the drafter keeps drafting, the short request's drafts are still verified, and every
    scheduled draft is the drafter's."""
    from vllm.inputs import TokensPrompt

    ids = near_limit_prompt(model, room=40)
    batch = [TokensPrompt(prompt_token_ids=ids), prompts[0]]
    params = [greedy(max_tokens=100), greedy(max_tokens=60)]
    llm = make_llm(model, {"method": "static_tree", "num_speculative_tokens": 24, "branches": 4, "depth": 6})
    scheduled: list[dict[str, list[int]]] = []
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def recording_schedule(*args, **kwargs):
            output = schedule(*args, **kwargs)
            scheduled.append({r: list(t) for r, t in output.scheduled_spec_decode_tokens.items()})
            return output

        scheduler.schedule = recording_schedule
        got = token_ids(llm.generate(batch, params, use_tqdm=False))
    finally:
        close(llm)
    assert got == token_ids(base.generate(batch, params, use_tqdm=False))
    assert len(ids) + len(got[0]) <= 1024
    drafts = [tokens for step in scheduled for tokens in step.values()]
    assert drafts and all(0 not in tokens for tokens in drafts)
    # the long request is within 24 tokens of the limit after its 16th token: steps where both requests verified
    # drafts are steps vLLM's runner would have filled with zeros
    assert any(len(step) == 2 for step in scheduled), scheduled


def test_abort_mid_batch(base, tree, prompts):
    """Requests aborted while others keep decoding: survivors stay identical, the engine keeps working."""
    expected = token_ids(base.generate(prompts[:4], greedy(max_tokens=60), use_tqdm=False))
    engine = tree.llm_engine
    ids = [f"abort-test-{i}" for i in range(4)]
    for req_id, prompt in zip(ids, prompts[:4]):
        engine.add_request(req_id, prompt, greedy(max_tokens=60))
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.abort_request([ids[1], ids[2]])
    assert ids[1] not in finished and ids[2] not in finished
    assert finished[ids[0]] == expected[0] and finished[ids[3]] == expected[3]
    assert token_ids(tree.generate(prompts[1:3], greedy(max_tokens=60), use_tqdm=False)) == expected[1:3]


def test_oracle_acceptance_is_exactly_designed(base, model, prompts, tmp_path):
    """With the true continuation at branch 1, depth 3 of a 3x5 tree, every verify step accepts exactly 3 drafts."""
    from vllm import SamplingParams

    # 1 + 4k tokens: the prefill's, then k steps of 3 accepted drafts and the target's token. With any other length
    # the last step's tree is cut to what the request can still commit, and accepts fewer
    max_tokens = 1 + 4 * ((MAX_TOKENS - 1) // 4)
    batch = prompts[:4]
    long = base.generate(batch, greedy(max_tokens=MAX_TOKENS + 8), use_tqdm=False)
    refs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in long]
    ref_path = tmp_path / "refs.json"
    ref_path.write_text(json.dumps(refs))
    true_depth = 3
    llm = make_llm(model, {"method": "oracle_tree", "num_speculative_tokens": 15, "reference_path": str(ref_path),
                           "branches": 3, "depth": 5, "true_branch": 1, "true_depth": true_depth})
    try:
        out = llm.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert [o.outputs[0].token_ids for o in out] == [r[len(o.prompt_token_ids):][:max_tokens]
                                                     for r, o in zip(refs, out)]
    drafts, accepted = counters["num_drafts"], counters["num_accepted_tokens"]
    assert drafts > 0
    assert accepted == true_depth * drafts, counters
    per_pos = counters["num_accepted_tokens_per_pos"]
    assert list(per_pos)[:true_depth] == [drafts] * true_depth and sum(list(per_pos)[true_depth:]) == 0


@pytest.mark.slow
def test_exactness_sweep_over_120_real_prompts():
    """MT-Bench (80) + HumanEval (40) prompts, batch 8 and 1, every shipped tree method: scripts/exactness.py."""
    import subprocess
    import sys

    from engine_helpers import REPO_DIR

    result = subprocess.run([sys.executable, f"{REPO_DIR}/scripts/exactness.py"], capture_output=True, text=True,
                            timeout=3 * 3600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK: 0 non-identical outputs" in result.stdout


def test_custom_proposer_example_by_dotted_path(base, model, prompts):
    """examples/custom_proposer.py, selected by dotted path with typed options, runs end to end exactly."""
    llm = make_llm(model, {"method": "examples.custom_proposer.RepeatLastLineProposer", "num_speculative_tokens": 24,
                           "branches": 3, "depth": 8})
    try:
        code = prompts[-4:]  # HumanEval prompts repeat a lot of their own text
        got = token_ids(llm.generate(code, greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(code, greedy(), use_tqdm=False))
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0


def test_hidden_states_are_chainized_and_kv_view_reads(base, model, prompts, tmp_path):
    report = tmp_path / "probe.json"
    llm = make_llm(model, {"method": "testing_proposers.HiddenStateProbeProposer", "num_speculative_tokens": 24,
                           "report_path": str(report)})
    try:
        got = token_ids(llm.generate(prompts[-4:], greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(prompts[-4:], greedy(), use_tqdm=False))
    probe = json.loads(report.read_text())
    assert counters["num_accepted_tokens"] > 0
    assert probe["checked"] > 20 and probe["mismatched"] == 0, probe
    assert probe["kv_reads"] == probe["checked"], probe
    # what the KV-aware head reads at inference is what its trainer recomputes from the aux hidden states
    assert probe["kv_compared"] > 100 and probe["kv_max_rel_err"] < 1e-4, probe


def _draft_head(model: str, out, mode: str = "hidden") -> tuple[str, bool]:
    """The default head of ``mode`` ("hidden": EAGLE-3, trained into the cache or shipped; "kv" / "hybrid": KV-aware,
    trained into the cache) when this machine has one (then drafts are good), else a random head of the right shape
    (drafts are rarely accepted, but every step still ingests hidden states, reads the KV cache if the head does, and
    drafts a dynamic tree)."""
    from vllm_treespec.proposers.eagle_tree import default_kv_head_path

    if (default_kv_head_path(mode) / "config.json").is_file():
        return str(default_kv_head_path(mode)), True
    import torch
    from transformers import AutoConfig

    from vllm_treespec.eagle.kv_head import KVAwareHead, KVHeadConfig
    from vllm_treespec.eagle.model import Eagle3Head, HeadConfig
    from vllm_treespec.training.train import _target_tensors

    embed, norm = _target_tensors(model)
    cfg = HeadConfig.from_target(AutoConfig.from_pretrained(model), draft_vocab_size=2048)
    if mode != "hidden":
        cfg = KVHeadConfig.from_eagle(cfg, mode)
    torch.manual_seed(0)
    head = Eagle3Head(cfg, embed=embed) if mode == "hidden" else KVAwareHead(cfg, embed=embed)
    ids = torch.arange(2048) * 3
    head.set_draft_vocab(ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(embed[ids])
        head.norm.weight.copy_(norm)
    return str(head.save(out)), False


def test_kv_aware_greedy_identical(base, model, prompts, tmp_path):
    """KV-aware trees (the hybrid head reads the target's paged KV cache every step)."""
    head, trained = _draft_head(model, tmp_path / "head", "hybrid")
    # no floor and no step-cost budget: the full budget verified, the widest trees the head makes
    llm = make_llm(model, {"method": "kv_aware", "num_speculative_tokens": 24, "checkpoint": head, "depth": 5,
                           "top_k": 6, "min_node_confidence": 0, "cost_budget": False})
    try:
        got = token_ids(llm.generate(prompts[:BATCH], greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(prompts[:BATCH], greedy(), use_tqdm=False))
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] > 20 * counters["num_drafts"]
    if trained:
        assert counters["num_accepted_tokens"] / counters["num_drafts"] > 0.5, counters


def test_graft_on_kv_aware_drafter_greedy_identical(base, model, prompts, tmp_path):
    """graft with a KV-aware head as its model drafter (the KV-only mode: no hidden states reach the head), exact."""
    head, trained = _draft_head(model, tmp_path / "head", "kv")
    # adaptive budget off (no load adaptation), no confidence floor, no step-cost budget: the full budget verified,
    # the widest trees the head and retrieval make
    llm = make_llm(model, {"method": "graft", "num_speculative_tokens": 16, "eagle_checkpoint": head,
                           "eagle_depth": 5, "eagle_top_k": 4, "adaptive_budget": False, "min_node_confidence": 0,
                           "cost_budget": False})
    try:
        got = token_ids(llm.generate(prompts[:BATCH], greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(prompts[:BATCH], greedy(), use_tqdm=False))
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] > 10 * counters["num_drafts"]
    if trained:  # a random head is confidently wrong: nothing is pruned, so nothing is grafted or accepted
        assert counters["num_accepted_tokens"] > 0, counters


def test_graft_on_head_under_changing_load_greedy_identical(base, model, prompts, tmp_path):
    """Default CPU budget table: while 4 requests run nothing is drafted and the head skips their rows; the request
    that outlives the others is then drafted for from a head KV with gaps. Exact, and drafting resumes."""
    head, _ = _draft_head(model, tmp_path / "head")
    batch = prompts[:4]
    params = [greedy(max_tokens=6)] * 3 + [greedy(max_tokens=3 * MAX_TOKENS)]
    llm = make_llm(model, {"method": "graft", "num_speculative_tokens": 16, "eagle_checkpoint": head,
                           "eagle_depth": 4, "eagle_top_k": 4})
    try:
        got = token_ids(llm.generate(batch, params, use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(batch, params, use_tqdm=False))
    assert counters["num_drafts"] > 0, counters


def shipped_head() -> str | None:
    from vllm_treespec.eagle.default_head import is_head_folder, shipped_head_path

    return str(shipped_head_path()) if is_head_folder(shipped_head_path()) else None


def test_eagle_tree_greedy_identical(base, model, prompts, tmp_path, monkeypatch):
    """eagle_tree without a checkpoint runs the shipped head (an empty cache folder: no trained head shadows it); until
    one is shipped, a head given by path (the trained one, or a random head of the right shape)."""
    from engine_helpers import drafter_checkpoint

    head, trained = shipped_head(), True
    if head is not None:
        monkeypatch.setenv("VLLM_TREESPEC_CACHE", str(tmp_path / "empty-cache"))
        spec = {}
    else:
        head, trained = _draft_head(model, tmp_path / "head")
        spec = {"checkpoint": head}
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships the function by pickle
    # floor 0 and no step-cost budget: fill the budget (either would verify only the nodes likely enough to pay)
    llm = make_llm(model, {"method": "eagle_tree", "num_speculative_tokens": 24, "depth": 5, "top_k": 6,
                           "min_node_confidence": 0, "cost_budget": False, **spec})
    try:
        assert llm.collective_rpc(drafter_checkpoint) == [head]
        got = token_ids(llm.generate(prompts[:BATCH], greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(prompts[:BATCH], greedy(), use_tqdm=False))
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] > 20 * counters["num_drafts"]  # trees
    if trained:
        assert counters["num_accepted_tokens"] / counters["num_drafts"] > 0.5, counters  # tau > 1.5


def test_shipped_head_in_vllm_eagle3_greedy_identical(base, model, prompts):
    """The shipped head is a checkpoint of vLLM's own eagle3 method: it loads there, drafts chains that are
    accepted, and the output is exact in fp32."""
    head = shipped_head()
    if head is None:
        from vllm_treespec.eagle.default_head import shipped_head_path

        pytest.skip(f"no shipped head yet: {shipped_head_path()} lacks model.safetensors (scripts/ship_head.py)")
    batch = prompts[:4]
    llm = make_llm(model, {"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    try:
        got = token_ids(llm.generate(batch, greedy(max_tokens=16), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(batch, greedy(max_tokens=16), use_tqdm=False))
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters


def test_retrieval_kernels_compile_at_startup_not_in_requests(base, model, prompts, monkeypatch):
    """graft compiles the retrieval store's numba kernels when the engine loads, and the tree step's at its warm-up:
    serving requests (batch 1 and 4, finished outputs feeding the global store) compiles no kernel of the plugin, and
    the output stays exact."""
    from engine_helpers import retrieval_kernel_signatures, step_kernel_signatures

    from vllm_treespec.cost.budget import budget_report

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships the function by pickle
    llm = make_llm(model, {"method": "graft", "num_speculative_tokens": 16})
    try:
        assert llm.collective_rpc(budget_report)[0] != {}  # the step-cost budget was built at start-up, by default
        at_startup = llm.collective_rpc(retrieval_kernel_signatures)[0]
        assert at_startup and all(at_startup[k] > 0 for k in (
            "vllm_treespec.retrieval.sam._extend", "vllm_treespec.retrieval.sam._match_dynamic",
            "vllm_treespec.retrieval.tree.extract_tree", "vllm_treespec.retrieval.ngram._lookup",
            "vllm_treespec.retrieval.successor._tree", "vllm_treespec.retrieval.tree._merge_kernel"))
        steps_at_startup = llm.collective_rpc(step_kernel_signatures)[0]
        assert all(steps_at_startup[k] > 0 for k in (
            "vllm_treespec.verify.topk._topk32_kernel", "vllm_treespec.verify.accept._argmax32_kernel",
            "vllm_treespec.tree._greedy_accept_kernel", "vllm_treespec.tree._layout_kernel",
            "vllm_treespec.attn.layout._move_slots_kernel"))
        got = [token_ids(llm.generate([p], greedy(), use_tqdm=False))[0] for p in prompts[:3]]
        got += token_ids(llm.generate(prompts[3:7], greedy(), use_tqdm=False))
        # the drafter ran and proposed trees (how many the budget verifies depends on what it learns: not asserted)
        assert llm.collective_rpc(budget_report)[0]["proposed_nodes"] > 0
        assert llm.collective_rpc(retrieval_kernel_signatures)[0] == at_startup
        assert llm.collective_rpc(step_kernel_signatures)[0] == steps_at_startup
    finally:
        close(llm)
    assert got == token_ids(base.generate(prompts[:7], greedy(), use_tqdm=False))


def test_drafts_reach_the_scheduler_without_vllms_draft_rpc(base, model, prompts):
    """The step's drafts travel with its sampled tokens (patches/draft_delivery.py): the engine core never asks the
    worker for them in a separate RPC, trees are still verified, and the output stays exact."""
    llm = make_llm(model, {"method": "static_tree", "num_speculative_tokens": 24, "branches": 4, "depth": 6})
    try:
        executor = llm.llm_engine.engine_core.engine_core.model_executor
        rpcs = []
        take = executor.take_draft_token_ids
        executor.take_draft_token_ids = lambda: rpcs.append(1) or take()
        got = token_ids(llm.generate(prompts[:4], greedy(), use_tqdm=False))
        counters = spec_counters(llm)
    finally:
        close(llm)
    assert got == token_ids(base.generate(prompts[:4], greedy(), use_tqdm=False))
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters
    assert rpcs == []
