"""``vllm-treespec bench``: is a speculative method exactly as correct as no speculation, and how much faster?

Offline (``LLM.generate``) comparison of speculative methods on question files in the ``question.jsonl`` format
(``question_id``, ``category``, ``turns``). Every method runs in one invocation on a fresh engine of its own, and
no speculation always runs first as the baseline. Per category and overall it reports

* tau: mean tokens committed per verify step, bonus included: ``1 + accepted / drafts`` from vLLM's spec-decode
  counters (vLLM counts a draft per request per step that had one, so steps where the proposer found nothing are
  not in the denominator);
* tok/step: output tokens per target forward over *all* steps, ``output / (output - accepted)`` (each forward commits
  one token plus the accepted drafts; the prefill counts as one). Unlike tau it charges a method for the steps it
  drafted nothing, so it compares a drafter that often stays silent (n-gram lookup) fairly with one that always
  drafts;
* per-position acceptance: ``vllm:spec_decode_num_accepted_tokens_per_pos[k] / drafts``;
* tok/s (output tokens / wall time of the generate calls) and decode tok/s (tokens after the first / time from
  the first to the last token of each generate call, from vLLM's request timestamps);
* speedup: tok/s over the baseline's tok/s, measured in the same invocation;
* norm. speedup: the same ratio with every engine brought to one speed. Engines of one configuration started
  minutes apart run up to a third apart on a small shared CPU, for their whole life, so three engines per method
  resolve a ratio to about +-15%. Each engine's worker times its plain forwards (one token per request, whatever
  the method: :mod:`vllm_treespec.patches.forward_times`) during the timed runs, with its context; each run's tok/s
  is scaled by its engine's plain forward at one context over the median of the invocation's engines, and the
  medians over repeats are compared as for speedup (a CPU engine at batch size 1 to 8 or so; none where an engine
  ran too few plain steps). One context, because a tree engine's gate chooses which steps run plain: one that left
  the long-context steps plain had looked slow by its median (:func:`engine_speeds`);
* identical: prompts whose greedy output is token-identical to the baseline's, every turn (temperature 0 only; an
  exactness check in fp32 only: in bf16 a batched forward can round differently from a one-token one).

Timed runs exclude a warm-up generation. With ``--repeats R`` every repeat runs on a fresh engine (so no proposer
state, such as suffix_tree's store of finished outputs, carries over), the repeats go round-robin over the methods
in reverse order every other round (A B, B A, ...: the machine's drift, and whatever the engine before leaves on it,
reach every method alike), and the median of the throughputs is reported. On a CPU engine this process (the
engine's front end), the engine core and the worker's helper threads (gloo, ZeroMQ) are pinned to the CPUs vLLM's
worker left free (``--cpu-affinity``).

``vllm-treespec bench serve ...`` is the online load sweep (:mod:`vllm_treespec.tools.bench_serve`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence, TypeVar

import numpy as np

from vllm_treespec.cost import trace
from vllm_treespec.cost.trace import TRACE_ENV
from vllm_treespec.tools.serving import off_the_workers_cpus

BASELINE = "none"
DEFAULT_METHODS = ('none;'
                   'ngram:{"num_speculative_tokens":5,"prompt_lookup_max":4,"prompt_lookup_min":2};'
                   'suffix:{"num_speculative_tokens":32};'
                   'suffix_tree:{"num_speculative_tokens":32};'
                   'ngram_tree:{"num_speculative_tokens":32};'
                   'graft:{"num_speculative_tokens":32}')
PROMPT_SET_ALIASES = {"human_eval": "humaneval", "mtbench": "mt_bench", "mt-bench": "mt_bench"}
#: vLLM methods that need a package vLLM does not depend on: (module, pip name).
OPTIONAL_DEPENDENCIES = {"suffix": ("arctic_inference", "arctic-inference")}
WARMUP_PROMPT = "Count from one to twenty in words, separated by commas."

METHODS_HELP = f"""\
methods: ';'-separated entries [LABEL=]METHOD[:JSON], where METHOD is 'none' (no speculation), a vLLM method
(ngram, suffix, ...), a tree method of vllm-treespec (suffix_tree, ngram_tree, static_tree, graft, ...) or a dotted
path to a TreeProposer subclass, and JSON is an object of speculative_config keys (num_speculative_tokens, vLLM's
options, the method's own options). LABEL names the row (default METHOD); use it to compare one method with
different options. 'none' is added first when missing. Quote the whole value in the shell, e.g.
  --methods 'none;ngram:{{"num_speculative_tokens":5,"prompt_lookup_max":4}};st16=suffix_tree:{{"num_speculative_tokens":16}}'
default: {DEFAULT_METHODS}"""


T = TypeVar("T")


ALLOW_TRAINING_PROMPTS_HELP = ("measure ShareGPT prompts a drafting head was trained on (refused by default: the "
                               "head has learned the target's answers to them, so they are not held out)")


class BenchError(ValueError):
    """A bad bench argument; the message says which and why."""


# ----------------------------------------------------------------------------------------------------------------
# Methods


@dataclass(frozen=True)
class MethodSpec:
    label: str
    method: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_baseline(self) -> bool:
        return self.method == BASELINE

    def speculative_config(self) -> dict[str, Any] | None:
        return None if self.is_baseline else {"method": self.method, **self.options}


_ENTRY = re.compile(r"\s*(?:([A-Za-z0-9_.\-]+)=)?([A-Za-z0-9_.\-]+)\s*")


def parse_methods(text: str) -> list[MethodSpec]:
    """Parse ``[LABEL=]METHOD[:JSON]`` entries separated by ``;`` (JSON may itself contain ``;`` inside strings)."""
    decoder = json.JSONDecoder()
    specs: list[MethodSpec] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\n;":
            pos += 1
        if pos >= len(text):
            break
        m = _ENTRY.match(text, pos)
        if not m or not m.group(2):
            raise BenchError(f"--methods: expected [LABEL=]METHOD[:JSON] at column {pos + 1}: {text[pos:pos + 40]!r}")
        label, method = m.group(1) or m.group(2), m.group(2)
        pos = m.end()
        options: Any = {}
        if text.startswith(":", pos):
            start = pos + 1
            while start < len(text) and text[start].isspace():
                start += 1
            try:
                options, pos = decoder.raw_decode(text, start)
            except json.JSONDecodeError as e:
                raise BenchError(f"--methods: options of {label!r} are not valid JSON ({e.msg} at column "
                                 f"{e.pos + 1})") from None
            if not isinstance(options, dict):
                raise BenchError(f"--methods: options of {label!r} must be a JSON object, got {options!r}")
            if "method" in options:
                raise BenchError(f"--methods: options of {label!r} must not repeat 'method'; write METHOD:JSON")
        while pos < len(text) and text[pos] in " \t\n":
            pos += 1
        if pos < len(text) and text[pos] != ";":
            raise BenchError(f"--methods: expected ';' after {label!r} at column {pos + 1}: {text[pos:pos + 40]!r}")
        if method == BASELINE and options:
            raise BenchError("--methods: 'none' takes no options")
        specs.append(MethodSpec(label, method, options))
    labels = [s.label for s in specs]
    duplicates = sorted({x for x in labels if labels.count(x) > 1})
    if duplicates:
        raise BenchError(f"--methods: duplicate label(s) {duplicates}; name rows with LABEL=METHOD:JSON")
    if not any(s.is_baseline for s in specs):
        specs.insert(0, MethodSpec(BASELINE, BASELINE))
    else:  # the baseline runs first, so a failure of it stops the bench before the slow part
        specs.sort(key=lambda s: not s.is_baseline)
    return specs


def never_drafting_labels(text: str, specs: list[MethodSpec]) -> list[str]:
    """The labels of ``--plain LABEL[,LABEL]`` (sorted): methods run with ``VLLM_TREESPEC_NEVER_DRAFT=1``. Each must
    name a speculative method among ``specs``."""
    labels = sorted({label.strip() for label in text.split(",") if label.strip()})
    drafting = {spec.label for spec in specs if not spec.is_baseline}
    unknown = sorted(set(labels) - drafting)
    if unknown:
        raise BenchError(f"--plain names {unknown}, which are not among the speculative methods' labels "
                         f"{sorted(drafting)}")
    return labels


def round_order(items: Sequence[T], round_index: int) -> list[T]:
    """The order of round ``round_index`` (from 0): as given in even rounds, reversed in odd ones (A B, B A, ...).
    This machine drifts by 10-20% over minutes, and a fixed order charges the drift, and whatever the previous
    engine leaves on the machine, to the same method every round."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


def unavailable_reason(spec: MethodSpec) -> str | None:
    """Why ``spec`` cannot run here (a missing optional package), or None."""
    need = OPTIONAL_DEPENDENCIES.get(spec.method)
    if need is None:
        return None
    import importlib.util

    module, pip_name = need
    return None if importlib.util.find_spec(module) else f"vLLM's {spec.method!r} method needs {pip_name}"


def check_method(spec: MethodSpec) -> None:
    """Validate a tree method's options now, so that a typo fails before the baseline has run for minutes."""
    if spec.is_baseline:
        return
    from vllm_treespec.config import TreeSpecConfigError, translate

    try:
        translate(spec.speculative_config(), None)
    except TreeSpecConfigError as e:
        raise BenchError(f"--methods {spec.label!r}: {e}") from None


# ----------------------------------------------------------------------------------------------------------------
# Prompts


def load_questions(names: Sequence[str], limit: int | None) -> dict[str, list[dict]]:
    """Questions grouped by category (in first-seen order), at most ``limit`` per category."""
    from vllm_treespec.tools.data import load_prompt_set

    by_category: dict[str, list[dict]] = {}
    for name in names:
        try:
            loaded = load_prompt_set(PROMPT_SET_ALIASES.get(name, name))
        except ValueError as e:  # unknown set, or a file not in the question.jsonl format (names the line)
            raise BenchError(f"--prompts: {e}") from None
        for q in loaded:
            questions = by_category.setdefault(q["category"], [])
            if limit is None or len(questions) < limit:
                questions.append(q)
    if not by_category:
        raise BenchError("--prompts selected no questions")
    return by_category


def check_held_out(questions: dict[str, list[dict]], specs: Sequence[MethodSpec], allow: bool) -> None:
    """Refuse (or, with ``allow``, warn about) ShareGPT prompts a drafting head was trained on."""
    from vllm_treespec.tools.held_out import heads_drafting, training_overlaps

    listed = [q for qs in questions.values() for q in qs]
    for overlap in training_overlaps(listed, heads_drafting((s.method, s.options) for s in specs)):
        message = f"--prompts: {overlap.describe()}; drafts there are not a held-out figure"
        if allow:
            print(f"warning: {message} (--allow-training-prompts)", file=sys.stderr)
            continue
        stop = overlap.span[1]
        count = sum(q["category"] == "sharegpt" for q in listed)
        raise BenchError(f"{message}. Take ShareGPT prompts outside that span (e.g. sharegpt[{stop}:{stop + count}]), "
                         "or pass --allow-training-prompts to measure them anyway")


@dataclass
class Conversation:
    """One question played turn by turn; ``answers`` holds the model's text and token ids of each turn so far."""

    question: dict
    answers: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        messages = []
        for t in range(turn):
            messages += [{"role": "user", "content": self.question["turns"][t]},
                         {"role": "assistant", "content": self.answers[t]}]
        return messages + [{"role": "user", "content": self.question["turns"][turn]}]


def load_tokenizer(model: str):
    """The model's tokenizer (prompt lengths are checked with it before any engine or server starts)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def check_prompt_lengths(tokenizer, questions: dict[str, list[dict]], max_model_len: int,
                         output_tokens: int = 1) -> int:
    """Refuse, before any engine starts, questions whose first turn does not fit the engine's context with
    ``output_tokens`` more (vLLM would fail the run at that prompt, after the methods before it had run; a server
    answers that request with an error, and the level counts one request fewer). Returns the longest first turn's
    tokens, chat template included."""
    too_long, longest = [], 0
    for category, listed in questions.items():
        for question in listed:
            text = tokenizer.apply_chat_template(Conversation(question).messages(0), tokenize=False,
                                                 add_generation_prompt=True)
            tokens = len(tokenizer(text).input_ids)
            longest = max(longest, tokens)
            if tokens + output_tokens > max_model_len:
                where = f" at {question['position']}" if "position" in question else ""
                too_long.append(f"{category} {question['question_id']!r}{where} ({tokens} tokens)")
    if too_long:
        outputs = "one output token" if output_tokens == 1 else f"{output_tokens} output tokens"
        raise BenchError(f"--prompts: {len(too_long)} question(s) do not fit --max-model-len {max_model_len} with "
                         f"{outputs}: {', '.join(too_long)}; take a slice without them or raise --max-model-len")
    return longest


# ----------------------------------------------------------------------------------------------------------------
# vLLM's spec-decode counters


@dataclass
class SpecCounters:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, -1)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(self.drafts + sign * other.drafts, self.draft_tokens + sign * other.draft_tokens,
                            self.accepted + sign * other.accepted, [x + sign * y for x, y in zip(a, b)])

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [x / self.drafts for x in self.accepted_per_pos] if self.drafts else []


_COUNTER_FIELDS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                   "vllm:spec_decode_num_accepted_tokens": "accepted"}


def read_counters(metrics: Iterable[Any]) -> SpecCounters:
    """Sum vLLM's spec-decode counters over label sets (engines) from ``llm.get_metrics()``."""
    counters = SpecCounters()
    for metric in metrics:
        name = _COUNTER_FIELDS.get(metric.name)
        if name is not None:
            setattr(counters, name, getattr(counters, name) + int(metric.value))
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            counters = counters + SpecCounters(accepted_per_pos=[int(v) for v in metric.values])
    return counters


# ----------------------------------------------------------------------------------------------------------------
# Running one method


@dataclass
class CategoryRun:
    """One timed pass over a category's questions."""

    elapsed_s: float = 0.0
    output_tokens: int = 0
    decode_tokens: int = 0
    decode_s: float = 0.0
    requests: int = 0
    counters: SpecCounters = field(default_factory=SpecCounters)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def __add__(self, other: CategoryRun) -> CategoryRun:
        return CategoryRun(self.elapsed_s + other.elapsed_s, self.output_tokens + other.output_tokens,
                           self.decode_tokens + other.decode_tokens, self.decode_s + other.decode_s,
                           self.requests + other.requests, self.counters + other.counters)


@dataclass
class MethodResult:
    spec: MethodSpec
    status: str = "ok"  # ok | skipped | failed
    reason: str = ""
    #: repeats[r][category]
    repeats: list[dict[str, CategoryRun]] = field(default_factory=list)
    #: outputs[category][question_id] = token ids per turn (first repeat)
    outputs: dict[str, dict[Any, list[list[int]]]] = field(default_factory=dict)
    engine_start_s: list[float] = field(default_factory=list)
    #: per repeat, the engine's budget trace summarised (:func:`vllm_treespec.cost.trace.summarize`), when it wrote one
    budget: list[dict[str, Any]] = field(default_factory=list)
    #: per repeat (one per entry of ``repeats``), the engine's plain forwards, (ms, context) each
    #: (:func:`plain_forwards`), None where it ran too few; :func:`summarize` reads every engine's speed from them
    #: at one context (:func:`engine_speeds`)
    plain_forwards: list[list[tuple[float, int | None]] | None] = field(default_factory=list)


def _batches(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run_category(llm, tokenizer, questions: list[dict], params, batch_size: int, max_turns: int,
                 progress=None) -> tuple[CategoryRun, dict[Any, list[list[int]]]]:
    """Play every question of one category (turn by turn, ``batch_size`` prompts per generate call) and measure."""
    run = CategoryRun()
    before = read_counters(llm.get_metrics())
    conversations = [Conversation(q) for q in questions]
    for turn in range(max_turns):
        active = [c for c in conversations if turn < len(c.question["turns"])]
        for batch in _batches(active, batch_size):
            prompts = [tokenizer.apply_chat_template(c.messages(turn), tokenize=False, add_generation_prompt=True)
                       for c in batch]
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            run.elapsed_s += time.perf_counter() - started
            first_ts, last_ts = [], []
            for conv, out in zip(batch, outputs):
                completion = out.outputs[0]
                conv.answers.append(completion.text)
                conv.token_ids.append(list(completion.token_ids))
                run.output_tokens += len(completion.token_ids)
                run.decode_tokens += max(len(completion.token_ids) - 1, 0)
                run.requests += 1
                if out.metrics is not None and out.metrics.first_token_ts > 0:
                    first_ts.append(out.metrics.first_token_ts)
                    last_ts.append(out.metrics.last_token_ts)
            if first_ts:
                run.decode_s += max(last_ts) - min(first_ts)
            if progress is not None:
                progress.update(len(batch))
    run.counters = read_counters(llm.get_metrics()) - before
    return run, {c.question["question_id"]: c.token_ids for c in conversations}


def build_llm(model: str, spec: MethodSpec, args: argparse.Namespace):
    from vllm import LLM

    return LLM(model=model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=max(args.batch_size, 1),
               speculative_config=spec.speculative_config(), disable_log_stats=False, seed=args.seed,
               enforce_eager=args.enforce_eager)


#: plain forwards an engine must have run for its speed to count. A median of 5 of a batch-1 engine's plain forwards
#: read within 1-3% of the median of all of them (90th percentile 3-8%; CL's three graft engines, 2026-12-06),
#: where engines of one configuration ran up to a third apart; a tree engine that verifies on nearly every step runs
#: only its budget's plain samples, one every PLAIN_SAMPLE_AGE steps (CM's and CO's third graft engines ran 10 and 6
#: after the warm-up, so had no figure at equal engine speed under 20)
MIN_PLAIN_FORWARDS = 5


def plain_forwards(llm, num_reqs: int, reset: bool = False) -> list[tuple[float, int | None]] | None:
    """The engine's plain forwards of ``num_reqs`` requests since the last reset, (ms, the requests' summed sequence
    lengths or None) each (:func:`~vllm_treespec.patches.forward_times.read_forward_times` in its worker); None, with
    one line, where they cannot be read, or where it ran fewer than :data:`MIN_PLAIN_FORWARDS` of them."""
    from vllm_treespec.patches.forward_times import read_forward_times

    try:
        reading = llm.collective_rpc(read_forward_times, kwargs={"reset": reset, "contexts": True})[0]
    except Exception as e:  # noqa: BLE001 - a reading is optional: the raw speedup stands without it
        print(f"bench: cannot read the engine's forward times ({type(e).__name__}: {e}); no norm. speedup",
              file=sys.stderr)
        return None
    forwards = reading.get(num_reqs, [])
    return [(float(ms), context) for ms, context in forwards] if len(forwards) >= MIN_PLAIN_FORWARDS else None


def engine_speeds(readings: list[list[tuple[float, int | None]] | None]) -> tuple[list[float | None], float | None,
                                                                                   float]:
    """Each engine's plain forward in ms at one context: (per reading, that context, ms per 1000 tokens of context).

    A plain forward's time grows with its context (every row attends to its request's whole sequence), and a tree
    engine's gate chooses which steps run plain: one that drafted on the short-context steps and left the long ones
    plain looked slower by its median than an engine of the same speed (CQ, docs/benchmarks.md: ``eagle_tree``'s
    20.6-22.4 ms against 17.3-18.0). The slope is the model's, dtype's and machine's, one for every engine of the
    invocation: fitted on all of them at once, each about its own mean (so an engine's speed does not enter it);
    each engine's speed is then the median of its forwards moved along that slope to the median context of all
    of them. Readings without contexts (or all at one) fall back to their median; None stays None."""
    points = [np.array(r, np.float64) for r in readings
              if r and all(context is not None for _, context in r)]
    slope, reference = 0.0, None
    if points:
        times = np.concatenate([p[:, 0] - p[:, 0].mean() for p in points])
        contexts = np.concatenate([p[:, 1] - p[:, 1].mean() for p in points])
        spread = float(np.dot(contexts, contexts))
        slope = max(float(np.dot(contexts, times)) / spread, 0.0) if spread > 0 else 0.0
        reference = float(np.median(np.concatenate([p[:, 1] for p in points])))
    speeds: list[float | None] = []
    for r in readings:
        if not r:
            speeds.append(None)
        elif reference is None or any(context is None for _, context in r):
            speeds.append(float(np.median([ms for ms, _ in r])))
        else:
            speeds.append(float(np.median([ms - slope * (context - reference) for ms, context in r])))
    return speeds, reference, slope * 1000.0


def run_repeat(model: str, tokenizer, result: MethodResult, questions: dict[str, list[dict]],
               args: argparse.Namespace, repeat: int, progress=None) -> None:
    """One timed repeat of one method on a fresh engine (so no proposer state, such as suffix_tree's store of
    finished outputs, carries over), appended to ``result``; the first repeat's outputs are kept for the lossless
    check."""
    from vllm import SamplingParams

    from vllm_treespec.patches import forward_times

    spec = result.spec
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed if args.temperature > 0 else None)
    trace_path = Path(args.out) / f"budget-{spec.label}-r{repeat + 1}.jsonl"
    trace.clear(trace_path)
    os.environ[TRACE_ENV] = str(trace_path)  # read by the engine's worker when its budget is built
    os.environ[forward_times.FORWARD_TIMES_ENV] = "1"  # its workers time their plain forwards (norm. speedup)
    forward_times.install()  # in this process too, for an in-process engine (the plugin registered before)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc ships the reading by pickle
    started = time.perf_counter()
    try:
        llm = build_llm(model, spec, args)
    finally:
        os.environ.pop(TRACE_ENV, None)
        os.environ.pop(forward_times.FORWARD_TIMES_ENV, None)
    # this front end, the engine core and the worker's helper threads off the worker's cores while it runs
    placement = off_the_workers_cpus(os.getpid()) if args.cpu_affinity == "reserved" else contextlib.nullcontext()
    try:
        with placement:
            result.engine_start_s.append(time.perf_counter() - started)
            warmup = tokenizer.apply_chat_template([{"role": "user", "content": WARMUP_PROMPT}], tokenize=False,
                                                   add_generation_prompt=True)
            llm.generate([warmup] * max(args.batch_size, 1), SamplingParams(temperature=0, max_tokens=32),
                         use_tqdm=False)
            plain_forwards(llm, 1, reset=True)  # the engine's speed counts from here
            runs: dict[str, CategoryRun] = {}
            for category, qs in questions.items():
                if progress is not None:
                    progress.set_postfix_str(f"{spec.label} {category}")
                runs[category], outputs = run_category(llm, tokenizer, qs, params, args.batch_size, args.turns,
                                                       progress)
                if repeat == 0:
                    result.outputs[category] = outputs
            result.repeats.append(runs)
            result.plain_forwards.append(plain_forwards(llm, max(args.batch_size, 1)))
    finally:
        del llm
        gc.collect()
    paths = trace.files(trace_path)
    if paths:  # the warm-up's steps are in it too: a few of hundreds
        result.budget.append({**trace.summarize(trace.read(paths)), "files": [str(p) for p in paths]})


def run_round_robin(model: str, tokenizer, specs: list[MethodSpec], questions: dict[str, list[dict]],
                    args: argparse.Namespace) -> list[MethodResult]:
    """Every method's repeats, interleaved: repeat r of every method runs before repeat r+1 of any, in
    :func:`round_order` (the baseline first in the first round, last in the second, ...), so that the machine's
    drift over minutes reaches every method alike. A method that fails keeps its message and runs no further
    repeats; the others go on."""
    from tqdm import tqdm

    results = [MethodResult(spec) for spec in specs]
    for result in results:
        reason = unavailable_reason(result.spec)
        if reason:
            print(f"bench: skipping {result.spec.label}: {reason}", file=sys.stderr)
            result.status, result.reason = "skipped", reason
    runnable = [r for r in results if r.status == "ok"]
    per_repeat = sum(min(len(q["turns"]), args.turns) for qs in questions.values() for q in qs)
    with tqdm(total=per_repeat * args.repeats * len(runnable), desc="bench", unit="req", file=sys.stderr,
              dynamic_ncols=True) as progress:
        for repeat in range(args.repeats):
            for result in round_order(runnable, repeat):
                if result.status != "ok":
                    continue
                try:
                    run_repeat(model, tokenizer, result, questions, args, repeat, progress)
                except Exception as e:  # one broken method must not lose the others' results
                    if result.spec.is_baseline:
                        raise
                    print(f"bench: {result.spec.label} failed: {type(e).__name__}: {e}", file=sys.stderr)
                    result.status, result.reason = "failed", f"{type(e).__name__}: {e}"
                    result.repeats.clear()
                    result.plain_forwards.clear()
    return results


# ----------------------------------------------------------------------------------------------------------------
# Summary


OVERALL = "overall"


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _lossless(result: MethodResult, baseline: MethodResult, category: str) -> tuple[int, int]:
    ours, ref = result.outputs.get(category, {}), baseline.outputs.get(category, {})
    same = sum(1 for qid, tokens in ours.items() if ref.get(qid) == tokens)
    return same, len(ours)


def summarize(results: list[MethodResult], temperature: float) -> list[dict[str, Any]]:
    """One row per (method, category) and per method overall, as plain data (what the JSON and the table show)."""
    baseline = next(r for r in results if r.spec.is_baseline)
    categories = list(baseline.repeats[0]) if baseline.repeats else []

    def runs_of(result: MethodResult, category: str) -> list[CategoryRun]:
        if category == OVERALL:
            total = []
            for rep in result.repeats:
                acc = CategoryRun()
                for run in rep.values():
                    acc = acc + run
                total.append(acc)
            return total
        return [rep[category] for rep in result.repeats if category in rep]

    base_speed = {c: _median([r.tok_per_s for r in runs_of(baseline, c)]) for c in categories + [OVERALL]}
    # every engine's plain forward at one context, by method label (labels are unique), one per repeat
    ok = [r for r in results if r.status == "ok"]
    speeds, context, slope = engine_speeds([f for r in ok for f in r.plain_forwards])
    engine_ms: dict[str, list[float | None]] = {}
    for r in ok:
        engine_ms[r.spec.label], speeds = speeds[: len(r.plain_forwards)], speeds[len(r.plain_forwards):]
    readings = [ms for values in engine_ms.values() for ms in values if ms]
    reference_ms = _median(readings) if readings else None

    def normalised_speed(result: MethodResult, category: str) -> float | None:
        """Median over repeats of tok/s scaled to an engine of the median reading (None unless every one of the
        method's engines has a reading)."""
        runs, values = runs_of(result, category), engine_ms[result.spec.label]
        if reference_ms is None or None in values or len(runs) != len(values):
            return None
        return _median([run.tok_per_s * ms / reference_ms for run, ms in zip(runs, values)])

    base_normalised = {c: normalised_speed(baseline, c) for c in categories + [OVERALL]}
    rows = []
    for result in results:
        if result.status != "ok":
            rows.append({"method": result.spec.label, "category": OVERALL, "status": result.status,
                         "reason": result.reason})
            continue
        for category in categories + [OVERALL]:
            runs = runs_of(result, category)
            counters = SpecCounters()
            for run in runs:
                counters = counters + run.counters
            speed = _median([r.tok_per_s for r in runs])
            normalised = normalised_speed(result, category)
            row = {
                "method": result.spec.label, "category": category, "status": "ok",
                "requests": runs[0].requests if runs else 0,
                "output_tokens": runs[0].output_tokens if runs else 0,
                "tau": counters.tau,
                "tokens_per_step": tokens_per_forward(sum(r.output_tokens for r in runs), counters.accepted),
                "acceptance_per_pos": counters.acceptance_per_pos,
                "drafts": counters.drafts, "draft_tokens": counters.draft_tokens, "accepted_tokens": counters.accepted,
                "tok_per_s": speed,
                "decode_tok_per_s": _median([r.decode_tok_per_s for r in runs]),
                "tok_per_s_repeats": [r.tok_per_s for r in runs],
                "speedup": speed / base_speed[category] if base_speed.get(category) else None,
                "plain_forward_ms_repeats": list(engine_ms[result.spec.label]),
                **({"plain_forward_context": context, "plain_forward_ms_per_1000_context": slope}
                   if context is not None else {}),
                "normalised_tok_per_s": normalised,
                "normalised_speedup": normalised / base_normalised[category]
                if normalised is not None and base_normalised.get(category) else None,
            }
            if temperature == 0 and not result.spec.is_baseline:
                if category == OVERALL:
                    pairs = [_lossless(result, baseline, c) for c in categories]
                    same, total = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
                else:
                    same, total = _lossless(result, baseline, category)
                row["lossless"] = {"identical": same, "prompts": total}
            rows.append(row)
    return rows


def tokens_per_forward(output_tokens: float, accepted: float) -> float | None:
    """Output tokens per target forward over all steps: each forward commits one token plus its accepted drafts."""
    return output_tokens / (output_tokens - accepted) if output_tokens > accepted else None


def budget_lines(results: list[MethodResult]) -> str:
    """Per method with a step budget, per repeat (the budget trace): the share of engine steps that verified drafts,
    repeat 1's nodes admitted and accepted per such step, nodes offered per priced proposal and what taught the
    acceptance calibration, the tokens those steps were expected to commit against those they did (:func:`vllm_treespec.cost.trace.
    expected_vs_realized`: above 1, the calibrated acceptance promised more than the target gave), and its decode
    steps' speed against its own plain steps' (:func:`vllm_treespec.cost.trace.against_own_plain_steps`: what the
    drafted steps gained over those the gate left plain)."""
    lines = []
    for result in results:
        shares = [f"{100 * trace.verifying_share(b):.0f}% of {b['steps']}" for b in result.budget
                  if trace.verifying_share(b) is not None]
        if shares:
            own = [f"{b['own_plain']['ratio']:.2f}x" for b in result.budget if b.get("own_plain")]
            honest = [f"{b['expected_vs_realized']['ratio']:.2f}" for b in result.budget
                      if b.get("expected_vs_realized")]
            first = result.budget[0]
            offered = (f"; {first['offered_per_offering_step']:.1f} nodes offered per priced proposal, "
                       f"calibration taught by {first['learned_nodes']} verified and {first['unverified_nodes']} "
                       f"left-out nodes" if first.get("offering_steps") else "")
            lines.append(f"{result.spec.label}: steps that verified drafts {' / '.join(shares)} "
                         f"(repeat 1: {first['admitted_per_verifying_step']:.1f} nodes admitted and "
                         f"{first['accepted_per_verifying_step']:.2f} drafts accepted per such step{offered})"
                         + (f"; their expected / committed tokens {' / '.join(honest)}" if honest else "")
                         + (f"; decode steps against the engine's own plain steps {' / '.join(own)}" if own else ""))
    return ("\n\nstep budget (VLLM_TREESPEC_BUDGET_TRACE):\n" + "\n".join(lines)) if lines else ""


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[dict[str, Any]], positions: int = 4, dtype: str = "float32") -> str:
    header = ["method", "category", "reqs", "tau", "tok/step", f"accept@1..{positions}", "tok/s", "decode tok/s",
              "speedup", "norm. speedup", "identical"]
    table = [header]
    notes = []
    for row in rows:
        if row["status"] != "ok":
            notes.append(f"{row['method']}: {row['status']} ({row['reason']})")
            continue
        accept = "/".join(f"{a:.2f}" for a in row["acceptance_per_pos"][:positions]) or "-"
        lossless = row.get("lossless")
        table.append([row["method"], row["category"], str(row["requests"]), _fmt(row["tau"], ".2f"),
                      _fmt(row.get("tokens_per_step"), ".2f"), accept,
                      _fmt(row["tok_per_s"], ".1f"), _fmt(row["decode_tok_per_s"], ".1f"),
                      _fmt(row["speedup"], ".2f") + ("x" if row["speedup"] is not None else ""),
                      _fmt(row.get("normalised_speedup"), ".2f") + ("x" if row.get("normalised_speedup") else ""),
                      f"{lossless['identical']}/{lossless['prompts']}" if lossless else "-"])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in table]
    lines.insert(1, "-" * len(lines[0]))
    readings = [ms for row in rows if row["status"] == "ok" and row["category"] == OVERALL
                for ms in row.get("plain_forward_ms_repeats") or [] if ms]
    if readings:
        at = next((row for row in rows if row.get("plain_forward_context") is not None), None)
        where = "" if at is None else (f" at {at['plain_forward_context']:.0f} tokens of context (moved along "
                                       f"{at['plain_forward_ms_per_1000_context']:.2f} ms per 1000)")
        notes.append(f"norm. speedup: each run's tok/s x its engine's plain forward{where} / the median engine's "
                     f"({_median(readings):.1f} ms; engines {min(readings):.1f}-{max(readings):.1f} ms)")
    if dtype != "float32" and any(row.get("lossless") for row in rows):
        notes.append(f"identical: informational in {dtype} (batched and one-token forwards may round differently); "
                     "exactness is checked in float32")
    return "\n".join(lines + notes)


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """speedup.png and tau.png (bars per category, one per method) and acceptance.png (overall, per position)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    methods = list(dict.fromkeys(r["method"] for r in ok))
    categories = list(dict.fromkeys(r["category"] for r in ok))
    paths = []
    for key, title, fname in (("speedup", "speedup vs no speculation", "speedup.png"),
                              ("tau", "tau: tokens per verify step (bonus included)", "tau.png")):
        shown = [m for m in methods if key == "speedup" or any(r["method"] == m and r.get(key) for r in ok)]
        fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(categories) + 2), 4.5))
        width = 0.8 / max(len(shown), 1)
        for i, method in enumerate(shown):
            values = {r["category"]: r.get(key) for r in ok if r["method"] == method}
            xs = [c + (i - (len(shown) - 1) / 2) * width for c in range(len(categories))]
            ax.bar(xs, [values.get(c) or 0.0 for c in categories], width, label=method,
                   color=f"C{methods.index(method) % 10}")  # one colour per method across plots
        if key == "speedup":
            ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in ok:
        if row["category"] == OVERALL and row["acceptance_per_pos"]:
            ax.plot(range(1, len(row["acceptance_per_pos"]) + 1), row["acceptance_per_pos"], marker=".",
                    label=row["method"], color=f"C{methods.index(row['method']) % 10}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_title("per-position acceptance (overall)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out_dir / "acceptance.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-treespec bench", description=__doc__, epilog=METHODS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", default="mt_bench,humaneval",
                        help="comma-separated prompt sets (mt_bench, humaneval, sharegpt) or question.jsonl paths; "
                             "NAME[START:STOP] takes a slice (sharegpt: of its seeded shuffle), e.g. sharegpt[500:540]")
    parser.add_argument("--limit", type=int, default=None, help="at most N questions per category")
    parser.add_argument("--allow-training-prompts", action="store_true", help=ALLOW_TRAINING_PROMPTS_HELP)
    parser.add_argument("--turns", type=int, default=1,
                        help="turns to play per question (MT-Bench has 2; later turns see the model's own answers)")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help="methods to compare (syntax below)")
    parser.add_argument("--dtype", default="float32", help="float32 makes greedy outputs exactly comparable")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per generate call")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the lossless check needs it)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip torch.compile (starts in seconds instead of minutes on a cold compile cache)")
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats, each on a fresh engine; median reported")
    parser.add_argument("--cpu-affinity", choices=("reserved", "os"), default="reserved",
                        help="CPU engine: 'reserved' (default) pins this process (the engine's front end), the "
                        "engine core and the worker's helper threads (gloo, ZeroMQ) to the CPUs vLLM's worker left "
                        "free, off the worker's; 'os' leaves placement to the OS (they then take turns with the "
                        "worker's thread)")
    parser.add_argument("--out", default="bench_out", help="folder for results.json and the PNG plots")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's INFO logs")
    return parser


def _check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "max_tokens", "repeats", "turns", "max_model_len"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 1:
        raise BenchError(f"--limit must be >= 1, got {args.limit}")
    if args.temperature < 0:
        raise BenchError(f"--temperature must be >= 0, got {args.temperature}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except BenchError as e:
        print(f"vllm-treespec bench: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _check_args(args)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm_treespec.tools.engine_env import cpu_memory_defaults

    cpu_memory_defaults()
    specs = parse_methods(args.methods)
    for spec in specs:
        check_method(spec)
    questions = load_questions([p.strip() for p in args.prompts.split(",") if p.strip()], args.limit)
    check_held_out(questions, specs, args.allow_training_prompts)
    if args.model is None:
        from vllm_treespec.tools.models import ensure_smollm2

        args.model = str(ensure_smollm2())
    tokenizer = load_tokenizer(args.model)
    check_prompt_lengths(tokenizer, questions, args.max_model_len)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"bench: {sum(map(len, questions.values()))} questions in {len(questions)} categories, "
          f"methods {[s.label for s in specs]}, model {args.model} ({args.dtype})", file=sys.stderr)

    results = run_round_robin(args.model, tokenizer, specs, questions, args)

    rows = summarize(results, args.temperature)
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "verbose"},
        "categories": {c: len(qs) for c, qs in questions.items()},
        "methods": [{"label": r.spec.label, "method": r.spec.method, "speculative_config": r.spec.speculative_config(),
                     "status": r.status, "reason": r.reason, "engine_start_s": r.engine_start_s,
                     "budget": r.budget} for r in results],
        "rows": rows,
    }
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    table = format_table(rows, dtype=args.dtype) + budget_lines(results)
    (out_dir / "table.txt").write_text(table + "\n")
    print(table)
    paths = plot(rows, out_dir)
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'table.txt'}, " + ", ".join(str(p) for p in paths))
    broken = [r for r in rows if r.get("lossless") and r["category"] == OVERALL
              and r["lossless"]["identical"] != r["lossless"]["prompts"]]
    return 1 if broken and args.dtype == "float32" else 0


if __name__ == "__main__":
    raise SystemExit(main())
