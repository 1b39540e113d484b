"""The start-up sweep: time the real model's verify steps inside a worker.

A step of ``T`` tokens from ``R`` requests is driven through vLLM's own ``_dummy_run`` (the runner's warm-up and
profiling path, with attention metadata for ``R`` requests of ``T / R`` query tokens each over a ``context_len``
context) followed by the LM head on every row (a verify step computes logits for each draft position) and a greedy
argmax, all between device synchronisations. No request, scheduler or KV write is involved (the dummy run's slot
mapping is -1). Points are measured in interleaved rounds (drift and other load hit every point alike) after one
warm-up each, and the median per point is kept; a point whose warm-up already takes ``stop_ratio`` times the
single-token step (or more than the time budget allows) ends the grid: the model extrapolates beyond it with the
slope of the grid's upper knots, and no draft tree worth verifying lives there.

Entry points: :func:`measure_worker` for ``LLM.collective_rpc`` (returns plain data), :func:`step_cost_model` for
engine start-up (the cached curve, or a fresh sweep that is then cached). A proposer may expose
``cost_probe(num_reqs) -> Callable[[], None] | None``, one representative drafting call for ``num_reqs`` requests;
it is timed the same way into the record's ``drafters`` entry.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import msgspec
import numpy as np

from vllm_treespec.cost.model import (DEFAULT_CONTEXT_LEN, FORMAT_VERSION, CostCache, CostKey, CostRecord,
                                      StepCostModel, StepSample, context_excess, load_or_measure)
from vllm_treespec.device_defaults import device_name

logger = logging.getLogger("vllm.treespec")

#: dense where CPU GEMM paths switch (a few rows), sparse where time grows linearly; 6 | 7 and 12 | 13 straddle the
#: steps of our CPU linear's cost (register blocks of 6 rows: 8 and 9 rows cost the same, ~1.65x 5 rows), which a
#: line from 6 to 8 priced at half their height
TOKEN_GRID = (1, 2, 3, 4, 6, 7, 8, 12, 13, 16, 24, 32, 48, 64)
#: requests of the multi-request points; each is measured at 1 and 4 tokens per request
BATCH_REQS = (2, 4, 8)
BATCH_TOKENS_PER_REQ = (1, 4)
#: the context term's points: (tokens, requests) timed again at LONG_CONTEXT_FACTOR times the sweep's context (or
#: the longest the engine takes, if at least twice it)
LONG_CONTEXT_POINTS = ((1, 1), (8, 1), (16, 1))
LONG_CONTEXT_FACTOR = 8
DEFAULT_REPEATS = 5
DEFAULT_BUDGET_S = 20.0
DEFAULT_STOP_RATIO = 8.0
DRAFTER_REQS = (1, 2, 4, 8)
#: the sweep every tree engine runs at start-up when its curve is not cached: a few seconds (three rounds, their
#: timed steps within 3 s; warm-ups within as much again)
STARTUP_SWEEP = {"repeats": 3, "budget_s": 3.0}
#: a cached curve is checked at start-up on these (tokens, requests) points, and measured again when a point's
#: median time is more than SPOT_CHECK_TOLERANCE times off its prediction (either way): a curve measured while
#: the machine was busy, or a machine that changed, is not kept for good
SPOT_CHECK_POINTS = ((1, 1), (8, 1))
SPOT_CHECK_TOLERANCE = 1.5


def cost_key(runner: Any) -> CostKey:
    import torch
    import vllm

    from vllm_treespec.patches.cpu_gemm import kernel_summary

    model_config = runner.vllm_config.model_config
    return CostKey(model=str(model_config.model), dtype=str(model_config.dtype).removeprefix("torch."),
                   device=device_name(), vllm_version=str(vllm.__version__), torch_threads=torch.get_num_threads(),
                   linear=kernel_summary(), tree_attention=tree_attention_summary(),
                   execution=execution_summary(runner.vllm_config))


def execution_summary(vllm_config: Any) -> str:
    """How the engine runs its forward, as vLLM resolved it: its compilation mode (``NONE`` under
    ``enforce_eager``) with the compiler's backend, and its CUDA-graph mode, e.g. ``"compile=NONE cudagraph=NONE"``
    or, a CPU engine's default, ``"compile=DYNAMO_TRACE_ONCE/inductor cudagraph=NONE"``."""
    compilation = vllm_config.compilation_config
    mode, graphs = getattr(compilation, "mode", None), getattr(compilation, "cudagraph_mode", None)
    compiled = getattr(mode, "name", str(mode))
    if compiled != "NONE" and getattr(compilation, "backend", ""):
        compiled += f"/{compilation.backend}"
    return f"compile={compiled} cudagraph={getattr(graphs, 'name', graphs)}"


def tree_attention_summary() -> str:
    """The CPU tree-row kernel a curve was timed with (its tree steps' attention), "" off CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return ""
    from vllm_treespec.attn import cpu_kernel

    return cpu_kernel.kernel_summary()


def default_points(runner: Any, grid: Sequence[int] = TOKEN_GRID, batch_reqs: Sequence[int] = BATCH_REQS,
                   tokens_per_req: Sequence[int] = BATCH_TOKENS_PER_REQ) -> list[tuple[int, int]]:
    """(tokens, requests) of the sweep, within the runner's token and sequence limits."""
    max_tokens = int(runner.max_num_tokens)
    max_reqs = int(runner.scheduler_config.max_num_seqs)
    points = [(t, 1) for t in grid if t <= max_tokens]
    points += [(r * q, r) for r in batch_reqs for q in tokens_per_req if r <= max_reqs and r * q <= max_tokens]
    return list(dict.fromkeys(points))


class StepDriver:
    """Runs one dummy verify step of ``T`` tokens from ``R`` requests on the runner and returns its seconds.

    The dummy run's block table is empty (every block id 0), so its attention would read one block over and over
    from the cache: each request gets distinct blocks for the step (restored after), so that a row's attention reads
    as much memory as in a real step (at 1,000 tokens of context, one block read again cost a third of it)."""

    def __init__(self, runner: Any, context_len: int = DEFAULT_CONTEXT_LEN) -> None:
        self.runner = runner
        self.context_len = int(context_len)

    @contextlib.contextmanager
    def _distinct_blocks(self, num_reqs: int, seq_len: int) -> Iterator[None]:
        runner = self.runner
        try:
            table = runner.input_batch.block_table[0]
            num_blocks = int(runner.kv_cache_config.num_blocks)
            rows = table.block_table.np
        except (AttributeError, IndexError, TypeError):  # a runner without a paged cache: as vLLM sets it
            yield
            return
        per_req = min(-(-seq_len // int(table.block_size)), rows.shape[1])
        saved = rows[:num_reqs, :per_req].copy()
        # block 0 is vLLM's null block; wrap around the pool when the requests need more blocks than it has
        ids = 1 + np.arange(num_reqs * per_req) % max(num_blocks - 1, 1)
        rows[:num_reqs, :per_req] = ids.reshape(num_reqs, per_req)
        try:
            yield
        finally:
            rows[:num_reqs, :per_req] = saved

    def __call__(self, num_tokens: int, num_reqs: int = 1) -> float:
        import torch

        runner = self.runner
        if num_tokens % num_reqs:
            raise ValueError(f"{num_tokens} tokens do not split evenly over {num_reqs} requests")
        query_len = num_tokens // num_reqs
        saved = runner.uniform_decode_query_len
        runner.uniform_decode_query_len = query_len  # _dummy_run's per-request query length for uniform batches
        seq_len = max(self.context_len, query_len)
        try:
            with torch.inference_mode(), self._distinct_blocks(num_reqs, seq_len):
                runner._sync_device()
                started = time.perf_counter()
                hidden, _ = runner._dummy_run(num_tokens, force_attention=True, uniform_decode=True,
                                              skip_eplb=True, remove_lora=False,
                                              profile_seq_lens=seq_len)
                logits = runner.model.compute_logits(hidden[:num_tokens])
                if logits is not None:
                    logits.argmax(dim=-1)
                runner._sync_device()
                return time.perf_counter() - started
        finally:
            runner.uniform_decode_query_len = saved


def time_rounds(run: Callable[[int, int], float], points: Sequence[tuple[int, int]], repeats: int = DEFAULT_REPEATS,
                budget_s: float = DEFAULT_BUDGET_S, stop_ratio: float = DEFAULT_STOP_RATIO,
                keep: Iterable[tuple[int, int]] = ()) -> list[StepSample]:
    """Warm-up runs per point (cheapest first: the better of two, one if the first is already past the limit),
    dropping points past ``stop_ratio`` times the cheapest or beyond what ``budget_s`` allows for ``repeats``
    rounds (``keep``: points never dropped), then ``repeats`` interleaved rounds, each in a shuffled order. Once a
    point is past the limit, points with as many requests and more tokens are not run at all, and warm-ups stop
    when they have used ``budget_s`` (kept points excepted)."""
    keep = set(keep)
    warm: dict[tuple[int, int], float] = {}
    past_limit: dict[int, int] = {}  # requests -> fewest tokens found past the limit
    warming = 0.0
    for point in sorted(points):
        tokens, reqs = point
        if point not in keep and (tokens > past_limit.get(reqs, tokens) or warming > budget_s):
            continue
        first = run(*point)
        floor = min([first, *warm.values()])
        if first > stop_ratio * floor and point not in keep:
            warm[point] = first
            past_limit[reqs] = min(past_limit.get(reqs, tokens), tokens)
        else:
            second = run(*point)
            warm[point] = min(first, second)
            warming += second
        warming += first
    floor = min(warm.values())
    chosen, spent = [], 0.0
    for point in sorted(warm, key=lambda p: (p not in keep, warm[p])):
        cost = warm[point] * repeats
        if point not in keep and (warm[point] > stop_ratio * floor or spent + cost > budget_s):
            continue
        chosen.append(point)
        spent += cost
    samples = []
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(chosen)  # no point always follows the same one (caches, clocks)
        for point in chosen:
            samples.append(StepSample(point[0], point[1], run(*point)))
    return samples


def time_callable(fn: Callable[[], Any], repeats: int = DEFAULT_REPEATS, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure_drafter(probe: Callable[[int], Callable[[], Any] | None], reqs: Sequence[int] = DRAFTER_REQS,
                    repeats: int = DEFAULT_REPEATS) -> list[StepSample]:
    """The drafter's seconds per call for each batch size its ``cost_probe`` accepts (``num_tokens`` = requests)."""
    samples = []
    for r in reqs:
        fn = probe(r)
        if fn is not None:
            samples.append(StepSample(r, r, time_callable(fn, repeats)))
    return samples


def sweep(runner: Any, points: Sequence[tuple[int, int]] | None = None, held_out: Sequence[tuple[int, int]] = (),
          repeats: int = DEFAULT_REPEATS, context_len: int = DEFAULT_CONTEXT_LEN, budget_s: float = DEFAULT_BUDGET_S,
          stop_ratio: float = DEFAULT_STOP_RATIO) -> tuple[CostRecord, list[StepSample]]:
    """A fresh sweep on ``runner`` (and its drafter's probe, if it has one) as a cache record, plus the samples of
    the ``held_out`` points (timed in the same rounds, never dropped, not in the record)."""
    points = default_points(runner) if points is None else [(int(t), int(r)) for t, r in points]
    extra = [(int(t), int(r)) for t, r in held_out]
    started = time.perf_counter()
    timed = time_rounds(StepDriver(runner, context_len), list(dict.fromkeys(points + extra)), repeats, budget_s,
                        stop_ratio, keep=[(1, 1), *extra])
    apart = set(extra) - set(points)
    longer = _long_context_samples(runner, context_len, repeats, budget_s, stop_ratio)
    drafters = {}
    drafter = getattr(runner, "drafter", None)
    probe = getattr(drafter, "cost_probe", None)
    if callable(probe):
        max_reqs = int(runner.scheduler_config.max_num_seqs)
        drafted = measure_drafter(probe, [r for r in DRAFTER_REQS if r <= max_reqs], repeats)
        if drafted:
            drafters[type(drafter).__name__] = drafted
    logger.info("vllm_treespec: measured the step-cost curve in %.1f s (%d timed steps)",
                time.perf_counter() - started, len(timed))
    record = CostRecord(format_version=FORMAT_VERSION, key=cost_key(runner),
                        samples=[s for s in timed if (s.num_tokens, s.num_reqs) not in apart] + longer,
                        drafters=drafters, measured_at=time.time(), context_len=int(context_len))
    return record, [s for s in timed if (s.num_tokens, s.num_reqs) in apart]


def _long_context_samples(runner: Any, context_len: int, repeats: int, budget_s: float, stop_ratio: float
                          ) -> list[StepSample]:
    """The context term's samples: :data:`LONG_CONTEXT_POINTS` at ``LONG_CONTEXT_FACTOR`` times ``context_len`` (or
    the engine's longest, if at least twice it). None when the engine is shorter, or (one log line) when its dummy
    steps fail there: the curve is then fitted without the term, as before it existed."""
    long_context = min(LONG_CONTEXT_FACTOR * context_len, int(runner.max_model_len))
    if long_context < 2 * context_len:
        return []
    max_tokens = int(runner.max_num_tokens)
    try:
        timed = time_rounds(StepDriver(runner, long_context), [p for p in LONG_CONTEXT_POINTS if p[0] <= max_tokens],
                            repeats, budget_s, stop_ratio, keep=[(1, 1)])
    except Exception as e:  # noqa: BLE001 - the context term refines the curve; it must not cost the engine its budget
        logger.warning("vllm_treespec: could not time steps at %d tokens of context (%s: %s); the step-cost curve "
                       "has no context term", long_context, type(e).__name__, e)
        return []
    return [StepSample(s.num_tokens, s.num_reqs, s.seconds, long_context) for s in timed]


def spot_check(run: Callable[[int, int], float], record: CostRecord,
               points: Sequence[tuple[int, int]] = SPOT_CHECK_POINTS, tolerance: float = SPOT_CHECK_TOLERANCE,
               repeats: int = 3) -> str | None:
    """None when ``record``'s curve predicts ``run``'s step times at ``points`` within ``tolerance`` (a factor,
    either way; median of ``repeats`` after one warm-up), else what is off."""
    model = record.step_model()
    for tokens, reqs in points:
        run(tokens, reqs)
        measured = float(np.median([run(tokens, reqs) for _ in range(repeats)]))
        predicted = model.predict(tokens, reqs)
        if not 1 / tolerance <= measured / predicted <= tolerance:
            return (f"{tokens} tokens x {reqs} requests: {measured * 1e3:.1f} ms measured, "
                    f"{predicted * 1e3:.1f} ms cached")
    return None


def step_cost_model(runner: Any, cache: CostCache | None = None, refresh: bool = False,
                    **options: Any) -> tuple[StepCostModel, CostRecord]:
    """The engine's step-cost model: from the cache when it holds this engine's curve and a spot check of a few
    steps agrees with it, else measured (and cached when the sweep covered enough of the grid)."""
    driver = StepDriver(runner, options.get("context_len", DEFAULT_CONTEXT_LEN))
    record, _ = load_or_measure(cost_key(runner), lambda: sweep(runner, **options)[0], cache, refresh,
                                check=lambda cached: spot_check(driver, cached))
    return record.step_model(), record


def measure_worker(worker: Any, points: Sequence[Sequence[int]] | None = None, held_out: Sequence[Sequence[int]] = (),
                   **options: Any) -> dict[str, Any]:
    """For ``LLM.collective_rpc``: :func:`sweep` on this worker's runner as plain data: the record's fields plus
    ``held_out`` (samples) and ``seconds`` (the sweep's wall time)."""
    started = time.perf_counter()
    record, extra = sweep(worker.model_runner, points, held_out, **options)
    return {**msgspec.to_builtins(record), "held_out": msgspec.to_builtins(extra),
            "seconds": time.perf_counter() - started}


def relative_errors(model: StepCostModel, samples: Iterable[StepSample]) -> list[tuple[int, int, float, float, float]]:
    """(tokens, requests, measured median s, predicted s, relative error) per point timed at the model's reference
    context (the sweep's; :func:`context_errors` for the others)."""
    return [(t, r, measured, predicted, err) for t, r, _, measured, predicted, err in _errors(model, samples, True)]


def context_errors(model: StepCostModel, samples: Iterable[StepSample]
                   ) -> list[tuple[int, int, int, float, float, float]]:
    """(tokens, requests, context, measured median s, predicted s, relative error) per point timed at another
    context than the model's reference: how well the context term predicts them."""
    return _errors(model, samples, False)


def _errors(model: StepCostModel, samples: Iterable[StepSample], at_reference: bool
            ) -> list[tuple[int, int, int, float, float, float]]:
    """Per (tokens, requests, context) point at the model's reference context (or at the others): the measured
    median, the prediction (with the point's context term) and the relative error."""
    groups: dict[tuple[int, int, int], list[float]] = {}
    for s in samples:
        context = model.reference_context if s.context_len == 0 else s.context_len
        if (context == model.reference_context) == at_reference:
            groups.setdefault((s.num_tokens, s.num_reqs, context), []).append(s.seconds)
    rows = []
    for (t, r, c), times in sorted(groups.items()):
        measured = float(np.median(times))
        predicted = model.predict(t, r, context_excess(t, c, model.reference_context),
                                  request_excess=context_excess(r, c, model.reference_context))
        rows.append((t, r, c, measured, predicted, (predicted - measured) / measured if measured > 0 else math.nan))
    return rows
