"""How often the target accepts graft's retrieved continuations, by how many context tokens the retrieval matched.

Generates greedy no-speculation outputs of the target (fp32, an in-process vLLM engine, first turns only), or reads
them back (``--outputs``), then replays graft's suffix and n-gram sources over every output position: the tree each
source retrieves for the context so far (graft's default options: suffix automata over the request and the finished
outputs, n-grams 2..4, depth 16, 32 nodes), walked along the output that followed. A node counts where the target
reached it (a root child, or a child of an accepted node). Printed per source and match-length class
(:data:`vllm_treespec.proposers.graft.sources.MATCH_CLASSES`): the acceptance of nodes by depth (1, 2, deeper)
and raw confidence (>= 0.9 or below), and the mean accepted path per position. This is the evidence for calibrating
those sources by match length (``calibrate_by_match_length``).

``--policies`` instead decodes every output under each drafting policy of :data:`POLICIES`, verifying whatever it
proposes at every step (greedy: the target accepts the longest proposed path its output follows; fp32 outputs are
what every exact method commits). Printed per policy: tokens per step, draft nodes verified per step, and the
share of steps with a proposal. vLLM's ``ngram`` (k = 5, n-grams 4 down to 2, as the benchmarks run it) is vLLM's
own matcher; graft's sources are built as graft builds them. What a policy yields here bounds what it yields in an
engine, where a step budget verifies less than everything: how many tokens per step graft's retrieval can reach,
against ``ngram``'s, at how many verified nodes. ``--cost RECORD`` (a step-cost record: an engine's cached curve in
``<cache>/cost_models/``, or the ``.cost.json`` beside a budget trace) also prices each step's forward (one request,
its proposal's nodes plus the root, at the curve's context) and prints tokens per second of forward time against
``ngram``'s: host work is not counted, so this bounds what a policy can gain on that engine's curve. With
``--cost`` two more rows run graft's retrieval as the verifier runs it (:func:`replay_priced`): both sources' trees
merged, priced by the verifier's acceptance calibration as it learns online, and cut by the step budget's rule on
that curve (by match length: the sources' nodes learnt apart by how long a context suffix they matched). No head
and no drafter gate; ``--overhead-ms`` charges host time to each step that drafts. Where it lands between
``ngram`` and hindsight says how much of what the trees hold the budget gets on that machine's curve. A third row
prices every node by the rate its class (source and match length, depth, raw confidence) had on these very outputs
(:func:`in_sample_rates`): the most any calibration keyed on those classes could know, so what separates it from
hindsight is what those classes cannot tell apart.

    python scripts/replay_matches.py --prompts "sharegpt[2200:2240],humaneval[100:104]" --save /tmp/ref.jsonl
    python scripts/replay_matches.py --outputs /tmp/ref.jsonl
    python scripts/replay_matches.py --outputs /tmp/ref.jsonl --policies
    python scripts/replay_matches.py --outputs /tmp/ref.jsonl --policies \
        --cost ~/.cache/vllm_treespec/cost_models/X.json [--overhead-ms 3]
    python scripts/replay_matches.py --outputs /tmp/ref.jsonl --policies --datastore corpus.tsds

``--successor-agreement`` (with ``--cost``, on outputs saved with the target's top 8 at each position: ``--save``
since this option) asks whether agreement between graft's matched sources and its successor table tells the nodes the
target accepts from those it rejects, beyond the calibration's classes: the suffix and n-gram trees merged with the
successor table's (learnt as graft learns it, from committed bigrams and the target's top 8 after each committed
token), each node priced by **cross-fitted** class rates (counted on the other half of the outputs) keyed as the
calibration keys them, then with the node's agreement added to the key (proposed by a matched source and by the
successor table), then with the successor table's rank of the node's token after its parent's.

``--datastore F`` has graft's suffix source match a corpus datastore too, as graft's option ``"datastore"`` does
(vLLM's ``ngram`` never sees it).
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from vllm_treespec.proposers.graft.options import GraftOptions
from vllm_treespec.proposers.graft.sources import FALLBACK_VOCAB_SIZE, MATCH_CLASSES, RetrievalSources, match_class

BUDGET = 32
#: the target's most likely tokens saved per output position (graft's successor table keeps as many: successor_k)
TOP_K = 8
#: prompts longer than this are left out (they would not fit the engine's context with the output)
MAX_PROMPT_TOKENS = 1800


def generate(prompts: str, max_tokens: int, model: str | None) -> list[dict]:
    """Greedy fp32 outputs of each prompt's first turn: [{"prompt": ids, "output": ids}]."""
    from vllm import LLM, SamplingParams

    from vllm_treespec.tools.bench import load_questions, load_tokenizer
    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2

    cpu_memory_defaults()
    model = model or str(ensure_smollm2())
    tokenizer = load_tokenizer(model)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                           add_generation_prompt=True)
             for qs in load_questions(prompts.split(","), None).values() for q in qs]
    texts = [t for t in texts if len(tokenizer(t)["input_ids"]) <= MAX_PROMPT_TOKENS]
    llm = LLM(model=model, dtype="float32", max_model_len=MAX_PROMPT_TOKENS + max_tokens + 8, max_num_seqs=16,
              enforce_eager=True)
    # the target's top TOP_K at each position: the chosen token's log-probability (greedy: the top-1) is read by
    # --target-confidence, the rest by --successor-agreement
    results = llm.generate(texts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP_K),
                           use_tqdm=False)
    records = []
    for r in results:
        out = r.outputs[0]
        tops = [sorted(step.items(), key=lambda kv: -kv[1].logprob)[:TOP_K] for step in out.logprobs]
        records.append({"prompt": list(r.prompt_token_ids), "output": list(out.token_ids),
                        "output_logprobs": [float(step[t].logprob) for t, step in zip(out.token_ids, out.logprobs)],
                        "output_top": [[[int(t) for t, _ in top], [float(lp.logprob) for _, lp in top]]
                                       for top in tops]})
    return records


#: upper edges of the classes of the target's probability of the last committed token (--target-confidence);
#: class 0 is the first output position, whose last token is the prompt's (the target never scored it)
TARGET_CONFIDENCE_EDGES = (0.5, 0.8, 0.95)


def target_class(record: dict, i: int) -> int:
    """The class of the target's probability of the token before output position ``i`` (0: the prompt's last)."""
    if i == 0:
        return 0
    return 1 + int(np.searchsorted(TARGET_CONFIDENCE_EDGES, np.exp(record["output_logprobs"][i - 1]), "right"))


def walk(tree, future: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(accepted, reached, depth) per node of ``tree`` (parents first) against the tokens that followed."""
    accepted = np.zeros(tree.num_nodes, bool)
    reached = np.zeros(tree.num_nodes, bool)
    depths = tree.depths()
    for i, parent in enumerate(tree.parents.tolist()):
        reached[i] = parent < 0 or accepted[parent]
        d = int(depths[i]) - 1
        accepted[i] = reached[i] and d < len(future) and int(tree.token_ids[i]) == future[d]
    return accepted, reached, depths


def graft_sources(names: tuple[str, ...], corpus=None) -> RetrievalSources:
    """graft's retrieval sources as graft builds them, the suffix source over ``corpus`` too (a loaded datastore)."""
    return RetrievalSources(GraftOptions(sources=names), FALLBACK_VOCAB_SIZE, corpus)


def replay(records: list[dict], corpus=None):
    """Per (source, class, depth class, raw >= 0.9): [accepted, reached]; per (source, class): accepted paths."""
    sources = graft_sources(("suffix", "ngram"), corpus)
    nodes: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    paths: dict[tuple, list[int]] = collections.defaultdict(list)
    for key, record in enumerate(records):
        prompt, output = record["prompt"], record["output"]
        tokens = np.asarray(prompt + output, np.int32)
        for i in range(len(output) - 1):
            context = tokens[: len(prompt) + i]
            for name, tree in sources.at_root(key, context, BUDGET, len(prompt)).items():
                if tree.num_nodes == 0:
                    continue
                accepted, reached, depths = walk(tree, output[i:])
                cls = match_class(tree.match_len)
                paths[(name, cls)].append(int(accepted.sum()))
                for j in np.nonzero(reached)[0]:
                    cell = nodes[(name, cls, min(int(depths[j]), 3), bool(tree.probs[j] >= 0.9))]
                    cell[0] += int(accepted[j])
                    cell[1] += 1
        sources.release({key})
    return nodes, paths


#: --policies: label -> (kind, source, size): vLLM's ngram chain of k = size; one source's best chain (the most
#: probable child at each depth) of at most size nodes; one source's tree, or both sources' trees ("both"), cut to
#: size nodes each by graft's retrievers; "hindsight" verifies only the nodes the target accepts of both trees (what
#: no allocator can know before the step: the ceiling of any allocation of those trees)
POLICIES = {
    "vLLM ngram, k=5": ("ngram", None, 5),
    "suffix chain, <=5": ("chain", "suffix", 5),
    "suffix chain, <=16": ("chain", "suffix", 16),
    "suffix tree, 32": ("tree", "suffix", 32),
    "n-gram tree, 32": ("tree", "ngram", 32),
    "suffix + n-gram trees, 32 each": ("tree", "both", 32),
    # a ceiling, not a policy: both trees' accepted path and nothing else, as if every allocation knew the outcome
    "hindsight: accepted path only": ("hindsight", "both", 32),
}


def vllm_ngram(context: np.ndarray, k: int) -> list[int]:
    """What vLLM's ``ngram`` proposer drafts after ``context`` (its own matcher: the longest of the 4- to 2-grams
    ending the context, at its earliest occurrence)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

    return _find_longest_matched_ngram_and_propose_tokens(np.asarray(context, np.int32), 2, 4, 1 << 30, k).tolist()


def best_chain(tree, size: int) -> list[int]:
    """``tree``'s most probable path, one child per depth, at most ``size`` tokens."""
    parents, probs = tree.parents.tolist(), tree.probs.tolist()
    path, node = [], -1
    while len(path) < size:
        children = [j for j in range(tree.num_nodes) if parents[j] == node]
        if not children:
            break
        node = max(children, key=lambda j: probs[j])
        path.append(int(tree.token_ids[node]))
    return path


def _prefix(proposal: list[int], future: list[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(future) and proposal[n] == future[n]:
        n += 1
    return n


def replay_policies(records: list[dict], step_seconds=None, corpus=None) -> dict[str, tuple[float, ...]]:
    """Per policy of :data:`POLICIES`: (tokens per step, draft nodes per step, share of steps with a proposal) and,
    with ``step_seconds`` (tokens in a one-request forward -> seconds), tokens per second of forward time."""
    sources = graft_sources(("suffix", "ngram"), corpus)
    totals = {label: [0, 0, 0, 0, 0.0] for label in POLICIES}  # tokens, steps, nodes, steps with a proposal, seconds
    for key, record in enumerate(records):
        prompt, output = record["prompt"], record["output"]
        tokens = np.asarray(prompt + output, np.int32)
        for label, (kind, source, size) in POLICIES.items():
            i = 0
            while i < len(output):
                context, future = tokens[: len(prompt) + i], output[i:]
                if kind == "ngram":
                    proposal = vllm_ngram(context, size)
                    accepted, nodes = _prefix(proposal, future), len(proposal)
                else:
                    found = sources.at_root(key, context, size, len(prompt))
                    trees = [t for name, t in found.items() if source in (name, "both") and t.num_nodes]
                    if kind == "chain":
                        chains = [best_chain(t, size) for t in trees]
                        accepted = max((_prefix(c, future) for c in chains), default=0)
                        nodes = sum(len(c) for c in chains)
                    else:
                        accepted = max((int(walk(t, future)[0].sum()) for t in trees), default=0)
                        nodes = accepted if kind == "hindsight" else sum(t.num_nodes for t in trees)
                total = totals[label]
                total[0] += accepted + 1
                total[1] += 1
                total[2] += nodes
                total[3] += nodes > 0
                total[4] += step_seconds(1 + nodes) if step_seconds is not None else 0.0
                i += accepted + 1
        sources.release({key})
    return {label: (t[0] / t[1], t[2] / t[1], t[3] / t[1]) + ((t[0] / t[4],) if step_seconds is not None else ())
            for label, t in totals.items()}


def _rate_keys(tree, target: int | None = None) -> list[tuple[int, ...]]:
    """Per node of a merged proposal: (source class, depth class, raw-confidence bin), the calibration's keys, and
    ``target`` (the step's :func:`target_class`) when given."""
    from vllm_treespec.verify.calibration import AcceptanceCalibration, depth_class

    keys = zip(tree.node_sources.tolist(), depth_class(tree.depths()).tolist(),
               AcceptanceCalibration.bins(tree.node_probs).tolist())
    return [k + (target,) for k in keys] if target is not None else list(keys)


def _acceptance_sources(by_match_length: bool):
    """graft's acceptance-source names of the suffix and n-gram sources (one per match-length class, or one each),
    and (source name, match length) -> index among them."""
    from vllm_treespec.proposers.graft.sources import MATCHED_SOURCES, match_class_sources

    names = [n for s in MATCHED_SOURCES for n in (match_class_sources(s) if by_match_length else (s,))]

    def source_id(name: str, match_len: int) -> int:
        return names.index(match_class_sources(name)[match_class(match_len)] if by_match_length else name)

    return names, source_id


def _merged_proposal(sources, key: int, context: np.ndarray, prompt_len: int, source_id):
    """Both sources' trees continuing ``context``, merged as graft merges them, with each node's source class and
    raw confidence (a DraftTree); (None, []) when neither source matched."""
    from vllm_treespec.api import DraftTree
    from vllm_treespec.retrieval import union_trees

    found = [(name, t) for name, t in sources.at_root(key, context, BUDGET, prompt_len).items() if t.num_nodes]
    if not found:
        return None, found
    union = union_trees([(t.token_ids, t.parents, t.probs) for _, t in found], [-1] * len(found))
    raw = np.concatenate([np.asarray(t.probs, np.float64) for _, t in found])[union.origin]
    ids = np.concatenate([np.full(t.num_nodes, source_id(name, t.match_len)) for name, t in found])
    return DraftTree(union.token_ids, union.parents, raw.astype(np.float32), ids[union.origin]), found


def in_sample_rates(records: list[dict], by_target: bool = False,
                    keys: set[int] | None = None, corpus=None) -> dict[tuple[int, ...], float]:
    """How often the target accepted the nodes it reached of the merged proposal at every output position, by
    source and match-length class, depth class and raw-confidence bin: rates measured on the outputs they will price
    (Laplace-smoothed), what no online calibration keyed on those classes can beat. ``by_target`` adds the class of
    the target's probability of the last committed token (:func:`target_class`) to every key; ``keys`` counts only
    those records (the others still feed the global suffix store, as in the budget replay)."""
    from vllm_treespec.proposers.graft.sources import MATCHED_SOURCES

    _, source_id = _acceptance_sources(by_match_length=True)
    # one set of sources for every output, each released after it, as replay_priced runs them: finished outputs
    # join the global suffix store, so an output's proposals are the ones the budget replay prices
    sources = graft_sources(MATCHED_SOURCES, corpus)
    counts: dict[tuple[int, int, int], list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, record in enumerate(records):
        prompt, output = record["prompt"], record["output"]
        tokens = np.asarray(prompt + output, np.int32)
        if keys is not None and key not in keys:  # not counted: only its text joins the global suffix store
            sources.at_root(key, tokens[:-1], BUDGET, len(prompt))
            sources.release({key})
            continue
        for i in range(len(output)):
            tree, _ = _merged_proposal(sources, key, tokens[: len(prompt) + i], len(prompt), source_id)
            if tree is None:
                continue
            accepted, reached, _ = walk(tree, output[i:])
            cells = _rate_keys(tree, target_class(record, i) if by_target else None)
            for j in np.flatnonzero(reached).tolist():
                cell = counts[cells[j]]
                cell[0] += int(accepted[j])
                cell[1] += 1
        sources.release({key})
    return {cell: (a + 1.0) / (n + 2.0) for cell, (a, n) in counts.items()}


def replay_priced(records: list[dict], cost, by_match_length: bool = False, overhead: float = 0.0,
                  breakdown: dict | None = None, rates: dict | None = None,
                  rates_of=None, by_target: bool = False, corpus=None) -> tuple[float, ...]:
    """graft's retrieval under the verifier's budget: at every step the suffix and n-gram trees, merged as graft
    merges them, priced by the verifier's own acceptance calibration (:class:`AcceptanceTracker`: learned online from
    what this replay verified and from the committed token after the last accepted node, with its expectation
    corrections) and cut by the step budget's rule (:func:`~vllm_treespec.cost.allocate.allocate`: the best prefix of
    nodes by tokens per second on ``cost``, none when none pays). No head, no drafter gate, no host work but
    ``overhead`` seconds on a step with drafts. Returns what :func:`replay_policies` returns per policy.
    ``breakdown`` (a dict) collects, per match-length class of the step's longest retrieval match, [steps, tokens
    the proposed trees' accepted path held (hindsight), drafts accepted, nodes admitted]. ``rates``
    (:func:`in_sample_rates`) prices every node by its class's rate in that table instead of the calibration (by
    match length); ``rates_of`` (record index -> such a table) prices each record by its own table (cross-fitted
    rates), and ``by_target`` keys those tables by the step's :func:`target_class` too."""
    from vllm_treespec.api import DraftTree
    from vllm_treespec.cost.allocate import allocate
    from vllm_treespec.proposers.graft.sources import MATCHED_SOURCES
    from vllm_treespec.verify.calibration import AcceptanceTracker

    if rates is not None:
        rates_of = lambda key: rates  # noqa: E731
    names, source_id = _acceptance_sources(by_match_length or rates_of is not None)
    sources = graft_sources(MATCHED_SOURCES, corpus)
    tracker = AcceptanceTracker(names) if rates_of is None else None  # a fixed table learns nothing

    tokens_total = steps = nodes_total = drafting = 0
    seconds = 0.0
    for key, record in enumerate(records):
        req = str(key)
        prompt, output = record["prompt"], record["output"]
        tokens = np.asarray(prompt + output, np.int32)
        table = rates_of(key) if rates_of is not None else None
        i = 0
        while i < len(output):
            future = output[i:]
            proposed, found = _merged_proposal(sources, key, tokens[: len(prompt) + i], len(prompt), source_id)
            final, held = None, 0
            if found:
                held = int(walk(proposed, future)[0].sum())
                priced = tracker.calibrate([proposed], req_ids=[req]) if tracker is not None else [DraftTree(
                    proposed.token_ids, proposed.parents,
                    np.array([table.get(cell, 0.0) for cell in _rate_keys(
                        proposed, target_class(record, i) if by_target else None)], np.float32))]
                final = allocate(priced, cost, per_request_cap=BUDGET, overhead=overhead).trees[0]
                if tracker is not None:
                    tracker.handed([req], [proposed], [final])
                    tracker.scheduled({req: final.token_ids.tolist() if final is not None else []})
            accepted = int(walk(final, future)[0].sum()) if final is not None else 0
            if found and tracker is not None:
                tracker.committed([req], [future[: accepted + 1]])
            k = final.num_nodes if final is not None else 0
            if breakdown is not None and found:
                cell = breakdown.setdefault(MATCH_CLASSES[match_class(max(t.match_len for _, t in found))], [0] * 4)
                for j, value in enumerate((1, held, accepted, k)):
                    cell[j] += value
            tokens_total += accepted + 1
            steps += 1
            nodes_total += k
            drafting += k > 0
            seconds += cost.predict(1 + k, 1) + (overhead if k else 0.0)
            i += accepted + 1
        sources.release({key})
        if tracker is not None:
            tracker.by_request.forget({req})
    return tokens_total / steps, nodes_total / steps, drafting / steps, tokens_total / seconds


def _successor_steps(records: list[dict]) -> list[list[dict | None]]:
    """Per output position: the suffix, n-gram and successor trees continuing the context, merged as graft merges
    them, with each node's class (source and match-length class, depth class, raw-confidence bin), whether a matched
    source and the successor table both proposed it, the successor table's rank of its token after its parent's
    (TOP_K: absent), and what the target accepted of it. The successor table learns as graft's does: seeded from the
    committed bigrams, and the target's top TOP_K after every committed token (graft learns them from verified rows)."""
    from vllm_treespec.api import DraftTree
    from vllm_treespec.retrieval import union_trees
    from vllm_treespec.verify.calibration import AcceptanceCalibration, depth_class

    matched_classes, source_id = _acceptance_sources(by_match_length=True)
    successor_class = len(matched_classes)  # the successor table's nodes: one class (graft calibrates it as one)
    sources = graft_sources(("suffix", "ngram", "successor"))
    cache = []
    for key, record in enumerate(records):
        prompt, output, tops = record["prompt"], record["output"], record["output_top"]
        start = len(prompt)
        tokens = np.asarray(prompt + output, np.int64)
        steps, learned = [], 0
        for i in range(len(output)):
            context = tokens[: start + i]
            sources.observe(key, context)
            if i > learned:  # the target's top TOP_K at positions learned .. i - 1, each after the token before it
                ids = np.zeros((i - learned, TOP_K), np.int64)
                probs = np.zeros((i - learned, TOP_K), np.float32)
                for row, j in enumerate(range(learned, i)):
                    top_ids, top_logprobs = tops[j]
                    ids[row, : len(top_ids)] = top_ids
                    probs[row, : len(top_ids)] = np.exp(top_logprobs)
                sources.learn(tokens[start + learned - 1: start + i - 1], ids, probs)
                learned = i
            parts = [(n, t) for n, t in sources.at_root(key, context, BUDGET, start).items() if t.num_nodes]
            if not parts:
                steps.append(None)
                continue
            union = union_trees([(t.token_ids, t.parents, t.probs) for _, t in parts], [-1] * len(parts))
            raw = np.concatenate([np.asarray(t.probs, np.float64) for _, t in parts])[union.origin]
            classes = np.concatenate([np.full(t.num_nodes, successor_class if n == "successor"
                                              else source_id(n, t.match_len)) for n, t in parts])[union.origin]
            proposed_by = np.zeros((union.token_ids.size, 2), bool)  # a matched source, the successor table
            offset = 0
            for name, t in parts:
                proposed_by[union.node_of[offset: offset + t.num_nodes], int(name == "successor")] = True
                offset += t.num_nodes
            parent_tokens = np.where(union.parents < 0, context[-1], union.token_ids[np.maximum(union.parents, 0)])
            rank = np.full(union.token_ids.size, TOP_K)
            for j, (parent, token) in enumerate(zip(parent_tokens.tolist(), union.token_ids.tolist())):
                hit = np.flatnonzero(sources.successors.row(parent)[0] == token)
                rank[j] = int(hit[0]) if hit.size else TOP_K
            tree = DraftTree(union.token_ids, union.parents, raw.astype(np.float32))
            accepted, reached, depth = walk(tree, output[i:])
            base = list(zip(classes.tolist(), depth_class(depth).tolist(), AcceptanceCalibration.bins(raw).tolist()))
            both = (proposed_by[:, 0] & proposed_by[:, 1]).tolist()
            rank_class = np.minimum(rank, 2).tolist()  # top-1, top-2, further or absent
            steps.append({"tree": tree, "accepted": accepted, "reached": reached, "held": int(accepted.sum()),
                          "keys": {"classes": base, "agreement": [k + (b,) for k, b in zip(base, both)],
                                   "rank": [k + (r,) for k, r in zip(base, rank_class)]}})
        sources.release({key})
        cache.append(steps)
    return cache


def _class_rates(cache: list[list[dict | None]], keep: set[int], variant: str) -> dict[tuple, float]:
    """Laplace-smoothed acceptance of the reached nodes of the records ``keep``, by ``variant``'s keys."""
    counts: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for key, steps in enumerate(cache):
        if key not in keep:
            continue
        for step in steps:
            if step is None:
                continue
            keys = step["keys"][variant]
            for j in np.flatnonzero(step["reached"]).tolist():
                counts[keys[j]][0] += int(step["accepted"][j])
                counts[keys[j]][1] += 1
    return {cell: (a + 1.0) / (n + 2.0) for cell, (a, n) in counts.items()}


def _replay_rates(records: list[dict], cache: list[list[dict | None]], cost, rates_of, variant: str | None
                  ) -> tuple[float, float, float, float]:
    """Decode every output verifying, at each step, the budget's cut of the merged trees priced by ``rates_of(record)``
    keyed by ``variant`` (None: hindsight, only the nodes the target accepts). As replay_policies returns."""
    from vllm_treespec.api import DraftTree
    from vllm_treespec.cost.allocate import allocate

    tokens = steps_total = nodes = drafting = 0
    seconds = 0.0
    for key, (record, steps) in enumerate(zip(records, cache)):
        output, i = record["output"], 0
        while i < len(output):
            step, accepted, k = steps[i], 0, 0
            if step is not None and variant is None:
                accepted = k = step["held"]
            elif step is not None:
                table = rates_of(key)
                probs = np.array([table.get(cell, 0.0) for cell in step["keys"][variant]], np.float32)
                final = allocate([DraftTree(step["tree"].token_ids, step["tree"].parents, probs)], cost,
                                 per_request_cap=BUDGET).trees[0]
                if final is not None and final.num_nodes:
                    k, accepted = final.num_nodes, int(walk(final, output[i:])[0].sum())
            tokens += accepted + 1
            steps_total += 1
            nodes += k
            drafting += k > 0
            seconds += cost.predict(1 + k, 1)
            i += accepted + 1
    return tokens / steps_total, nodes / steps_total, drafting / steps_total, tokens / seconds


def successor_agreement(records: list[dict], cost) -> dict[str, tuple[float, ...]]:
    """``--successor-agreement``: the budget over the merged suffix, n-gram and successor trees at cross-fitted
    class rates, keyed as the calibration keys nodes, then with agreement, then with the successor rank; hindsight."""
    cache = _successor_steps(records)
    halves = [set(range(0, len(records), 2)), set(range(1, len(records), 2))]
    results = {}
    for label, variant in (("classes, cross-fitted", "classes"), ("+ agreement, cross-fitted", "agreement"),
                           ("+ successor rank, cross-fitted", "rank")):
        tables = [_class_rates(cache, half, variant) for half in halves]
        results[label] = _replay_rates(records, cache, cost, lambda key: tables[1 - key % 2], variant)
    results["hindsight, with the successor tree"] = _replay_rates(records, cache, cost, None, None)
    return results


def report_policies(results: dict[str, tuple[float, ...]]) -> str:
    priced = all(len(r) == 4 for r in results.values())
    baseline = results.get("vLLM ngram, k=5")
    lines = ["policy                            tokens/step  nodes/step  steps drafting"
             + ("  tok/s of forwards  vs ngram" if priced else "")]
    for label, (tps, nodes, share, *rate) in results.items():
        line = f"{label:33} {tps:11.3f} {nodes:11.2f} {share:15.0%}"
        if priced:
            line += f" {rate[0]:18.1f} {rate[0] / baseline[3]:8.2f}x"
        lines.append(line)
    return "\n".join(lines)


def report_breakdowns(breakdowns: dict[str, dict]) -> str:
    """Per budget policy and class of a step's longest retrieval match: what hindsight and the budget took."""
    lines = ["steps with a match, by their longest: steps, tokens a step the trees' accepted path held (hindsight), "
             "drafts accepted and nodes verified a step under the budget"]
    for label, cells in breakdowns.items():
        lines.append(f"  {label}")
        for low in sorted(cells):
            steps, held, accepted, admitted = cells[low]
            lines.append(f"    match {low:>2}+ {steps:6} steps  hindsight {held / steps:5.2f}  accepted "
                         f"{accepted / steps:5.2f}  verified {admitted / steps:5.2f}")
    return "\n".join(lines)


def cost_model_of(record_path: str):
    """The step-cost model of a step-cost record file."""
    import msgspec

    from vllm_treespec.cost.model import CostRecord

    with open(record_path, "rb") as f:
        return msgspec.json.decode(f.read(), type=CostRecord).step_model()


def step_seconds_of(record_path: str):
    """tokens -> seconds of a one-request forward at the curve's context, from a step-cost record file."""
    model = cost_model_of(record_path)
    return lambda tokens: model.predict(tokens, 1)


def report(nodes, paths) -> str:
    lines = ["source  match  positions  path |  depth 1 raw>=.9  <.9 |  depth 2 raw>=.9  <.9 |  deeper raw>=.9  <.9"]

    def rate(cell) -> str:
        return f"{cell[0] / cell[1]:4.0%} ({cell[1]:>4})" if cell[1] else "   -      "

    for name in ("suffix", "ngram"):
        for cls, low in enumerate(MATCH_CLASSES):
            if (name, cls) not in paths:
                continue
            top = MATCH_CLASSES[cls + 1] - 1 if cls + 1 < len(MATCH_CLASSES) else None
            label = f"{low}" if top == low else f"{low}-{top}" if top else f"{low}+"
            found = paths[(name, cls)]
            cells = " | ".join(" ".join(rate(nodes.get((name, cls, d, high_raw), [0, 0])) for high_raw in (True, False))
                               for d in (1, 2, 3))
            lines.append(f"{name:7} {label:>5}  {len(found):>9} {np.mean(found):5.2f} | {cells}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="sharegpt[2200:2240],humaneval[100:104]",
                        help="prompt sets as in `vllm-treespec bench` (first turns)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--outputs", default=None, help="read the outputs a --save wrote instead of generating")
    parser.add_argument("--save", default=None, help="write the generated outputs here (JSON lines)")
    parser.add_argument("--policies", action="store_true",
                        help="decode every output under each drafting policy, verifying all it proposes (POLICIES)")
    parser.add_argument("--cost", default=None,
                        help="with --policies: a step-cost record (JSON) to price each step's forward by")
    parser.add_argument("--overhead-ms", type=float, default=0.0,
                        help="with --cost: host time a step with drafts costs graft's budget policies")
    parser.add_argument("--datastore", default=None,
                        help="a corpus datastore (`vllm-treespec datastore build`) graft's suffix source also matches, "
                             "as graft's option 'datastore'")
    parser.add_argument("--target-confidence", action="store_true",
                        help="with --cost: also price nodes by cross-fitted class rates (fitted on the other half "
                             "of the outputs) with and without the class of the target's probability of the last "
                             "committed token (outputs saved with it: --save since this option)")
    parser.add_argument("--successor-agreement", action="store_true",
                        help="with --cost: also price the merged suffix, n-gram and successor trees by cross-fitted "
                             "class rates with and without the nodes' agreement with the successor table (outputs "
                             "saved with the target's top 8: --save since this option)")
    args = parser.parse_args()
    if args.outputs:
        with open(args.outputs) as f:
            records = [json.loads(line) for line in f]
    else:
        records = generate(args.prompts, args.max_tokens, args.model)
        if args.save:
            with open(args.save, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    corpus = None
    if args.datastore:
        from vllm_treespec.retrieval import load_datastore

        corpus = load_datastore(args.datastore).automaton
    if args.policies:
        print(f"{len(records)} outputs, {sum(len(r['output']) for r in records)} tokens; every proposal verified")
        results = replay_policies(records, step_seconds_of(args.cost) if args.cost else None, corpus)
        if args.cost:
            cost = cost_model_of(args.cost)
            breakdowns = {}
            for label, by_length, rates in (("graft's budget", False, None),
                                            ("graft's budget, by match length", True, None),
                                            ("the budget at in-sample class rates", True,
                                             in_sample_rates(records, corpus=corpus))):
                breakdowns[label] = {}
                results[label] = replay_priced(records, cost, by_length, args.overhead_ms / 1e3, breakdowns[label],
                                               rates, corpus=corpus)
            if args.target_confidence:
                halves = [set(range(0, len(records), 2)), set(range(1, len(records), 2))]
                for label, by_target in (("cross-fitted class rates", False),
                                         ("the same, and the target's confidence", True)):
                    tables = [in_sample_rates(records, by_target, keys=half, corpus=corpus) for half in halves]
                    breakdowns[label] = {}
                    results[label] = replay_priced(records, cost, True, args.overhead_ms / 1e3, breakdowns[label],
                                                   rates_of=lambda key: tables[1 - key % 2], by_target=by_target,
                                                   corpus=corpus)
            if args.successor_agreement:
                results.update(successor_agreement(records, cost))
        print(report_policies(results))
        if args.cost:
            print(report_breakdowns(breakdowns))
        return
    print(f"{len(records)} outputs; node acceptance (reached nodes) by source, match length, depth, raw confidence")
    print(report(*replay(records, corpus)))


if __name__ == "__main__":
    main()
