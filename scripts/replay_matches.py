"""How often the target accepts graft's retrieved continuations, by how many context tokens the retrieval matched.

Generates greedy no-speculation outputs of the target (fp32, an in-process vLLM engine, first turns only), or reads
them back (``--outputs``), then replays graft's suffix and n-gram sources over every output position: the tree each
source retrieves for the context so far (graft's default options: suffix automata over the request and the finished
outputs, n-grams 2..4, depth 16, 32 nodes), walked along the output that followed. A node counts where the target
reached it (a root child, or a child of an accepted node). Printed per source and match-length class
(:data:`vllm_treespec.proposers.graft.sources.MATCH_CLASSES`): the acceptance of nodes by depth (1, 2, deeper)
and raw confidence (>= 0.9 or below), and the mean accepted path per position. This is the evidence for calibrating
those sources by match length (``calibrate_by_match_length``).

    python scripts/replay_matches.py --prompts "sharegpt[2200:2240],humaneval[100:104]" --save /tmp/ref.jsonl
    python scripts/replay_matches.py --outputs /tmp/ref.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np

from vllm_treespec.proposers.graft.options import GraftOptions
from vllm_treespec.proposers.graft.sources import FALLBACK_VOCAB_SIZE, MATCH_CLASSES, RetrievalSources, match_class

BUDGET = 32
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
    results = llm.generate(texts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [{"prompt": list(r.prompt_token_ids), "output": list(r.outputs[0].token_ids)} for r in results]


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


def replay(records: list[dict]):
    """Per (source, class, depth class, raw >= 0.9): [accepted, reached]; per (source, class): accepted paths."""
    sources = RetrievalSources(GraftOptions(sources=("suffix", "ngram")), FALLBACK_VOCAB_SIZE)  # as graft builds them
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
    args = parser.parse_args()
    if args.outputs:
        with open(args.outputs) as f:
            records = [json.loads(line) for line in f]
    else:
        records = generate(args.prompts, args.max_tokens, args.model)
        if args.save:
            with open(args.save, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"{len(records)} outputs; node acceptance (reached nodes) by source, match length, depth, raw confidence")
    print(report(*replay(records)))


if __name__ == "__main__":
    main()
