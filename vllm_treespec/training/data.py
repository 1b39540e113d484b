"""Training data for an EAGLE-3 head: self-distillation on ShareGPT prompts.

Stage ``generate``: the target answers ShareGPT first turns greedily (vLLM, batched) so the head learns the
target's own continuations, the text it will draft at inference. Stage ``features``: the target re-reads
prompt + answer by teacher forcing (transformers) and we keep, per token, the aux hidden states of the chosen layers
and the final normed hidden state (the target's next-token distribution is recomputed from it during training).

Held out: ShareGPT prompts come from the seeded shuffle of :func:`vllm_treespec.tools.data.sharegpt` *after* position
``SHAREGPT_EVAL_PREFIX`` (benchmarks draw their ShareGPT prompts from the prefix); any prompt containing an MT-Bench
or HumanEval question is dropped. The last ``valid_fraction`` of the conversations is the validation slice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

#: benchmarks use sharegpt(limit <= this); training prompts start after it.
SHAREGPT_EVAL_PREFIX = 1000
FEATURES_FORMAT = 1


def _eval_texts() -> list[str]:
    from vllm_treespec.tools.data import human_eval, mt_bench

    texts = []
    for q in mt_bench() + human_eval():
        texts.extend(t.strip()[:200] for t in q["turns"])
    return [t for t in texts if len(t) >= 40]


def _training_questions(num: int, max_prompt_chars: int, first: int = SHAREGPT_EVAL_PREFIX
                        ) -> list[tuple[int, dict]]:
    """(position in ShareGPT's seeded shuffle, question) of the training prompts, from position ``first`` on."""
    from vllm_treespec.tools.data import sharegpt

    if first < SHAREGPT_EVAL_PREFIX:
        raise ValueError(f"--prompts-from {first}: training prompts start at position {SHAREGPT_EVAL_PREFIX} or later "
                         f"(benchmarks draw from the first {SHAREGPT_EVAL_PREFIX})")
    probes = _eval_texts()
    out = []
    for position, q in enumerate(sharegpt(seed=0)[first:], start=first):
        text = q["turns"][0]
        if not text.strip() or len(text) > max_prompt_chars or any(p in text for p in probes):
            continue
        out.append((position, q))
        if len(out) == num:
            break
    return out


def training_prompts(num: int, max_prompt_chars: int = 2000, first: int = SHAREGPT_EVAL_PREFIX) -> list[dict]:
    """ShareGPT first turns for training, outside the benchmark prefix and free of eval questions."""
    return [q for _position, q in _training_questions(num, max_prompt_chars, first)]


def training_prompt_span(num: int, max_prompt_chars: int = 2000, first: int = SHAREGPT_EVAL_PREFIX
                         ) -> tuple[int, int]:
    """``[first, stop)`` of ShareGPT's seeded shuffle that ``training_prompts(num)`` draws from: recorded in the head's
    config so that benchmarks can refuse prompts the head was trained on (:mod:`vllm_treespec.tools.held_out`)."""
    questions = _training_questions(num, max_prompt_chars, first)
    if not questions:
        return first, first
    return questions[0][0], questions[-1][0] + 1


def generate(model_dir: str, out_path: Path, num_prompts: int, max_tokens: int, batch: int = 64,
             first: int = SHAREGPT_EVAL_PREFIX) -> Path:
    """Greedy answers of the target to ``num_prompts`` training prompts from position ``first`` of the shuffle, as
    JSON lines ``{question_id, prompt_ids, output_ids}``. Resumable: finished question ids are skipped."""
    questions = [(q["question_id"], q["turns"][0]) for q in training_prompts(num_prompts, first=first)]
    return generate_answers(model_dir, questions, out_path, max_tokens, batch=batch)


def generate_answers(model_dir: str, questions: list[tuple[str, str]], out_path: Path, max_tokens: int,
                     batch: int = 64, max_model_len: int = 2048) -> Path:
    """Greedy answers (vLLM, bf16) to ``(question_id, user text)`` pairs, appended as JSON lines
    ``{question_id, prompt_ids, output_ids}``; question ids already in ``out_path`` are skipped."""
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_treespec.tools.data import chat_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    done = set()
    if out_path.exists():
        with open(out_path) as f:
            done = {json.loads(line)["question_id"] for line in f if line.strip()}
    todo = [q for q in questions if q[0] not in done]
    if not todo:
        return out_path
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=max_model_len, max_num_seqs=batch, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    try:
        with open(out_path, "a") as f, tqdm(total=len(todo), desc="generate", unit="prompt") as bar:
            for start in range(0, len(todo), batch * 2):
                chunk = todo[start: start + batch * 2]
                prompts = [chat_prompt(tokenizer, text) for _qid, text in chunk]
                outputs = llm.generate(prompts, params, use_tqdm=False)
                for (qid, _text), o in zip(chunk, outputs):
                    f.write(json.dumps({"question_id": qid, "prompt_ids": list(o.prompt_token_ids),
                                        "output_ids": list(o.outputs[0].token_ids)}) + "\n")
                f.flush()
                bar.update(len(chunk))
    finally:
        del llm
    return out_path


def length_batches(order, lengths, batch_tokens: int) -> list[list[int]]:
    """Consecutive items of ``order`` (sorted by length) grouped so each batch pads to at most ``batch_tokens``."""
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = int(lengths[i])
        if cur and max(cur_max, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    return batches


def extract_features(model_dir: str, conversations: Path, out_dir: Path, aux_layers: tuple[int, ...],
                     max_len: int = 640, dtype: str = "bfloat16", batch_tokens: int = 4096) -> Path:
    """Teacher forcing over the generated conversations. Writes ``tokens.npy`` (int32, all conversations
    concatenated), ``aux.npy`` ([T, len(aux_layers), H], bf16 stored as uint16), ``final.npy`` ([T, H]),
    ``loss_mask.npy`` (1 on answer tokens) and ``index.json`` (per-conversation offsets). Resumable as a whole."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    index_path = out_dir / "index.json"
    if index_path.exists():
        return out_dir
    rows = [json.loads(line) for line in open(conversations) if line.strip()]
    seqs, masks = [], []
    for r in rows:
        ids = (r["prompt_ids"] + r["output_ids"])[:max_len]
        if len(r["output_ids"]) < 8 or len(ids) <= len(r["prompt_ids"]) + 4:
            continue
        seqs.append(np.asarray(ids, np.int32))
        m = np.zeros(len(ids), np.uint8)
        m[len(r["prompt_ids"]):] = 1
        masks.append(m)
    lengths = np.array([len(s) for s in seqs])
    total = int(lengths.sum())
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    model.eval()
    hidden = model.config.hidden_size
    aux = np.lib.format.open_memmap(out_dir / "aux.npy.partial", "w+", np.uint16, (total, len(aux_layers), hidden))
    final = np.lib.format.open_memmap(out_dir / "final.npy.partial", "w+", np.uint16, (total, hidden))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    batches = length_batches(np.argsort(lengths), lengths, batch_tokens)  # similar lengths: little padding
    with torch.inference_mode(), tqdm(total=total, desc="features", unit="tok", unit_scale=True) as bar:
        for b in batches:
            n = max(len(seqs[i]) for i in b)
            ids = torch.zeros(len(b), n, dtype=torch.long)
            att = torch.zeros(len(b), n, dtype=torch.long)
            for j, i in enumerate(b):
                ids[j, : len(seqs[i])] = torch.from_numpy(seqs[i].astype(np.int64))
                att[j, : len(seqs[i])] = 1
            out = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
            # hidden_states[k] is the residual stream after k layers: vLLM's aux layer k.
            stack = torch.stack([out.hidden_states[k] for k in aux_layers], dim=2).to(torch.bfloat16)
            last = out.last_hidden_state.to(torch.bfloat16)
            for j, i in enumerate(b):
                s, e = offsets[i], offsets[i + 1]
                aux[s:e] = stack[j, : e - s].view(torch.uint16).numpy()
                final[s:e] = last[j, : e - s].view(torch.uint16).numpy()
            bar.update(int(att.sum()))
    aux.flush()
    final.flush()
    del aux, final
    os.replace(out_dir / "aux.npy.partial", out_dir / "aux.npy")
    os.replace(out_dir / "final.npy.partial", out_dir / "final.npy")
    np.save(out_dir / "tokens.npy", np.concatenate(seqs))
    np.save(out_dir / "loss_mask.npy", np.concatenate(masks))
    index_path.write_text(json.dumps({"format": FEATURES_FORMAT, "aux_layers": list(aux_layers), "hidden": hidden,
                                      "offsets": offsets.tolist(), "dtype": dtype, "model": str(model_dir)}))
    return out_dir
