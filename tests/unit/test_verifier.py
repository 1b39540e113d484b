"""TreeVerifier without an engine: a fake runner (tests/helpers/fake_runner.py), a proposer returning known trees,
and expected outputs written out by hand (in the style of vLLM's tests/v1/sample/test_rejection_sampler.py).

The tree used throughout, T, drafted after root token 9 of request "a" (8 committed tokens, 7 of them with K/V, so the
root runs at position 7 and node i at linear position 8 + i):

    root(9) ─┬─ n0:10 ─┬─ n2:12
             │         └─ n3:13
             └─ n1:11 ──── n4:14

Request "a" has block-table row [3, 0, 5, 2] (block size 4): position p sits in slot ``row[p // 4] * 4 + p % 4``.
Request "b" (5 committed tokens, root at position 4) drafts the chain [20, 21].
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fake_runner import FakeProposer, FakeRequest, fake_runner, recording_layer, schedule, tree_attention_impl
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from vllm_treespec.api import DraftTree
from vllm_treespec.attn import plan
from vllm_treespec.tree import TreeBatch
from vllm_treespec.verify.accept import accept, argmax_rows, logits_rows, read_logits
from vllm_treespec.verify.compact import accepted_moves, slots
from vllm_treespec.verify.support import tree_unsupported_reason, unsupported_model_reason
from vllm_treespec.verify.verifier import TreeVerifier

T = DraftTree(np.array([10, 11, 12, 13, 14]), np.array([-1, -1, 0, 0, 1], np.int32))
CHAIN_B = DraftTree.chain([20, 21])
VOCAB = 32


def request_a(**sampling) -> FakeRequest:
    return FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 9], [3, 0, 5, 2], SamplingParams(**{"temperature": 0.0, **sampling}))


def request_b() -> FakeRequest:
    return FakeRequest("b", [1, 2, 3, 4, 5], [1, 4])


def make_verifier(requests=None, trees=None, max_nodes=5, proposer=None, **runner_kwargs):
    runner = fake_runner(requests or [request_a(), request_b()], max_nodes, **runner_kwargs)
    proposer = proposer or FakeProposer({"a": T, "b": CHAIN_B} if trees is None else trees)
    verifier = TreeVerifier(runner, proposer)
    verifier._layers = [recording_layer()]  # instead of the model's Attention layers
    return verifier


@pytest.fixture(autouse=True)
def no_published_batch():
    yield
    plan.publish(None)


def one_hot_logits(tokens: list[int]) -> torch.Tensor:
    """One logits row per token: 0 at the token, -inf elsewhere (every sampler puts all mass on it)."""
    logits = torch.full((len(tokens), VOCAB), float("-inf"))
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


# --- propose: trees to the scheduler's drafts ------------------------------------------------------------------------

def test_propose_hands_vllm_flattened_trees_and_keeps_only_real_trees():
    c = FakeRequest("c", [1, 2, 3], [6])
    verifier = make_verifier([request_a(), request_b(), c], {"a": T, "b": CHAIN_B, "c": T})
    drafts = verifier.propose([[9], [5], []])  # c is a partial prefill: no draft
    assert drafts == [[10, 11, 12, 13, 14], [20, 21], []]
    assert list(verifier.pending) == ["a"]
    assert verifier.pending["a"].token_ids.tolist() == [10, 11, 12, 13, 14]
    ctx = verifier.proposer.contexts[0]
    assert ctx.req_ids == ["a", "b", "c"] and ctx.max_nodes == 5
    assert ctx.committed(0).tolist() == [1, 2, 3, 4, 5, 6, 7, 9] and ctx.committed(2).tolist() == [1, 2, 3]


@pytest.mark.parametrize("max_nodes, drafts, pending_parents", [
    (3, [10, 11, 12], [-1, -1, 0]),  # the first 3 nodes are still a tree
    (2, [10, 11], [-1, -1]),
    (1, [10], None),  # one node is a chain: nothing to re-attach
])
def test_propose_truncates_trees_to_the_budget(max_nodes, drafts, pending_parents):
    verifier = make_verifier(max_nodes=max_nodes, trees={"a": T})
    assert verifier.propose([[9], [5]]) == [drafts, []]
    if pending_parents is None:
        assert verifier.pending == {}
    else:
        assert verifier.pending["a"].parents.tolist() == pending_parents


@pytest.mark.parametrize("max_tokens, drafts_a, pending_parents", [
    (5, [10, 11, 12, 13, 14], [-1, -1, 0, 0, 1]),  # 2 outputs so far: the next step may commit 3, depth 2 fits
    (4, [10, 11], [-1, -1]),  # room for 2 more tokens: one draft and the target's token, so depth 1 only
    (3, [], None),  # the next token is the last: no draft can be committed
])
def test_propose_cuts_the_drafts_a_request_ending_at_max_tokens_cannot_commit(max_tokens, drafts_a, pending_parents):
    a = FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 9], [3, 0, 5, 2], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    prompt_len=6)
    verifier = make_verifier([a, request_b()])
    assert verifier.propose([[9], [5]]) == [drafts_a, [20, 21]]
    if pending_parents is None:
        assert "a" not in verifier.pending
    else:
        assert verifier.pending["a"].parents.tolist() == pending_parents


def test_propose_cuts_the_drafts_beyond_max_model_len():
    long = FakeRequest("a", list(range(1, 31)), [3, 0, 5, 2, 1, 4, 6, 7])  # 30 of the fake runner's 32 positions
    verifier = make_verifier([long, request_b()])
    # the next step may commit 2 tokens (positions 30 and 31): one draft deep
    assert verifier.propose([[30], [5]]) == [[10, 11], [20, 21]]


def test_propose_rejects_a_wrong_number_of_trees():
    verifier = make_verifier()
    verifier.proposer.propose_trees = lambda ctx: [T]
    with pytest.raises(RuntimeError, match="returned 1 trees for 2 requests"):
        verifier.propose([[9], [5]])


@pytest.mark.parametrize("sampling, reason", [
    ({"logprobs": 1}, "logprobs"),
    ({"presence_penalty": 0.5}, "penalties"),
    ({"frequency_penalty": 0.5}, "penalties"),
    ({"repetition_penalty": 1.2}, "penalties"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"temperature": 1.0, "min_p": 0.1}, "min_p"),
    ({"logit_bias": {3: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [10, 11]}, "allowed_token_ids"),
    ({"temperature": 1.0, "seed": 3}, "per-request seed"),
    ({"structured_outputs": StructuredOutputsParams(regex="a+")}, "structured output"),
])
def test_request_whose_sampling_reads_draft_order_runs_the_first_child_chain(sampling, reason):
    assert tree_unsupported_reason(SamplingParams(**sampling)) == reason
    verifier = make_verifier([request_a(**sampling), request_b()])
    assert verifier.propose([[9], [5]]) == [[10, 12], [20, 21]]  # n0 then its first child n2
    assert verifier.pending == {}


def test_plain_sampling_and_non_generation_requests():
    assert tree_unsupported_reason(SamplingParams(temperature=0.0)) is None
    assert tree_unsupported_reason(SamplingParams(temperature=0.8, top_p=0.9, top_k=5)) is None
    assert tree_unsupported_reason(None) == "not a generation request"


# --- model support ----------------------------------------------------------------------------------------------------

def impl_with(**attributes):
    impl = tree_attention_impl()
    for name, value in attributes.items():
        setattr(impl, name, value)
    return impl


class PlainImpl:
    pass


@pytest.mark.parametrize("runner_kwargs, impl, reason", [
    ({}, impl_with(), None),
    ({}, impl_with(sliding_window=(-1, -1)), None),  # FlashAttention's "no window"
    ({"uses_mrope": True, "pipeline_parallel_size": 2}, impl_with(), "M-RoPE positions"),  # the first check wins
    ({"pipeline_parallel_size": 2}, impl_with(), "pipeline parallelism"),
    ({"data_parallel_size": 2}, impl_with(),
     "data parallelism (ranks re-dispatch CUDA graphs with a mode agreed across ranks)"),
    ({}, None, "no attention layers found"),
    ({"kv_cache_specs": [SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                           sliding_window=16)]},
     impl_with(), "SlidingWindowSpec layers (sliding window / hybrid models)"),
    ({}, impl_with(sliding_window=16), "sliding-window attention"),
    ({}, impl_with(dcp_world_size=2), "decode context parallelism"),
    ({}, impl_with(alibi_slopes=torch.ones(2)), "ALiBi / attention sinks"),
    ({}, impl_with(sinks=torch.ones(2)), "ALiBi / attention sinks"),
    ({}, impl_with(logits_soft_cap=30.0), "logit soft-capping"),
    ({}, impl_with(kv_cache_dtype="fp8"), "kv_cache_dtype=fp8"),
    ({}, PlainImpl(), "attention backend PlainImpl has no tree path; on CUDA trees need FLASH_ATTN "
                      "(--attention-backend FLASH_ATTN)"),
])
def test_unsupported_model_reasons(runner_kwargs, impl, reason):
    runner = fake_runner([request_a()], **runner_kwargs)
    layers = [] if impl is None else [recording_layer(impl)]
    assert unsupported_model_reason(runner, layers) == reason


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_unsupported_model_runs_chains_with_one_log_line():
    verifier = make_verifier(uses_mrope=True)
    logger, handler = logging.getLogger("vllm.treespec"), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert verifier.propose([[9], [5]]) == [[10, 12], [20, 21]]
        verifier.attach(*schedule(verifier.runner, {"a": [10, 12], "b": [20, 21]}))
        assert verifier.batch is None
        assert verifier.propose([[9], [5]]) == [[10, 12], [20, 21]]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert verifier.enabled is False and verifier.pending == {}
    assert handler.lines == ["vllm_treespec: tree verification is off for this model (M-RoPE positions); "
                             "proposals run as chains."]


# --- attach: scheduled drafts back to trees ---------------------------------------------------------------------------

def proposed(verifier):
    verifier.propose([[9], [5]])
    return verifier


def test_attach_rewrites_node_positions_to_context_plus_depth():
    verifier = proposed(make_verifier())
    scheduler_output, num_scheduled = schedule(verifier.runner, {"a": [10, 11, 12, 13, 14], "b": [20, 21]})
    assert verifier.runner.positions[:9].tolist() == [7, 8, 9, 10, 11, 12, 4, 5, 6]  # linear, as vLLM prepared them
    verifier.attach(scheduler_output, num_scheduled)
    batch = verifier.batch
    assert batch is not None and plan.current_batch() is batch
    assert batch.rows.tolist() == [0] and batch.req_ids == ["a"]
    assert batch.query_start.tolist() == [0] and batch.context_len.tolist() == [7]
    assert batch.depth.tolist() == [1, 1, 2, 2, 2]
    # root 7; n0, n1 at depth 1 -> 8; n2, n3, n4 at depth 2 -> 9; the chain row b keeps its linear positions
    assert verifier.runner.positions[:9].tolist() == [7, 8, 8, 9, 9, 9, 4, 5, 6]
    assert verifier.pending == {}


def test_attach_re_attaches_a_truncated_prefix_that_is_still_a_tree():
    verifier = proposed(make_verifier())
    verifier.attach(*schedule(verifier.runner, {"a": [10, 11, 12], "b": [20, 21]}))
    assert verifier.batch.trees[0].parents.tolist() == [-1, -1, 0]
    assert verifier.runner.positions[:7].tolist() == [7, 8, 8, 9, 4, 5, 6]


@pytest.mark.parametrize("scheduled_a, runs", [
    ([10], None),  # truncated to one node: a chain
    ([-1, -1, -1, -1, -1], None),  # placeholder drafts
    ([10, 11, 13], None),  # not a prefix of the tree's nodes
    ([], None),  # not scheduled with drafts
    ([10, 11, 12, 13, 14], 4),  # the row runs fewer tokens than root + drafts
])
def test_attach_falls_back_to_chains(scheduled_a, runs):
    verifier = proposed(make_verifier())
    scheduler_output, num_scheduled = schedule(verifier.runner, {"a": scheduled_a, "b": [20, 21]})
    if runs is not None:
        num_scheduled[0] = runs
    before = verifier.runner.positions.clone()
    verifier.attach(scheduler_output, num_scheduled)
    assert verifier.batch is None and plan.current_batch() is None
    assert torch.equal(verifier.runner.positions, before)
    assert verifier.pending == {}  # a tree is re-attached in the step it was proposed for, or never


# --- sample: acceptance in chain form, compaction ---------------------------------------------------------------------

def sampler_output():
    """What vLLM's (chain) rejection sampler returned for rows a and b; row a is replaced by the verifier."""
    return SimpleNamespace(sampled_token_ids=torch.tensor([[10, 99, -1, -1, -1, -1], [20, 21, 5, -1, -1, -1]]))


def vllm_greedy(logits: torch.Tensor, metadata) -> SimpleNamespace:
    """What vLLM's greedy sampler returns for a step (``metadata``: its SpecDecodeMetadata, or None): per request,
    its drafts up to the first that is not the argmax, then that argmax or the bonus row's, padded with -1."""
    argmax = logits.argmax(dim=-1).tolist()
    if metadata is None:
        return SimpleNamespace(sampled_token_ids=torch.tensor(argmax, dtype=torch.int32)[:, None])
    width = metadata.max_spec_len + 1
    drafts, targets = metadata.draft_token_ids.tolist(), metadata.target_logits_indices.tolist()
    out, offset = [], 0
    for i, n in enumerate(metadata.num_draft_tokens):
        tokens = []
        for j in range(offset, offset + n):  # the rows vLLM reads: its target and bonus indices
            tokens.append(argmax[targets[j]])
            if drafts[j] != argmax[targets[j]]:
                break
        else:
            tokens.append(argmax[int(metadata.bonus_logits_indices[i])])
        out.append(tokens + [-1] * (width - len(tokens)))
        offset += n
    return SimpleNamespace(sampled_token_ids=torch.tensor(out, dtype=torch.int32))


def run_step(verifier, a_targets: list[int]):
    """Propose, schedule, attach, sample with one-hot targets: ``a_targets`` at a's root and nodes, [20, 21, 5]
    for b. Returns (the output's sampled tokens, the logits vLLM's sampler saw)."""
    verifier.propose([[9], [5]])
    verifier.attach(*schedule(verifier.runner, {"a": [10, 11, 12, 13, 14], "b": [20, 21]}))
    logits = one_hot_logits(a_targets + [20, 21, 5])
    seen = []

    def original(lg, metadata):
        seen.append(lg.clone())
        return vllm_greedy(lg, metadata)

    metadata = spec_metadata([[10, 11, 12, 13, 14], [20, 21]])
    output = verifier.sample(original, logits.clone(), metadata)
    assert len(seen) == 1 and torch.equal(seen[0], logits[metadata.bonus_logits_indices.long()])  # bonus rows only
    return output.sampled_token_ids.tolist()


CASES = {
    # a's targets at rows root, n0..n4 -> (row a in chain form, accepted nodes, KV slot moves, query-row moves)
    "n1 then n4": ([11, 12, 14, 0, 0, 7], [11, 14, 7, -1, -1, -1], [1, 4],
                   # positions 9 -> 8 and 12 -> 9: slots 5*4+1 -> 5*4+0 and 2*4+0 -> 5*4+1
                   ([21, 8], [20, 21]), ([2, 5], [1, 2])),
    "n0 then n3": ([10, 13, 0, 0, 4, 0], [10, 13, 4, -1, -1, -1], [0, 3],
                   ([23], [21]), ([4], [2])),  # n0 is in place; n3: position 11 -> 9
    "nothing": ([30, 0, 0, 0, 0, 0], [30, -1, -1, -1, -1, -1], [], None, None),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_sample_commits_the_longest_path_as_a_chain(case):
    targets, row_a, nodes, kv_moves, row_moves = CASES[case]
    verifier = make_verifier()
    sampled = run_step(verifier, targets)
    assert sampled == [row_a, [20, 21, 5, -1, -1, -1]]  # row b: vLLM's own chain result, untouched
    impl = verifier._layers[0].impl
    assert impl.moves == ([] if kv_moves is None else [kv_moves])
    if row_moves is None:
        assert verifier.last_moves is None
    else:
        assert tuple(m.tolist() for m in verifier.last_moves) == row_moves
    [result] = verifier.proposer.verified
    assert (result.req_id, result.accepted_nodes, result.bonus_token) == ("a", nodes, row_a[len(nodes)])
    assert result.target_logits is None
    assert verifier.stats == {"tree_steps": 1, "tree_rows": 1, "accepted": len(nodes)}
    assert verifier.batch is None and plan.current_batch() is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_sample_reads_half_precision_logits(dtype):
    targets, row_a, _, kv_moves, _ = CASES["n1 then n4"]
    verifier = make_verifier()
    verifier.propose([[9], [5]])
    verifier.attach(*schedule(verifier.runner, {"a": [10, 11, 12, 13, 14], "b": [20, 21]}))
    logits = one_hot_logits(targets + [20, 21, 5]).to(dtype)
    output = verifier.sample(vllm_greedy, logits, spec_metadata([[10, 11, 12, 13, 14], [20, 21]]))
    assert output.sampled_token_ids.tolist() == [row_a, [20, 21, 5, -1, -1, -1]]
    assert verifier._layers[0].impl.moves == [kv_moves]


def special_rows(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Logits with what argmax must get right: ties, signed zeros, infinities, NaNs, rows of -inf."""
    x = torch.from_numpy(rng.standard_normal((rows, vocab)).astype(np.float32))
    x[0] = x[0].round()  # ties: the first maximum wins
    x[1, ::2], x[1, 1::2] = -0.0, 0.0  # -0 == +0: the first of either
    x[2] = float("-inf")
    x[3, vocab // 2], x[3, vocab - 1] = float("nan"), float("nan")  # the first NaN wins
    x[4, 7 % vocab], x[4, max(vocab - 3, 0)] = float("inf"), float("inf")
    x[5] = -x[5].abs() - 1
    x[6] = float("nan")
    x[7, :vocab // 2] = -0.0
    x[7, vocab // 2:] = -1.0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 5, 64, 200, 4099])
def test_argmax_rows_is_torchs_argmax(dtype, vocab):
    rng = np.random.default_rng(vocab)
    logits = special_rows(rng, 12, vocab).to(dtype)
    index = np.array([3, 0, 11, 1, 2, 4, 5, 6, 7, 8, 3, 9, 10], np.int64)  # any order, repeats
    want = logits[torch.from_numpy(index)].argmax(dim=-1).numpy()
    assert argmax_rows(logits, index).tolist() == want.tolist()
    argmax, tree_logits = read_logits(logits, index, full=True)
    assert argmax.tolist() == want.tolist() and tree_logits.dtype == torch.float32
    assert read_logits(logits, index, full=False)[0].tolist() == want.tolist()


def test_argmax_rows_of_strided_logits_takes_torchs_path():
    logits = special_rows(np.random.default_rng(0), 12, 40)
    columns = logits.t().contiguous().t()  # rows not contiguous
    index = np.arange(12, dtype=np.int64)[::-1].copy()
    assert argmax_rows(columns, index).tolist() == logits[torch.from_numpy(index)].argmax(dim=-1).tolist()
    sliced = logits[:, 3:30]  # rows contiguous, strided between rows: read in place
    assert argmax_rows(sliced, index).tolist() == sliced[torch.from_numpy(index)].argmax(dim=-1).tolist()


def test_chainize_moves_hidden_rows_of_the_accepted_path():
    verifier = make_verifier()
    run_step(verifier, CASES["n1 then n4"][0])
    hidden = torch.arange(9, dtype=torch.float32)[:, None].repeat(1, 2)
    aux = torch.arange(9) * 10
    verifier.chainize_rows([hidden, None, aux])
    # rows 1, 2 (chain positions of the path) get rows 2, 5 (n1, n4): gathered before writing
    assert hidden[:, 0].tolist() == [0, 2, 5, 3, 4, 5, 6, 7, 8]
    assert aux.tolist() == [0, 20, 50, 30, 40, 50, 60, 70, 80]
    assert verifier.last_moves is None


def test_proposer_gets_target_logits_when_it_asks():
    verifier = make_verifier(proposer=FakeProposer({"a": T, "b": CHAIN_B}, wants_target_logits=True))
    targets = CASES["n1 then n4"][0]
    run_step(verifier, targets)
    [result] = verifier.proposer.verified
    assert torch.equal(result.target_logits, one_hot_logits(targets))  # rows root, n0..n4 of a only


def test_proposer_gets_the_targets_top_k_when_it_asks():
    proposer = FakeProposer({"a": T, "b": CHAIN_B})
    proposer.wants_target_topk = 2
    verifier = make_verifier(proposer=proposer)
    targets = CASES["n1 then n4"][0]
    run_step(verifier, targets)
    [result] = verifier.proposer.verified
    ids, probs = result.target_topk
    assert result.target_logits is None and ids.shape == (6, 2)  # rows root, n0..n4 of a only
    assert ids[:, 0].tolist() == targets
    rows = one_hot_logits(targets)
    np.testing.assert_allclose(probs[:, 0], torch.softmax(rows, -1).max(-1).values.numpy(), rtol=1e-5)


def test_greedy_chains_are_accepted_by_the_verifier_as_vllm_would():
    """A step whose drafts are greedy chains only (b): vLLM's plain sampler samples each request's bonus row, the
    verifier accepts the chain by argmax, giving what vLLM's greedy rejection sampler gives; no tree step is
    counted."""
    seen = []
    for b_targets, want in (([20, 21, 5], [20, 21, 5]), ([20, 8, 5], [20, 8]), ([3, 21, 5], [3])):
        verifier = make_verifier(trees={"b": CHAIN_B})
        verifier.propose([[9], [5]])
        verifier.attach(*schedule(verifier.runner, {"b": [20, 21]}))
        metadata = spec_metadata([[], [20, 21]])
        logits = one_hot_logits([0] + b_targets)
        output = verifier.sample(lambda lg, md: seen.append(md) or vllm_greedy(lg, md), logits, metadata)
        assert output.sampled_token_ids.tolist() == vllm_greedy(logits, metadata).sampled_token_ids.tolist()
        assert output.sampled_token_ids[1].tolist() == want + [-1] * (3 - len(want))
        assert seen[-1] is None and verifier.stats["tree_steps"] == 0


def test_a_step_without_drafts_takes_vllms_plain_sampler():
    """vLLM hands every step of a speculative engine spec-decode metadata; with no draft in the step, the verifier
    passes none on, so vLLM samples as without speculation instead of running its rejection sampler."""
    verifier = make_verifier(trees={})
    verifier.propose([[9], [5]])
    verifier.attach(*schedule(verifier.runner, {}))
    seen = []
    output = sampler_output()
    assert verifier.sample(lambda lg, md: seen.append(md) or output, one_hot_logits([0] * 2),
                           SimpleNamespace(num_draft_tokens=[0, 0])) is output
    assert seen == [None]


def penalised_b() -> FakeRequest:
    return FakeRequest("b", [1, 2, 3, 4, 5], [1, 4], SamplingParams(temperature=0.0, repetition_penalty=1.2))


def test_steps_vllm_must_verify_give_vllm_every_draft():
    """A chain whose request samples, or has penalties, is verified by vLLM's rejection sampler, and so is every
    draft of a step where any request has penalties or asks for logprobs."""
    seen = []
    record = lambda lg, md: seen.append(md) or vllm_greedy(lg, md)  # noqa: E731
    for b in (request_b_sampling(), penalised_b()):
        verifier = make_verifier([request_a(), b])
        verifier.propose([[9], [5]])
        verifier.attach(*schedule(verifier.runner, {"a": [10, 11, 12, 13, 14], "b": [20, 21]}))
        metadata = spec_metadata([[10, 11, 12, 13, 14], [20, 21]])
        verifier.sample(record, one_hot_logits([0] * 9), metadata)
        assert seen[-1] is metadata
        verifier = make_verifier([request_a(), b], trees={"b": CHAIN_B})  # chains only
        verifier.propose([[9], [5]])
        verifier.attach(*schedule(verifier.runner, {"b": [20, 21]}))
        metadata = spec_metadata([[], [20, 21]])
        verifier.sample(record, one_hot_logits([0] * 4), metadata)
        assert seen[-1] is metadata
    # a request without drafts whose parameters vLLM applies to every draft row of the step (its penalties count
    # the other requests' drafts): vLLM verifies the step
    for b in (penalised_b(), FakeRequest("b", [1, 2, 3, 4, 5], [1, 4], SamplingParams(temperature=0.0, logprobs=1))):
        verifier = make_verifier([request_a(), b], trees={"a": T})
        verifier.propose([[9], [5]])
        verifier.attach(*schedule(verifier.runner, {"a": [10, 11, 12, 13, 14]}))
        metadata = spec_metadata([[10, 11, 12, 13, 14], []])
        verifier.sample(record, one_hot_logits([0] * 7), metadata)
        assert seen[-1] is metadata


def request_b_sampling() -> FakeRequest:
    return FakeRequest("b", [1, 2, 3, 4, 5], [1, 4], SamplingParams(temperature=0.8))


@pytest.fixture
def cpu_expand_fix():
    """vLLM 0.32's CPU expand kernel leaves float outputs uninitialised; the engine runs with our fix applied."""
    from vllm.v1.sample import rejection_sampler as rs

    from vllm_treespec.patches import ORIGINALS, is_patched
    from vllm_treespec.patches import rejection_sampler

    applied_here = not is_patched(rs, "expand_batch_to_tokens")
    rejection_sampler.apply()
    yield
    if applied_here and is_patched(rs, "expand_batch_to_tokens"):
        rs.expand_batch_to_tokens = ORIGINALS.pop((rs, "expand_batch_to_tokens"))


def random_metadata(temperatures: list[float]):
    return SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.tensor(temperatures),
                           top_k=None, top_p=None)


@pytest.mark.parametrize("case", CASES)
def test_random_sample_with_one_hot_targets_commits_the_same_path(case, cpu_expand_fix):
    """Lossless sampling puts all mass where the target does: one-hot targets give the greedy outcome."""
    targets, row_a, nodes, kv_moves, _ = CASES[case]
    verifier = make_verifier([request_a(temperature=1.0), request_b()])
    verifier.runner.input_batch.sampling_metadata = random_metadata([1.0, 1.0])
    assert run_step(verifier, targets) == [row_a, [20, 21, 5, -1, -1, -1]]
    assert verifier._layers[0].impl.moves == ([] if kv_moves is None else [kv_moves])
    [result] = verifier.proposer.verified
    assert (result.accepted_nodes, result.bonus_token) == (nodes, row_a[len(nodes)])


def test_lossless_sampling_applies_the_request_temperature(cpu_expand_fix):
    """Root children 10 and 11 with logits 0 and ln(3)/2: at temperature 0.5 the target is p(10) = 1/4,
    p(11) = 3/4 (at 1.0 it would be 0.37 / 0.63), and the first committed token follows it."""
    from scipy.stats import chisquare

    tree = DraftTree(np.array([10, 11]), np.array([-1, -1], np.int32))
    batch = TreeBatch.build([1], ["b"], [tree], [3], [4])  # batch row 1 (row 0 is a chain request)
    index, row_offsets, widths = logits_rows(batch, [2, 2])
    assert index.tolist() == [3, 4, 5] and row_offsets.tolist() == [0] and widths.tolist() == [3]
    tree_logits = one_hot_logits([10, 0, 0])
    tree_logits[0, 11] = float(np.log(3) / 2)
    metadata = random_metadata([1.0, 0.5])
    torch.manual_seed(0)
    counts = {10: 0, 11: 0}
    draws = 600  # 0.75 vs 0.63 is 6 standard deviations apart
    for _ in range(draws):
        out_tokens, out_nodes, out_len = accept(batch, row_offsets, widths, np.zeros(3, np.int64), 2,
                                                np.array([False]), tree_logits, metadata, 2)
        counts[int(out_tokens[0, 0])] += 1
        assert out_len[0] == 1 and out_tokens[0, 1] == 0  # a child is always accepted; its row's target is token 0
    assert chisquare([counts[10], counts[11]], [draws / 4, 3 * draws / 4]).pvalue > 0.01


# --- compaction moves, two requests -----------------------------------------------------------------------------------

def test_accepted_moves_and_slots_of_two_tree_requests():
    trees = [T, DraftTree(np.array([40, 41, 42]), np.array([-1, -1, 1], np.int32))]
    batch = TreeBatch.build([0, 2], ["a", "c"], trees, [0, 9], [7, 2])
    out_nodes = np.array([[1, 4, -1, -1, -1], [1, 2, -1, -1, -1]])
    moves = accepted_moves(batch, out_nodes, np.array([2, 2]))
    assert moves.rows.tolist() == [0, 0, 2, 2]
    # a: positions 8 + [1, 4] -> 8 + [0, 1]; c: 3 + [1, 2] -> 3 + [0, 1]
    assert moves.src_positions.tolist() == [9, 12, 4, 5] and moves.dst_positions.tolist() == [8, 9, 3, 4]
    assert moves.src_query_rows.tolist() == [2, 5, 11, 12] and moves.dst_query_rows.tolist() == [1, 2, 10, 11]
    table = np.array([[3, 0, 5, 2], [0, 0, 0, 0], [6, 1, 0, 0]])
    assert slots(table, 4, moves.rows, moves.src_positions).tolist() == [21, 8, 4, 5]
    assert slots(table, 4, moves.rows, moves.dst_positions).tolist() == [20, 21, 27, 4]
    assert accepted_moves(batch, np.array([[0, 2, -1, -1, -1], [0, -1, -1, -1, -1]]), np.array([1, 1])) is None


def test_accepted_moves_equal_a_walk_of_each_path():
    """Moves request by request, k ascending, nodes in place skipped; random trees and acceptances."""
    from proposers_helpers import random_tree

    from vllm_treespec.tree import greedy_accept

    rng = np.random.default_rng(3)
    moved_steps = 0
    for _ in range(100):
        trees = [random_tree(rng, int(rng.integers(1, 10)), vocab=3) for _ in range(int(rng.integers(1, 5)))]
        rows = np.sort(rng.choice(9, len(trees), replace=False))
        starts = np.cumsum([2] + [t.num_nodes + 1 for t in trees])[:-1]
        batch = TreeBatch.build(rows, [str(r) for r in rows], trees, starts, rng.integers(0, 200, len(trees)))
        widths = np.diff(batch.node_offsets) + 1
        _, out_nodes, out_len = greedy_accept(batch.tokens, batch.parents, batch.depth, batch.node_offsets,
                                              np.cumsum(widths) - widths, rng.integers(0, 3, widths.sum()), 10)
        want = [[], [], [], [], []]
        for r in range(len(trees)):
            for k, node in enumerate(out_nodes[r, :out_len[r]].tolist()):
                if node != k:
                    base, first = batch.context_len[r] + 1, batch.query_start[r] + 1
                    for column, value in zip(want, (rows[r], base + node, base + k, first + node, first + k)):
                        column.append(value)
        moves = accepted_moves(batch, out_nodes, out_len)
        if not want[0]:
            assert moves is None
            continue
        moved_steps += 1
        got = [moves.rows, moves.src_positions, moves.dst_positions, moves.src_query_rows, moves.dst_query_rows]
        assert [g.tolist() for g in got] == want
    assert moved_steps > 20


# --- hidden states for the proposer, finished requests ----------------------------------------------------------------

class HiddenStateProposer(FakeProposer):
    needs_hidden_states = True
    aux_hidden_state_layers = (5, 2)


def test_proposer_gets_the_committed_hidden_rows_and_aux_layers_in_its_order():
    verifier = make_verifier(proposer=HiddenStateProposer({"a": T}))
    hidden = torch.zeros(9, 4)
    aux_ascending = [torch.full((9, 4), 2.0), torch.full((9, 4), 5.0)]  # layers 2 and 5, in forward order
    # a accepted 2 of its 5 drafts (+ bonus), b 1 of its 2
    verifier.propose([[11, 14, 7], [20, 6]], hidden, aux_ascending, np.array([0, 6, 9]),
                     {"a": [10, 11, 12, 13, 14], "b": [20, 21]})
    ctx = verifier.proposer.contexts[0]
    assert ctx.hidden_states is hidden
    assert [t[0, 0].item() for t in ctx.aux_hidden_states] == [5.0, 2.0]
    assert ctx.hidden_row_start.tolist() == [0, 6]
    assert ctx.hidden_row_index.tolist() == [2, 7]  # 5 - (5 - 2), 8 - (2 - 1)
    assert ctx.hidden_position_start.tolist() == [7, 4]


def test_finished_drops_pending_trees_and_tells_the_proposer():
    verifier = proposed(make_verifier())
    verifier.finished(set())
    assert verifier.proposer.finished == []
    verifier.finished({"a"})
    assert verifier.pending == {} and verifier.proposer.finished == [{"a"}]


# --- vLLM's rejection sampler on a step whose only drafts are trees ----------------------------------------------------

def spec_metadata(drafts: list[list[int]]):
    """vLLM's SpecDecodeMetadata of a step with these drafts, its logits rows laid out as vLLM lays them out."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    sampled = np.array([len(d) + 1 for d in drafts])
    start = np.cumsum(sampled) - sampled
    metadata.bonus_logits_indices = torch.from_numpy((start + sampled - 1).astype(np.int32))
    metadata.target_logits_indices = torch.from_numpy(np.concatenate(
        [np.arange(s, s + len(d)) for s, d in zip(start, drafts)]).astype(np.int32))
    metadata.logits_indices = torch.arange(int(sampled.sum()), dtype=torch.int32)
    return metadata


def greedy_sampling_metadata(num_reqs: int, max_num_logprobs: int | None = None):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=max_num_logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(num_reqs), presence_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs), output_token_ids=[[] for _ in range(num_reqs)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def test_a_step_whose_drafts_are_all_trees_asks_vllms_plain_sampler_for_each_requests_bonus_row():
    """Every drafted request is a tree request: vLLM's plain sampler gets each request's bonus row, its tokens are
    widened to the step's width, and the tree rows are written over that as before."""
    targets, row_a, _, _, _ = CASES["n1 then n4"]
    verifier = make_verifier(trees={"a": T})
    verifier.propose([[9], [5]])
    verifier.attach(*schedule(verifier.runner, {"a": [10, 11, 12, 13, 14]}))
    metadata = spec_metadata([[10, 11, 12, 13, 14], []])
    seen = []

    def original(lg, md):
        seen.append((lg.clone(), md))
        return SimpleNamespace(sampled_token_ids=torch.tensor([[30], [7]]))

    logits = one_hot_logits(targets + [7])
    output = verifier.sample(original, logits, metadata)
    [(asked_logits, asked_metadata)] = seen
    assert asked_metadata is None and torch.equal(asked_logits, logits[[5, 6]])
    assert output.sampled_token_ids.tolist() == [row_a, [7, -1, -1, -1, -1, -1]]


@pytest.fixture
def cpu_kernels(cpu_expand_fix):
    """vLLM's C++ stand-ins for its Triton kernels, as a CPU worker registers them (once per process)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from vllm_treespec.patches import triton_dispatcher

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU kernels")
    triton_dispatcher.apply()  # numba is imported: vLLM's scan needs the plugin's fix
    if "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel" not in dispatcher._registry:
        current_platform.register_triton_kernel_overrides()


def test_bonus_rows_sample_as_vllms_rejection_sampler_samples_a_step_without_drafts(cpu_kernels):
    """:func:`sample_bonus_rows` (vLLM's plain sampler on each request's bonus row) gives what vLLM's rejection
    sampler gives when it verifies no draft: each bonus row's token in column 0, the rest placeholders, at the width
    of the step with drafts."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    from vllm_treespec.verify.accept import sample_bonus_rows

    drafts = [[3, 4, 5], [], [6]]
    metadata = spec_metadata(drafts)
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(0))
    sampling = greedy_sampling_metadata(3)
    out = sample_bonus_rows(lambda lg, md: Sampler()(lg, sampling), logits, metadata)
    bonus_logits = logits[metadata.bonus_logits_indices.long()]
    vllms = RejectionSampler(Sampler())(spec_metadata([[], [], []]), None, bonus_logits.clone(), sampling)
    assert out.sampled_token_ids.shape == (3, 4) and out.sampled_token_ids.dtype == torch.int32
    assert out.sampled_token_ids[:, :1].tolist() == vllms.sampled_token_ids.tolist()
    assert out.sampled_token_ids[:, 0].tolist() == bonus_logits.argmax(dim=-1).tolist()
    assert (out.sampled_token_ids[:, 1:] == -1).all() and out.logprobs_tensors is None


def test_a_proposer_that_asks_gets_the_finishing_requests_outputs_before_they_finish():
    verifier = make_verifier([request_a(), FakeRequest("b", [1, 2, 3, 4, 5], [1, 4], prompt_len=2)])
    verifier.proposer.wants_finished_outputs = True
    calls = []
    verifier.proposer.on_outputs_finished = lambda outputs: calls.append(
        ({r: t.tolist() for r, t in outputs.items()}, list(verifier.proposer.finished)))
    verifier.finished({"b", "gone"})  # "gone" has left the batch already: no output to give
    assert calls == [({"b": [3, 4, 5]}, [])]  # every token after the prompt, before on_requests_finished
    assert verifier.proposer.finished == [{"b", "gone"}]


def test_shutdown_lets_the_proposer_save_and_survives_its_failure(caplog):
    verifier = make_verifier()
    calls = []
    verifier.proposer.on_shutdown = lambda: calls.append("saved")
    verifier.shutdown()
    assert calls == ["saved"]

    def failing():
        raise OSError("disk gone")

    verifier.proposer.on_shutdown = failing
    with caplog.at_level(logging.WARNING, logger="vllm.treespec"):
        verifier.shutdown()  # vLLM's own shutdown must go on
    assert "FakeProposer's shutdown failed: OSError: disk gone" in caplog.text
