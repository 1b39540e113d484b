"""scripts/bench_graft_host.py's replay on made-up streams: one proposal per step, from the prompt's end on, with
the context the step has committed."""

from __future__ import annotations

import numpy as np
from script_helpers import load_script

from vllm_treespec.proposers.graft import GraftOptions, GraftProposer


class _Recorder:
    def __init__(self):
        self.contexts, self.finished = [], []

    def propose_trees(self, ctx):
        self.contexts.append(ctx.committed(0).tolist())
        return [None]

    def on_requests_finished(self, req_ids):
        self.finished.append(req_ids)


def test_replay_proposes_at_every_step_with_the_committed_context():
    script = load_script("bench_graft_host")
    recorder = _Recorder()
    stream = np.arange(1, 11, dtype=np.int64)
    assert script.replay(recorder, [stream, stream[:4]], budget=8, stride=3) == 2 + 1
    assert recorder.contexts == [list(range(1, 6)), list(range(1, 9)), [1, 2]]  # the last token never proposed at
    assert recorder.finished == [{"r0"}, {"r1"}]


def test_replay_drives_graft_to_trees():
    script = load_script("bench_graft_host")
    proposer = GraftProposer(None, GraftOptions(eagle_checkpoint="none", budget=8), vocab_size=64)
    trees = []
    original = proposer.propose_trees
    proposer.propose_trees = lambda ctx: trees.extend(original(ctx)) or trees[-1:]
    loop = np.tile(np.arange(1, 9, dtype=np.int64), 6)  # a repeating stream: retrieval finds continuations
    assert script.replay(proposer, [loop], budget=8, stride=2) == 12
    assert sum(t is not None and t.num_nodes > 0 for t in trees) >= 10


def test_the_tree_digest_changes_with_the_trees_and_only_with_them():
    """The digest is the same on a second replay and differs when one tree does."""
    script = load_script("bench_graft_host")
    loop = np.tile(np.arange(1, 9, dtype=np.int64), 6)
    streams = [loop, np.arange(1, 40, dtype=np.int64) % 13]
    first = script.tree_digest(streams, budget=8, stride=2, vocab_size=64)
    assert script.tree_digest(streams, budget=8, stride=2, vocab_size=64) == first
    assert script.tree_digest(streams, budget=6, stride=2, vocab_size=64) != first
