"""graft's proposer on the host, outside an engine: milliseconds per request-step of ``propose_trees``.

Each prompt of ``--prompts`` is tokenised (the embedded SmolLM2 tokenizer, its turns joined) and replayed as one
request: its first half is the prompt, then the context grows by ``--stride`` tokens a step, and graft proposes a
tree at every step (retrieval-only: no EAGLE head, no verifier, so no acceptance is learnt). What it measures is the
per-request host work an engine's step pays for graft's trees (retrieval, draft growth, grafting, calibration), the
part that does not depend on the model or the device. Best of ``--repeats`` passes after one warm-up pass;
``--profile`` adds cProfile's costliest functions.

    python scripts/bench_graft_host.py [--prompts "sharegpt[6913:6921]"] [--budget 32] [--repeats 3] [--profile]
    python scripts/bench_graft_host.py --digest [--prompts ...]

``--digest`` times nothing: it prints one SHA-256 of every tree graft proposes over the replay (tokens, parents,
numbers, sources and their dtypes) and of its statistics, at its defaults and with the checkpoints and graft position
changed, each with an acceptance calibration taught seeded made-up outcomes — run it before and after a change to
graft's host code that must not change a tree.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np


def token_streams(prompts: str, max_tokens: int) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    from vllm_treespec.tools.data import load_prompt_set
    from vllm_treespec.tools.models import ensure_smollm2

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_smollm2()))
    return [np.array(tokenizer(" ".join(q["turns"]))["input_ids"][:max_tokens], np.int64)
            for q in load_prompt_set(prompts)]


def replay(proposer, streams: list[np.ndarray], budget: int, stride: int) -> int:
    """Propose at every step of every stream; the number of calls."""
    from vllm_treespec.api import ProposeContext

    calls = 0
    for index, stream in enumerate(streams):
        req_id = f"r{index}"
        for end in range(max(len(stream) // 2, 1), len(stream), stride):
            ctx = ProposeContext(req_ids=[req_id], sampled_token_ids=[[int(stream[end - 1])]],
                                 num_tokens=np.array([end]), token_ids=stream[None, :end].copy(), max_nodes=budget)
            proposer.propose_trees(ctx)
            calls += 1
        proposer.on_requests_finished({req_id})
    return calls


#: graft's options the digest replays under (its defaults, and the branches they leave out)
DIGEST_OPTIONS = ({}, {"checkpoints": (2, 4, 6), "thresholds": (0.0, 0.4, 0.9)}, {"graft_position": "both"})


def tree_digest(streams: list[np.ndarray], budget: int, stride: int, vocab_size: int = 49152) -> str:
    """SHA-256 of every tree graft proposes over ``streams`` and of its statistics (see the module docstring)."""
    import hashlib
    import json

    from vllm_treespec.proposers.graft import GraftOptions, GraftProposer

    digest = hashlib.sha256()
    for options in DIGEST_OPTIONS:
        proposer = GraftProposer(None, GraftOptions(eagle_checkpoint="none", budget=budget, **options),
                                 vocab_size=vocab_size)
        rng = np.random.default_rng(0)  # outcomes that make the calibrated rates differ from the raw numbers
        num_sources = len(proposer.acceptance_sources)
        proposer.calibration.observe(rng.integers(0, num_sources, 3000), rng.random(3000), rng.random(3000) < 0.4,
                                     rng.integers(1, 6, 3000))
        original = proposer.propose_trees

        def hashed(ctx, original=original):
            trees = original(ctx)
            for tree in trees:
                if tree is not None:
                    for array in (tree.token_ids, tree.parents, tree.node_probs, tree.node_sources):
                        digest.update(b"-" if array is None else np.ascontiguousarray(array).tobytes()
                                      + str(array.dtype).encode())
            return trees

        proposer.propose_trees = hashed
        replay(proposer, streams, budget, stride)
        digest.update(json.dumps(vars(proposer.stats), sort_keys=True).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="sharegpt[6913:6921]")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=600, help="tokens of each prompt replayed")
    parser.add_argument("--stride", type=int, default=2, help="tokens committed per step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--digest", action="store_true", help="print a digest of every proposed tree; time nothing")
    args = parser.parse_args()
    if args.digest:
        print(f"graft trees digest: {tree_digest(token_streams(args.prompts, args.max_tokens), args.budget, args.stride)}"
              f" ({args.prompts}, budget {args.budget}, stride {args.stride})")
        return

    from vllm_treespec.proposers.graft import GraftOptions, GraftProposer

    streams = token_streams(args.prompts, args.max_tokens)
    proposer = GraftProposer(None, GraftOptions(eagle_checkpoint="none", budget=args.budget), vocab_size=49152)
    replay(proposer, streams, args.budget, args.stride)  # compiles and warms every kernel
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        calls = replay(proposer, streams, args.budget, args.stride)
        best = min(best, (time.perf_counter() - started) / calls)
    print(f"graft propose_trees: {best * 1e3:.3f} ms per request-step (best of {args.repeats}, {calls} calls, "
          f"{len(streams)} prompts of {args.prompts}, budget {args.budget})")
    if args.profile:
        profile = cProfile.Profile()
        profile.runcall(replay, proposer, streams, args.budget, args.stride)
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
