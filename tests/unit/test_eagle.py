"""EAGLE-3 head: checkpoint format, and the proposer's incremental drafting equals the trainer's unrolled forward."""

from __future__ import annotations

import copy
import json
import time

import numpy as np
import pytest
import torch

from eagle_helpers import (HIDDEN, VOCAB, check_chain_matches_unrolled_forward, draft_context,
                           drafter_on_random_sequence, small_head)
from vllm_treespec.api import ProposeContext
from vllm_treespec.eagle.drafter import EagleDrafter, _contiguous_runs
from vllm_treespec.eagle.model import Eagle3Head
from vllm_treespec.proposers.eagle_tree import EagleTreeOptions


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_checkpoint_is_vllm_eagle3_format(tmp_path, norm_before_fc):
    head, path = small_head(tmp_path, norm_before_fc=norm_before_fc)
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 120 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "head" / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names
    assert not any(n.startswith("embed") for n in names)  # shared with the target, as vLLM expects
    assert ("input_norm.weight" in names) == norm_before_fc == cfg["eagle_config"]["norm_before_fc"]
    loaded = Eagle3Head.load(path, embed=head.embed.weight)
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_bad_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="checkpoint"):
        EagleTreeOptions(checkpoint=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        EagleTreeOptions(checkpoint=str(tmp_path / "empty"))
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an EAGLE-3 head"):
        Eagle3Head.load(tmp_path / "empty", embed=torch.zeros(4, 4))
    with pytest.raises(ValueError, match="depth"):
        EagleTreeOptions(depth=0)


@pytest.mark.parametrize("chunks,norm_before_fc", [((40,), False), ((17, 30, 35, 40), True)])
def test_incremental_drafting_matches_unrolled_training_forward(tmp_path, chunks, norm_before_fc):
    """Draft a top-1 chain after ingesting the context in steps; it must equal the trainer's unrolled forward. This
    pins positions, the shared-embedding input shift, the per-request KV and the tree mask to what training
    optimises."""
    head, path = small_head(tmp_path, norm_before_fc=norm_before_fc)
    check_chain_matches_unrolled_forward(head, path, chunks)


def _ingested_drafter(tmp_path, seed: int, depth: int, top_k: int):
    """A drafter on a random head that has ingested 30 random context rows, and the context to draft from."""
    head, path = small_head(tmp_path, seed=seed)
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, VOCAB, size=40)
    aux = torch.randn(40, 3, HIDDEN)
    drafter = EagleDrafter(path, depth=depth, top_k=top_k)
    drafter.load(head.embed.weight)
    ctx = draft_context(seq, aux, 0, 30, sampled=[int(seq[30])])
    drafter.ingest(ctx)
    return drafter, ctx


def sharpen(drafter, factor: float = 4.0) -> None:
    """Scale the head's LM head; its layers' GEMMs are packed at load, so route them again."""
    from vllm_treespec.eagle.cpu_gemm import use_vllm_cpu_gemm

    with torch.no_grad():
        drafter.head.lm_head.weight.mul_(factor)
    use_vllm_cpu_gemm(drafter.head)


def _path_log_scores(tree) -> np.ndarray:
    """Cumulative draft log-probability of every node's path."""
    scores = np.zeros(tree.num_nodes)
    for i in range(tree.num_nodes):
        p = tree.parents[i]
        scores[i] = np.log(tree.node_probs[i]) + (scores[p] if p >= 0 else 0.0)
    return scores


def test_tree_is_reranked_best_first_and_closed_under_parents(tmp_path):
    drafter, ctx = _ingested_drafter(tmp_path, seed=1, depth=5, top_k=4)
    tree = drafter.draft(ctx, [0], budget=20)[0]
    assert tree.num_nodes == 20
    parents = tree.parents
    assert np.all(parents < np.arange(20))
    path_scores = _path_log_scores(tree)
    # every node not kept (depth <= 5) scores at most the worst kept node: checked through a bigger budget
    big_scores = _path_log_scores(drafter.draft(ctx, [0], budget=200)[0])
    assert np.sort(big_scores)[::-1][:20] == pytest.approx(np.sort(path_scores)[::-1], rel=1e-5)
    assert len(set(tree.token_ids[parents == -1].tolist())) == int((parents == -1).sum())


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 7])
def test_small_budget_grows_less_and_keeps_the_same_tree(tmp_path, budget):
    """A budget below depth or top_k caps the expansion (fewer levels, narrower frontier); the tree must be exactly
    the best ``budget`` nodes of the full expansion, as when every level was grown."""
    drafter, ctx = _ingested_drafter(tmp_path, seed=2, depth=6, top_k=8)
    full = drafter.draft(ctx, [0], budget=6 * 8 + 8)[0]
    small = drafter.draft(ctx, [0], budget=budget)[0]
    scores = _path_log_scores(full)
    kept = np.sort(np.argsort(-scores, kind="stable")[:budget])
    remap = {int(old): new for new, old in enumerate(kept)}
    assert small.token_ids.tolist() == full.token_ids[kept].tolist()
    assert small.parents.tolist() == [-1 if p < 0 else remap[int(p)] for p in full.parents[kept]]
    assert small.node_probs == pytest.approx(full.node_probs[kept], rel=1e-5)


def test_release_and_cache_bound(tmp_path):
    head, path = small_head(tmp_path)
    drafter = EagleDrafter(path, depth=2, top_k=2, max_cached_requests=3)
    drafter.load(head.embed.weight)
    seq = np.arange(20) % VOCAB
    aux = torch.randn(20, 3, HIDDEN)
    for r in range(5):
        ctx = draft_context(seq, aux, 0, 10, sampled=[int(seq[10])])
        ctx.req_ids = [f"req{r}"]
        drafter.ingest(ctx)
    assert len(drafter.states) == 3 and "req4" in drafter.states and "req0" not in drafter.states
    drafter.release({"req4"})
    assert "req4" not in drafter.states


@pytest.mark.parametrize("seed", [3, 4])
def test_frontier_pruning_keeps_the_same_tree_and_drafts_fewer_rows(tmp_path, seed):
    """Nodes scoring below the budget-th best node so far are not expanded (their descendants score lower still):
    the trees must be identical to growing every level in full, with fewer head rows drafted."""
    drafter, ctx = _ingested_drafter(tmp_path, seed=seed, depth=6, top_k=8)
    sharpen(drafter)  # peaky drafts, as a trained head's: the case pruning is for
    saved = 0
    for budget in (4, 10, 16, 40):
        trees, rows = [], []
        for prune in (False, True):
            drafter.prune_frontier = prune
            drafter.expanded_rows = 0
            trees.append(drafter.draft(ctx, [0], budget=budget)[0])
            rows.append(drafter.expanded_rows)
        full, pruned = trees
        assert pruned.token_ids.tolist() == full.token_ids.tolist(), budget
        assert pruned.parents.tolist() == full.parents.tolist(), budget
        # fewer rows per head call may round differently (GEMM blocking), hence approx
        assert pruned.node_probs == pytest.approx(full.node_probs, rel=1e-5), budget
        assert rows[1] <= rows[0]
        saved += rows[0] - rows[1]
    assert saved > 0


def test_checkpoint_stop_ends_expansion_where_the_best_path_is_unlikely(tmp_path):
    """graft's checkpoints reach the drafter: below the threshold at depth d the request's tree stops at depth d (no
    head rows drafted past it); a threshold no path falls below changes nothing."""
    drafter, ctx = _ingested_drafter(tmp_path, seed=5, depth=6, top_k=4)
    sharpen(drafter)  # confident enough that the full tree goes deeper than 2
    drafter.expanded_rows = 0
    full = drafter.draft(ctx, [0], budget=16)[0]
    full_rows, drafter.expanded_rows = drafter.expanded_rows, 0
    assert full.depths().max() > 2
    same = drafter.draft(ctx, [0], budget=16, stop_below={2: 0.0, 4: 0.0})[0]
    assert same.token_ids.tolist() == full.token_ids.tolist() and same.parents.tolist() == full.parents.tolist()
    assert drafter.expanded_rows == full_rows
    drafter.expanded_rows = 0
    stopped = drafter.draft(ctx, [0], budget=16, stop_below={2: 1.0})[0]
    assert drafter.expanded_rows == 4  # one level of expansion (depth 2) instead of five
    # kept: the best depth-2 path and every node at least as likely; the rest of the budget is left to the caller
    scores = _path_log_scores(stopped)
    best_depth2 = scores[stopped.depths() == 2].max()
    assert stopped.depths().max() == 2 and (stopped.depths() == 2).sum() == 1
    assert np.all(scores >= best_depth2 - 1e-6) and stopped.num_nodes < 16
    root_only = drafter.draft(ctx, [0], budget=16, stop_below={1: 1.0})[0]
    assert root_only.num_nodes == 1 and root_only.token_ids[0] == full.token_ids[np.argmax(_path_log_scores(full))]


@pytest.mark.parametrize("floor", [0.02, 0.1, 0.3])
def test_confidence_floor_keeps_exactly_the_likely_nodes_and_expands_fewer_rows(tmp_path, floor):
    """``min_confidence``: the tree must be the unfloored tree's nodes whose path probability is at least the floor
    (closed under parents, same order), with no head rows spent expanding nodes below it."""
    drafter, ctx = _ingested_drafter(tmp_path, seed=6, depth=6, top_k=8)
    sharpen(drafter)  # peaky, so the floor cuts inside the tree, not at its root
    drafter.expanded_rows = 0
    full = drafter.draft(ctx, [0], budget=24)[0]
    full_rows, drafter.expanded_rows = drafter.expanded_rows, 0
    floored = drafter.draft(ctx, [0], budget=24, min_confidence=floor)[0]
    scores = _path_log_scores(full)
    kept = np.flatnonzero(scores >= np.log(floor))
    assert 0 < kept.size < full.num_nodes, "the floor should cut this tree"
    remap = {int(old): new for new, old in enumerate(kept)}
    assert floored.token_ids.tolist() == full.token_ids[kept].tolist()
    assert floored.parents.tolist() == [-1 if p < 0 else remap[int(p)] for p in full.parents[kept]]
    # same nodes, but the head ran them in batches of other sizes: fp32 GEMM rounding differs by batch shape (seen
    # here: 1.4e-5 relative on one node of 21, on this machine's CPU, at the commit before this test changed too)
    assert floored.node_probs == pytest.approx(full.node_probs[kept], rel=1e-4)
    assert drafter.expanded_rows < full_rows
    _, path = small_head(tmp_path / "options")
    with pytest.raises(ValueError, match="min_node_confidence.*0 fills the budget"):
        EagleTreeOptions(checkpoint=path, min_node_confidence=1.0)
    assert EagleTreeOptions(checkpoint=path, min_node_confidence=0.0).min_node_confidence == 0.0


def test_the_heads_linear_layers_run_through_vllms_cpu_gemm(tmp_path):
    """The loaded head's linear layers go through vLLM's CPU GEMM dispatch (what vLLM runs the target's through),
    with the same results as torch's up to summation order, for 1-row and multi-row, 2-D and 3-D inputs."""
    from vllm_treespec.eagle.cpu_gemm import use_vllm_cpu_gemm

    head, path = small_head(tmp_path)
    drafter = EagleDrafter(path, depth=2, top_k=2)
    drafter.load(head.embed.weight)
    linears = [m for m in drafter.head.modules() if type(m) is torch.nn.Linear]
    assert linears and all(hasattr(m, "cpu_linear") for m in linears)
    reference = Eagle3Head.load(path, embed=head.embed.weight)
    for (name, routed), (_, plain) in zip(drafter.head.named_modules(), reference.named_modules()):
        if type(plain) is not torch.nn.Linear:
            continue
        for shape in [(1, plain.in_features), (5, plain.in_features), (2, 3, plain.in_features)]:
            x = torch.randn(*shape)
            torch.testing.assert_close(routed(x), plain(x), rtol=1e-5, atol=1e-5, msg=name)
    assert use_vllm_cpu_gemm(torch.nn.Sequential(torch.nn.ReLU())) == 0  # nothing to route


@pytest.mark.parametrize("faster", ["bfloat16", "float32"])
def test_fastest_dtype_keeps_the_head_whose_layers_time_faster(tmp_path, monkeypatch, faster):
    """``dtype: "fastest"`` loads the head in bf16 and fp32, times each one's linear layers at a level's rows, and
    keeps the faster one (bf16 where the CPU has a bf16 GEMM, fp32 where vLLM falls back to torch's: AVX2)."""
    from vllm_treespec.eagle import drafter as drafter_module

    head, path = small_head(tmp_path)
    timed_rows = []

    def linear_seconds(module, rows):
        timed_rows.append(rows)
        dtype = next(m for m in module.modules() if type(m) is torch.nn.Linear).weight.dtype
        return 1.0 if str(dtype).removeprefix("torch.") == faster else 3.0

    monkeypatch.setattr(drafter_module, "linear_seconds", linear_seconds)
    drafter = EagleDrafter(path, depth=2, top_k=3, dtype="fastest")
    drafter.load(head.embed.weight)
    assert drafter.compute == faster and drafter.dtype == getattr(torch, faster) and timed_rows == [3, 3]
    assert all(m.weight.dtype == drafter.dtype for m in drafter.head.modules() if type(m) is torch.nn.Linear)
    ctx = draft_context(np.arange(40) % VOCAB, torch.randn(40, 3, HIDDEN), 0, 30, sampled=[7])
    drafter.ingest(ctx)  # it drafts in the chosen dtype
    assert drafter.draft(ctx, [0], 6)[0].num_nodes > 0


def test_int8_head_drafts_close_to_the_fp32_head(tmp_path):
    """``dtype: "int8"``: every linear layer of the head multiplies with int8 weights (fp32 activations and cache), and
    the drafted tree's nodes are mostly those of the fp32 head (the drafts only steer; verification stays exact)."""
    head, path = small_head(tmp_path)
    trees = {}
    for mode in ("float32", "int8"):
        drafter = EagleDrafter(path, depth=3, top_k=4, dtype=mode)
        drafter.load(head.embed.weight)
        assert drafter.compute == mode and drafter.dtype == torch.float32
        linears = [m for m in drafter.head.modules() if type(m) is torch.nn.Linear]
        assert linears and all(hasattr(m, "int8_weight") == (mode == "int8") for m in linears)
        torch.manual_seed(0)
        ctx = draft_context(np.arange(40) % VOCAB, torch.randn(40, 3, HIDDEN), 0, 30, sampled=[7])
        drafter.ingest(ctx)
        trees[mode] = drafter.draft(ctx, [0], 12)[0]
    ref, got = trees["float32"], trees["int8"]
    assert got.num_nodes == ref.num_nodes
    paths = [{tuple(t.token_ids[t.path_to(j)].tolist()) for j in range(t.num_nodes)} for t in (ref, got)]
    assert len(paths[0] & paths[1]) >= ref.num_nodes // 2  # 9 of 12 on the development CPU


def test_int8_weights_stay_close_to_the_float_layers():
    """int8 weights (one scale per output row) with inputs quantized per call: each layer's output within a few
    percent of the fp32 layer's; the layer keeps its dtype and shapes, and leaves the float weight as it was."""
    from vllm_treespec.eagle.cpu_gemm import use_int8_weights

    torch.manual_seed(0)
    float_layers = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.Linear(200, 64, bias=True))
    quantized = copy.deepcopy(float_layers)
    assert use_int8_weights(quantized) == 2
    assert torch.equal(quantized[0].weight, float_layers[0].weight)
    for shape in [(1, 96), (7, 96), (2, 3, 96)]:
        x = torch.randn(*shape)
        with torch.inference_mode():
            want, got = float_layers[0](x), quantized[0](x)
            assert got.shape == want.shape and got.dtype == torch.float32
            assert float((got - want).norm() / want.norm()) < 0.03
            h = torch.randn(*shape[:-1], 200)
            assert float((quantized[1](h) - float_layers[1](h)).norm() / float_layers[1](h).norm()) < 0.03
    assert use_int8_weights(torch.nn.Sequential(torch.nn.ReLU())) == 0


def test_linear_seconds_times_every_linear_layer(tmp_path):
    from vllm_treespec.eagle.cpu_gemm import linear_seconds

    one = torch.nn.Sequential(torch.nn.Linear(64, 256))
    two = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4096))
    assert 0 < linear_seconds(one, rows=4) < linear_seconds(two, rows=4)


@pytest.mark.parametrize("deferred_rows", [256, 1])
def test_observed_steps_keep_the_cache_whole(tmp_path, monkeypatch, deferred_rows):
    """Steps the budget does not draft only observe (their rows' K/V are written at the next ingest, or once
    ``deferred_rows`` rows wait; no output computed): drafting afterwards must give exactly the trees of a drafter
    that ingested every step, and differ from one that skipped them (a masked hole)."""
    monkeypatch.setattr("vllm_treespec.eagle.drafter.DEFERRED_ROWS", deferred_rows)
    head, path = small_head(tmp_path, seed=7)
    rng = np.random.default_rng(7)
    seq = rng.integers(0, VOCAB, size=48)
    aux = torch.randn(48, 3, HIDDEN)
    spans = [(0, 12), (12, 13), (13, 14), (14, 20), (20, 30)]

    def drafted(feed_middle):
        drafter = EagleDrafter(path, depth=4, top_k=4)
        drafter.load(head.embed.weight)
        for j, (a, b) in enumerate(spans):
            ctx = draft_context(seq, aux, a, b, sampled=[int(seq[b])])
            if j in (0, len(spans) - 1):
                drafter.ingest(ctx)
            else:
                feed_middle(drafter, ctx)
        return drafter.draft(ctx, [0], budget=24)[0]

    def observe(drafter, ctx):
        drafter.observe(ctx)
        assert bool(drafter._deferred) == (deferred_rows > 1)  # a limit of one row writes at once

    every = drafted(lambda d, ctx: d.ingest(ctx))
    observed = drafted(observe)
    skipped = drafted(lambda d, ctx: None)
    assert observed.token_ids.tolist() == every.token_ids.tolist()
    assert observed.parents.tolist() == every.parents.tolist()
    assert observed.node_probs == pytest.approx(every.node_probs, rel=1e-5)
    assert not np.allclose(skipped.node_probs, every.node_probs, rtol=1e-3)  # the test can tell a hole
    if deferred_rows > 1:
        observed_drafter = []
        drafted(lambda d, ctx: (observed_drafter.append(d), d.observe(ctx)))
        assert observed_drafter[0]._deferred_rows == 0 and not observed_drafter[0]._deferred  # all written


def test_query_rows_leave_keys_and_values_unchanged(tmp_path):
    """Rows only written to the draft cache get keys and values but no query: q of the asked rows is the full q at
    those rows, k and v are unchanged, and asking for no row runs no query projection."""
    head, _ = small_head(tmp_path, seed=3)
    tokens = torch.randint(0, VOCAB, (9,))
    hidden = torch.randn(9, HIDDEN)
    positions = torch.arange(20, 29)
    with torch.inference_mode():
        q, k, v = head.layer_inputs(tokens, hidden, positions)
        some_q, some_k, some_v = head.layer_inputs(tokens, hidden, positions, torch.tensor([2, 8]))
        head.midlayer.self_attn.q_proj.forward = None  # calling it now fails
        no_q, no_k, no_v = head.layer_inputs(tokens, hidden, positions, torch.tensor([], dtype=torch.long))
    assert torch.allclose(some_q, q[[2, 8]], atol=1e-6) and some_q.shape == (2, *q.shape[1:])
    assert no_q.shape == (0, *q.shape[1:])
    for kk, vv in ((some_k, some_v), (no_k, no_v)):
        assert torch.equal(kk, k) and torch.equal(vv, v)


def test_deferred_segments_are_written_in_contiguous_runs():
    """A request's segments whose positions follow on are one write; a gap (rows never seen) or another request
    starts a new one."""
    def piece(row, start, n):
        return row, None, None, np.arange(start, start + n)

    pieces = [piece(0, 10, 1), piece(0, 11, 3), piece(0, 20, 2), piece(1, 5, 1), piece(1, 6, 1), piece(0, 22, 1)]
    assert _contiguous_runs(pieces) == [(0, 10, 4), (0, 20, 2), (1, 5, 2), (0, 22, 1)]


@pytest.mark.parametrize("gap", [0, 2])
def test_a_batchs_committed_rows_are_cut_per_request_as_the_context_lays_them_out(gap):
    """``_segments`` gathers the whole batch at once: request i's rows ``hidden_row_start[i] .. hidden_row_index[i]``
    of every aux layer side by side, the tokens after them (``token_ids[i, p + 1]``) and their positions; a request
    without rows this step (start past index) gets no segment, and each segment is a copy the runner may overwrite.
    ``gap``: rows between the requests' committed rows (a verifying step's rejected drafts), so that the rows are
    gathered, not sliced."""
    counts = [1, 0, 5, 1, 3, 0]
    first_row = np.concatenate([[0], np.cumsum(np.array(counts) + gap)[:-1]])
    first_position = np.array([40, 7, 12, 99, 0, 3])
    rng = np.random.default_rng(3)
    token_ids = rng.integers(0, VOCAB, size=(len(counts), 128)).astype(np.int32)
    aux = [torch.randn(sum(counts) + gap * len(counts) + 2, HIDDEN) for _ in range(3)]
    ctx = ProposeContext(req_ids=[f"r{i}" for i in range(len(counts))], sampled_token_ids=[[1]] * len(counts),
                         num_tokens=first_position + np.array(counts) + 1, token_ids=token_ids, max_nodes=8,
                         aux_hidden_states=aux, hidden_row_index=first_row + np.array(counts) - 1,
                         hidden_row_start=first_row, hidden_position_start=first_position)
    drafter = EagleDrafter.__new__(EagleDrafter)
    drafter.aux_layers = (2, 15, 27)
    segments = drafter._segments(ctx)
    assert [segment[0] for segment in segments] == [0, 2, 3, 4]
    for i, rows, tokens, positions in segments:
        r0, n, p0 = int(first_row[i]), counts[i], int(first_position[i])
        assert torch.equal(rows, torch.cat([a[r0: r0 + n] for a in aux], -1))
        assert positions.tolist() == list(range(p0, p0 + n))
        assert tokens.dtype == np.int64 and tokens.tolist() == token_ids[i, p0 + 1: p0 + n + 1].tolist()
    kept = [segment[1].clone() for segment in segments]
    for a in aux:
        a.zero_()
    token_ids[:] = 0
    assert all(torch.equal(a, b[1]) for a, b in zip(kept, segments)) and segments[1][2].any()


def test_ingest_keeps_the_rows_of_requests_that_do_not_draft_until_they_do(tmp_path):
    """A row that does not draft this step (a partial prefill, or one a probe does not ask: ``ctx.draft_rows``) keeps
    its rows for later, as a step that only observes does; the step where it drafts writes them with its own, so its
    draft sees the whole context. Only rows that draft get a depth-1 output."""
    drafter, seq, aux = drafter_on_random_sequence(tmp_path, seed=5, length=40, depth=4, top_k=4)
    ctx = draft_context(seq, aux, 0, 20, sampled=[int(seq[20])])
    ctx.draft_rows = np.array([False])
    assert drafter.ingest(ctx) == []
    assert "r" not in drafter.states and drafter._deferred_rows == 20 and drafter.catch_up_seconds >= 0
    ctx = draft_context(seq, aux, 20, 30, sampled=[int(seq[30])])
    assert drafter.ingest(ctx) == [0]
    state = drafter.states["r"]
    assert state.length == 30 and bool(state.written[:30].all()) and state.last_normed is not None
    assert drafter._deferred_rows == 0 and 0 < drafter.catch_up_seconds


def test_a_prompts_rows_are_written_once_and_not_priced_as_the_heads_call(tmp_path):
    """The call after a prefill writes the prompt's rows (all but the committed token's are the prompt's): one-time
    work, counted in ``catch_up_seconds`` (which neither gate charges to the call's price) like deferred rows. A
    decode step's rows, one per committed token, are the call's own."""
    drafter, seq, aux = drafter_on_random_sequence(tmp_path, seed=7, length=80, depth=3, top_k=3)
    ctx = draft_context(seq, aux, 0, 60, sampled=[int(seq[60])])
    started = time.perf_counter()
    assert drafter.ingest(ctx) == [0]
    elapsed = time.perf_counter() - started
    prompt = drafter.catch_up_seconds
    assert 0 < prompt < elapsed
    ctx = draft_context(seq, aux, 60, 62, sampled=[int(seq[61]), int(seq[62])])  # two committed tokens, two rows
    assert drafter.ingest(ctx) == [0]
    assert drafter.catch_up_seconds < 0.05 * prompt  # nothing written but the call's own rows (microseconds of
    # bookkeeping for the requests that do not draft are counted with the catch-up)


def test_the_rows_a_request_left_are_priced_at_the_measured_cost_of_a_written_row(tmp_path):
    """``backlog_seconds``: a request's deferred rows times the running price of a written row, learnt from batched
    writes of ``ROW_PRICE_MIN_ROWS`` rows or more (a step's few rows would price the call's overheads); nothing before
    such a write, and nothing for a request whose rows are written."""
    drafter, seq, aux = drafter_on_random_sequence(tmp_path, seed=13, length=80, depth=3, top_k=3)
    ctx = draft_context(seq, aux, 0, 40, sampled=[int(seq[40])])
    ctx.draft_rows = np.array([False])
    drafter.ingest(ctx)
    assert drafter._deferred_count == {"r": 40} and drafter.backlog_seconds(["r"]) == 0.0  # no write timed yet
    drafter.ingest(draft_context(seq, aux, 40, 41, sampled=[int(seq[41])]))  # catches up on the 40: a priced write
    price = drafter.row_write_seconds
    assert price is not None and price > 0 and drafter.backlog_seconds(["r"]) == 0.0
    drafter.ingest(draft_context(seq, aux, 41, 42, sampled=[int(seq[42])]))  # one row: not a price
    assert drafter.row_write_seconds == price
    for start in range(42, 52):
        drafter.observe(draft_context(seq, aux, start, start + 1, sampled=[int(seq[start + 1])]))
    assert drafter.backlog_seconds(["r", "other"]) == pytest.approx(10 * price)


def test_a_depth_cap_stops_the_expansion(tmp_path):
    """``max_depth`` (the budget's ``useful_depth``) stops the levels early: no node below it, fewer head rows, and
    the levels above it are those of the uncapped tree."""
    head, path = small_head(tmp_path, seed=9)
    seq = np.random.default_rng(9).integers(0, VOCAB, size=40)
    aux = torch.randn(40, 3, HIDDEN)

    def drafted(max_depth):
        drafter = EagleDrafter(path, depth=5, top_k=3)
        drafter.load(head.embed.weight)
        ctx = draft_context(seq, aux, 0, 20, sampled=[int(seq[20])])
        drafter.ingest(ctx)
        return drafter.draft(ctx, [0], budget=64, max_depth=max_depth)[0], drafter.expanded_rows

    full, full_rows = drafted(None)
    capped, capped_rows = drafted(2)
    assert full.depths().max() == 5 and capped.depths().max() == 2 and capped_rows < full_rows
    shallow = full.depths() <= 2
    assert sorted(capped.token_ids.tolist()) == sorted(full.token_ids[shallow].tolist())


def two_request_context(seqs, auxes, spans, drafting) -> ProposeContext:
    """Requests "a" and "b": request j's rows for positions spans[j] of its own sequence and aux hidden states;
    ``drafting``: which of them need a draft."""
    tokens = np.zeros((2, 256), np.int64)
    rows, starts, ends, positions = [], [], [], []
    for j, ((start, stop), seq, aux) in enumerate(zip(spans, seqs, auxes)):
        tokens[j, : stop + 1] = seq[: stop + 1]
        starts.append(sum(b - a for a, b in spans[:j]))
        ends.append(starts[-1] + stop - start - 1)
        positions.append(start)
        rows.append(aux[start:stop])
    aux_rows = torch.cat(rows)
    return ProposeContext(req_ids=["a", "b"], sampled_token_ids=[[int(s[b])] for s, (_, b) in zip(seqs, spans)],
                          num_tokens=np.array([b + 1 for _, b in spans]), token_ids=tokens, max_nodes=64,
                          aux_hidden_states=[aux_rows[:, k] for k in range(aux_rows.shape[1])],
                          hidden_row_index=np.array(ends), hidden_row_start=np.array(starts),
                          hidden_position_start=np.array(positions), draft_rows=np.array(drafting))


def test_a_request_the_head_does_not_draft_for_costs_no_writes(tmp_path, monkeypatch):
    """On a busy server the head drafts for few requests: the others' rows are written only when it drafts for them,
    and never if they finish first; their drafts are then the trees of a drafter that wrote every row at once. One
    request keeps its newest ``DEFERRED_ROWS_PER_REQUEST`` rows waiting, its older ones dropped unwritten: a draft for
    it then writes those alone, and its older positions stay masked out."""
    head, path = small_head(tmp_path, seed=11)
    rng = np.random.default_rng(11)
    seqs = [rng.integers(0, VOCAB, size=48) for _ in range(2)]
    auxes = [torch.randn(48, 3, HIDDEN) for _ in range(2)]
    spans = [(0, 10), (10, 11), (11, 12), (12, 18), (18, 26)]

    def run(drafting_b):
        drafter = EagleDrafter(path, depth=4, top_k=4)
        drafter.load(head.embed.weight)
        for step, span in enumerate(spans):
            ctx = two_request_context(seqs, auxes, [span, span], [True, drafting_b(step)])
            drafter.ingest(ctx)
        return drafter, ctx

    eager, ctx = run(lambda step: True)
    lazy, _ = run(lambda step: step == len(spans) - 1)
    want = eager.draft(ctx, [1], budget=24)[1]
    got = lazy.draft(ctx, [1], budget=24)[1]
    assert got.token_ids.tolist() == want.token_ids.tolist() and got.parents.tolist() == want.parents.tolist()
    assert got.node_probs == pytest.approx(want.node_probs, rel=1e-5)

    never, _ = run(lambda step: False)
    assert "b" not in never.states and never._deferred_rows == 26  # all of b's rows wait, none written
    assert never.states["a"].length == 26
    never.release({"b"})
    assert never._deferred_rows == 0 and not never._deferred  # finished: its rows are dropped unwritten

    monkeypatch.setattr("vllm_treespec.eagle.drafter.DEFERRED_ROWS_PER_REQUEST", 16)
    capped, _ = run(lambda step: False)
    # b's newest 16 of 26 rows wait (positions 10-25; its first segment and part of its fourth dropped), none written
    assert "b" not in capped.states and capped._deferred_rows == 16 and capped._deferred_count == {"b": 16}
    waiting = capped._deferred["b"]
    assert np.concatenate([p for _, _, p in waiting]).tolist() == list(range(10, 26))
    assert sum(len(a) for a, _, _ in waiting) == sum(len(t) for _, t, _ in waiting) == 16
    last = two_request_context(seqs, auxes, [(26, 27), (26, 27)], [True, True])
    capped.ingest(last)  # b's first draft: its 16 waiting rows and this step's are written, positions 0-9 masked
    state = capped.states["b"]
    assert state.length == 27 and not state.written[:10].any() and state.written[10:27].all()
    assert capped._deferred_rows == 0


def test_the_heads_grow_no_larger_than_the_budget_admits():
    """eagle_tree and graft's model drafter ask the head for ``ctx.useful_max_nodes`` nodes a tree (its frontier
    at each level is at most that wide), not ``max_nodes``: under load the budget admits a node or two a request,
    and a head growing 8-wide levels for every request cost more than those nodes saved."""
    from vllm_treespec.proposers.eagle_tree import EagleTreeProposer
    from vllm_treespec.proposers.graft.drafter import EagleModelDrafter

    asked = []

    class Head:  # EagleDrafter's calls, recording the budget
        catch_up_seconds = 0.0

        def ingest(self, ctx):
            return [0]

        def draft(self, ctx, rows, budget, stop_below=None, min_confidence=0.0, max_depth=None):
            asked.append(budget)
            return {}

    ctx = ProposeContext(req_ids=["a"], sampled_token_ids=[[1]], num_tokens=np.array([3]),
                         token_ids=np.zeros((1, 8), np.int64), max_nodes=32, useful_nodes=5)
    graft_head = EagleModelDrafter.__new__(EagleModelDrafter)
    graft_head.drafter, graft_head._ready = Head(), {0}
    graft_head.draft(ctx, [0])
    eagle = EagleTreeProposer.__new__(EagleTreeProposer)
    eagle.drafter, eagle.min_node_confidence = Head(), 0.0
    eagle.propose_trees(ctx)
    ctx.useful_nodes = None  # no allocation yet, or a probe: the whole cap
    graft_head.draft(ctx, [0])
    assert asked == [5, 5, 32]
