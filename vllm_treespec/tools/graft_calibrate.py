"""Calibration of ``graft``: checkpoint thresholds by offline replay, and a budget-by-batch table from measured cost.

1. The target runs greedily once, without speculation, on a small prompt set; each output token comes with the
   target's top-k distribution at its position (:func:`collect_episodes`).
2. Replay (:func:`replay`): a :class:`GraftProposer` drafts a tree at every step of each recorded output; the step
   accepts the longest tree path that the recorded output continues with (what greedy verification would accept)
   and commits it plus the bonus token. The successor table learns the target's distributions of the committed
   positions (the real engine also learns from rejected rows, so replay slightly understates it).
3. The decode step time of the target is measured at several batch sizes: the cost of a forward of T tokens
   (:func:`measure_step_cost`).
4. Thresholds are chosen by coordinate ascent on the expected speed at batch 1, ``(1 + accepted per step) /
   cost(1 + tree nodes)`` (coverage alone without a cost); then the coverage at smaller budgets gives, for each batch
   size n, the budget that maximises ``n (1 + accepted) / cost(n (1 + nodes))`` (:func:`budget_table`).

The JSON file (:class:`GraftCalibration`) is what the ``calibration_path`` option reads. Command line:
``vllm-treespec graft calibrate`` (:func:`calibrate_main`). There is deliberately no ``python -m`` entry: vLLM's CPU
workers are spawned and re-import the main module, and a main module that imports numba (llvmlite) before the worker
initialises breaks vLLM's Triton-kernel override scan (``'_lib_fn_wrapper' object has no attribute 'get'``).
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Any, Sequence

import msgspec
import numpy as np

from vllm_treespec.api import DraftTree, ProposeContext, VerificationResult
from vllm_treespec.proposers.graft.calibration import CALIBRATION_VERSION, GraftCalibration
from vllm_treespec.proposers.graft.options import DEFAULT_CHECKPOINTS, DEFAULT_THRESHOLDS, GraftOptions
from vllm_treespec.proposers.graft.proposer import GraftProposer

THRESHOLD_GRID = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
BUDGET_GRID = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
TOPK = 8


@dataclass
class Episode:
    """A greedy output of the target: ``topk_ids[j]`` / ``topk_probs[j]`` are the target's top-k at output position
    ``j`` (the distribution ``output[j]`` was chosen from)."""

    prompt: np.ndarray
    output: np.ndarray
    topk_ids: np.ndarray
    topk_probs: np.ndarray


@dataclass
class ReplayResult:
    steps: int = 0
    accepted: int = 0
    nodes: int = 0
    seconds: float = 0.0

    @property
    def coverage(self) -> float:
        """Mean accepted drafts per step (tau - 1)."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def mean_nodes(self) -> float:
        return self.nodes / self.steps if self.steps else 0.0


def accepted_path(tree: DraftTree, future: np.ndarray) -> list[int]:
    """Nodes of the longest root path whose tokens are a prefix of ``future`` (greedy verification)."""
    best: list[int] = []
    on_path: dict[int, int] = {-1: 0}  # node -> depth, for nodes whose path matches
    for i, (t, p) in enumerate(zip(tree.token_ids.tolist(), tree.parents.tolist())):
        d = on_path.get(p)
        if d is not None and d < len(future) and t == int(future[d]):
            on_path[i] = d + 1
            if d + 1 > len(best):
                best = tree.path_to(i)
    return best


def replay(proposer: GraftProposer, episodes: Sequence[Episode], budget: int) -> ReplayResult:
    """Replay ``episodes`` one after another through ``proposer`` (batch 1; see the module docstring)."""
    result = ReplayResult()
    for e, ep in enumerate(episodes):
        req_id = f"replay-{e}"
        tokens = np.concatenate([ep.prompt, ep.output]).astype(np.int64)[None, :]
        pos, sampled = 0, [int(ep.output[0])]  # output[pos] is the last committed token
        while pos + 1 < len(ep.output):
            n = len(ep.prompt) + pos + 1
            ctx = ProposeContext([req_id], [sampled], np.array([n]), tokens, max_nodes=budget)
            started = time.perf_counter()
            tree = proposer.propose_trees(ctx)[0]
            result.seconds += time.perf_counter() - started
            future = ep.output[pos + 1:]
            path = accepted_path(tree, future) if tree is not None else []
            a = len(path)
            if tree is not None:  # graft's acceptance calibration learns here as it does online (no logits here)
                proposer.on_verified([VerificationResult(req_id, tree, path, int(future[a]) if a < len(future) else 0)])
            rows = np.arange(pos + 1, min(pos + 2 + a, len(ep.output)))  # root row, then the accepted nodes' rows
            learned = np.concatenate([ep.output[pos: pos + 1], future[:a]])[: rows.size]
            proposer.learn_successors(learned, ep.topk_ids[rows], ep.topk_probs[rows])
            result.steps += 1
            result.accepted += a
            result.nodes += tree.num_nodes if tree is not None else 0
            sampled = ep.output[pos + 1: pos + 2 + a].tolist()
            pos += a + 1
        proposer.on_requests_finished({req_id})
    return result


class CostModel:
    """Milliseconds of one forward of T tokens, piecewise linear through measured points (linear beyond them)."""

    def __init__(self, step_ms: dict[int, float]) -> None:
        if not step_ms:
            raise ValueError("CostModel needs at least one measured point")
        self.tokens = np.array(sorted(step_ms), np.float64)
        # a forward of more tokens never costs less: measurement noise must not reward bigger trees
        self.ms = np.maximum.accumulate(np.array([step_ms[t] for t in sorted(step_ms)], np.float64))

    def __call__(self, tokens: float) -> float:
        t, ms = self.tokens, self.ms
        if tokens <= t[-1] or t.size == 1:
            return float(np.interp(tokens, t, ms)) if t.size > 1 else float(ms[0] * max(1.0, tokens / t[0]))
        slope = max((ms[-1] - ms[-2]) / (t[-1] - t[-2]), ms[-1] / t[-1])
        return float(ms[-1] + slope * (tokens - t[-1]))

    def knee_tokens(self, tolerance: float = 0.25) -> int:
        """Most tokens per forward that cost at most ``1 + tolerance`` times one token."""
        base = self(1)
        fits = [int(t) for t, m in zip(self.tokens, self.ms) if m <= (1 + tolerance) * base]
        return max(fits) if fits else 1


def speed(result: ReplayResult, cost: CostModel | None, batch: int = 1) -> float:
    """Expected tokens per millisecond (or accepted tokens per step without a cost model)."""
    if cost is None:
        return 1.0 + result.coverage
    return batch * (1.0 + result.coverage) / cost(batch * (1.0 + result.mean_nodes))


def choose_thresholds(episodes: Sequence[Episode], options: GraftOptions, budget: int, cost: CostModel | None,
                      vocab_size: int, grid: Sequence[float] = THRESHOLD_GRID, passes: int = 2
                      ) -> tuple[tuple[float, ...], list[dict]]:
    """Coordinate ascent over the checkpoint thresholds; returns the best and every evaluation."""
    checkpoints = options.checkpoints or DEFAULT_CHECKPOINTS
    best = list(options.thresholds or DEFAULT_THRESHOLDS)
    trials: list[dict] = []
    cache: dict[tuple[float, ...], float] = {}

    def evaluate(thresholds: list[float]) -> float:
        key = tuple(thresholds)
        if key not in cache:
            opts = msgspec.structs.replace(options, checkpoints=tuple(checkpoints), thresholds=key, budget=budget,
                                           adaptive_budget=False, calibration_path=None)
            r = replay(GraftProposer(None, opts, vocab_size=vocab_size), episodes, budget)
            cache[key] = speed(r, cost)
            trials.append({"thresholds": list(key), "tau": 1 + r.coverage, "mean_nodes": r.mean_nodes,
                           "objective": cache[key]})
        return cache[key]

    best_value = evaluate(best)
    for _ in range(passes):
        improved = False
        for c in range(len(best)):
            for value in grid:
                trial = best[:c] + [value] + best[c + 1:]
                v = evaluate(trial)
                if v > best_value * (1 + 1e-3):
                    best, best_value, improved = trial, v, True
        if not improved:
            break
    return tuple(best), trials


def budget_table(by_budget: dict[int, ReplayResult], cost: CostModel, batch_sizes: Sequence[int]) -> dict[int, int]:
    """For each batch size, the budget with the highest expected throughput (0 = no speculation)."""
    table = {}
    for n in batch_sizes:
        best_b, best_v = 0, n / cost(n)
        for b, r in sorted(by_budget.items()):
            v = speed(r, cost, n)
            if v > best_v:
                best_b, best_v = b, v
        table[int(n)] = best_b
    # non-increasing in the batch size, as the proposer enforces too
    sizes = sorted(table)
    for a, b in zip(sizes, sizes[1:]):
        table[b] = min(table[b], table[a])
    return table


def calibrate_from(episodes: Sequence[Episode], *, budget: int, vocab_size: int,
                   step_ms: dict[int, float] | None = None, options: GraftOptions | None = None,
                   batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> GraftCalibration:
    """The calibration from recorded episodes and (optionally) measured step costs; no engine needed."""
    options = options or GraftOptions()
    cost = CostModel(step_ms) if step_ms else None
    thresholds, trials = choose_thresholds(episodes, options, budget, cost, vocab_size)
    checkpoints = tuple(options.checkpoints or DEFAULT_CHECKPOINTS)
    chosen = msgspec.structs.replace(options, checkpoints=checkpoints, thresholds=thresholds, adaptive_budget=False,
                                     calibration_path=None)

    def run(b: int, **changes: Any) -> ReplayResult:
        opts = msgspec.structs.replace(chosen, budget=b, **changes)
        return replay(GraftProposer(None, opts, vocab_size=vocab_size), episodes, b)

    def summary(r: ReplayResult) -> dict:
        return {"tau": round(1 + r.coverage, 4), "mean_nodes": round(r.mean_nodes, 2),
                "propose_ms": round(1000 * r.seconds / max(r.steps, 1), 3)}

    variants = {f"position_{p}": run(budget, graft_position=p) for p in ("root", "deepest", "both")}
    variants["no_pruning"] = run(budget, prune=False)
    variants["no_grafting"] = run(budget, graft=False)
    report: dict[str, Any] = {
        "budget": budget, "episodes": len(episodes), "output_tokens": int(sum(len(e.output) for e in episodes)),
        "threshold_trials": trials, "variants": {k: summary(v) for k, v in variants.items()},
        "best_position": max(("root", "deepest", "both"), key=lambda p: speed(variants[f"position_{p}"], cost)),
    }
    table: dict[int, int] = {}
    knee = None
    if cost is not None:
        by_budget = {b: run(b) for b in BUDGET_GRID if b <= budget}
        by_budget[budget] = variants[f"position_{options.graft_position}"]
        table = budget_table(by_budget, cost, batch_sizes)
        knee = cost.knee_tokens()
        report["step_ms"] = {str(t): round(m, 3) for t, m in sorted(step_ms.items())}
        report["by_budget"] = {str(b): summary(r) for b, r in sorted(by_budget.items())}
    return GraftCalibration(version=CALIBRATION_VERSION, checkpoints=checkpoints, thresholds=thresholds,
                            budget_by_batch=table, knee_tokens=knee, report=report)


# --- engine side ------------------------------------------------------------------------------------------------------
def calibration_prompts(model: str, num_mt: int, num_he: int) -> list[str]:
    """Chat-formatted MT-Bench first turns and raw HumanEval prompts (the benchmark's prompt sets)."""
    from transformers import AutoTokenizer

    from vllm_treespec.tools.data import chat_prompt, human_eval, mt_bench

    tokenizer = AutoTokenizer.from_pretrained(model)
    return ([chat_prompt(tokenizer, q["turns"][0]) for q in mt_bench()[:num_mt]]
            + [q["turns"][0] for q in human_eval()[:num_he]])


def collect_episodes(llm: Any, prompts: Sequence[str], max_tokens: int, k: int = TOPK) -> list[Episode]:
    """Greedy outputs of the target without speculation, with its top-k at every output position."""
    from vllm import SamplingParams

    outputs = llm.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=k),
                           use_tqdm=False)
    episodes = []
    for o in outputs:
        out = o.outputs[0]
        if len(out.token_ids) < 2:
            continue
        ids = np.full((len(out.token_ids), k), -1, np.int32)
        probs = np.zeros((len(out.token_ids), k), np.float32)
        for j, position in enumerate(out.logprobs):
            top = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:k]
            ids[j, : len(top)] = [t for t, _ in top]
            probs[j, : len(top)] = [np.exp(lp.logprob) for _, lp in top]
        episodes.append(Episode(np.asarray(o.prompt_token_ids, np.int64), np.asarray(out.token_ids, np.int64),
                                ids, probs))
    return episodes


def measure_step_cost(llm: Any, prompts: Sequence[str], batch_sizes: Sequence[int], short: int = 4,
                      long: int = 20, repeats: int = 2) -> dict[int, float]:
    """Milliseconds per decode step with n requests (a forward of n tokens), from the time difference of ``long``
    and ``short`` output tokens (which cancels prefill), each the best of ``repeats``. A size whose difference is
    not positive (a noisy machine) is left out; :class:`CostModel` interpolates over it."""
    from vllm import SamplingParams

    cost = {}
    for n in batch_sizes:
        batch = [prompts[i % len(prompts)] for i in range(n)]
        best = {short: float("inf"), long: float("inf")}
        for _ in range(repeats):
            for m in (short, long):
                started = time.perf_counter()
                llm.generate(batch, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True), use_tqdm=False)
                best[m] = min(best[m], time.perf_counter() - started)
        step = (best[long] - best[short]) / (long - short)
        if step > 0:
            cost[int(n)] = 1000 * step
    return cost


def calibrate(model: str | None = None, out_path: str = "graft_calibration.json", *, budget: int = 32,
              num_mt: int = 8, num_he: int = 8, max_tokens: int = 128, measure_cost: bool = True,
              batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), options: dict | None = None,
              dtype: str = "float32") -> GraftCalibration:
    """Run the target once without speculation, replay, measure and write the calibration JSON to ``out_path``."""
    from vllm import LLM

    from vllm_treespec.tools.engine_env import cpu_memory_defaults
    from vllm_treespec.tools.models import ensure_smollm2

    cpu_memory_defaults()
    model = model or str(ensure_smollm2())
    opts = msgspec.convert(options or {}, GraftOptions)
    prompts = calibration_prompts(model, num_mt, num_he)
    llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=max(max(batch_sizes), len(prompts)),
              enforce_eager=True, seed=0, max_logprobs=TOPK)
    try:
        episodes = collect_episodes(llm, prompts, max_tokens)
        step_ms = measure_step_cost(llm, prompts, batch_sizes) if measure_cost else None
        vocab_size = llm.llm_engine.model_config.get_vocab_size()
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    calibration = calibrate_from(episodes, budget=budget, vocab_size=vocab_size, step_ms=step_ms, options=opts,
                                 batch_sizes=batch_sizes)
    with open(out_path, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(calibration), indent=1))
    return calibration


def calibrate_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-treespec graft calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default="graft_calibration.json", help="JSON file for the calibration_path option")
    parser.add_argument("--budget", type=int, default=32, help="nodes per tree at batch 1 (num_speculative_tokens)")
    parser.add_argument("--mt-bench", type=int, default=8, help="MT-Bench prompts")
    parser.add_argument("--human-eval", type=int, default=8, help="HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--no-cost", action="store_true", help="skip the step-cost measurement (no budget table)")
    parser.add_argument("--options", default="{}", help="graft options as JSON (sources, checkpoints, ...)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    cal = calibrate(args.model, args.out, budget=args.budget, num_mt=args.mt_bench, num_he=args.human_eval,
                    max_tokens=args.max_tokens, measure_cost=not args.no_cost, batch_sizes=args.batch_sizes,
                    options=msgspec.json.decode(args.options), dtype=args.dtype)
    print(f"wrote {args.out}: checkpoints {list(cal.checkpoints)}, thresholds {list(cal.thresholds)}, "
          f"budget by batch {cal.budget_by_batch or 'not measured'}")
    for name, v in cal.report["variants"].items():
        print(f"  {name:>16}: tau {v['tau']:.3f}, {v['mean_nodes']:.1f} nodes/step, propose {v['propose_ms']} ms")
    return 0
