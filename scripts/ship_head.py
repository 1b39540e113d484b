"""Ship a trained EAGLE-3 head for the embedded SmolLM2 model: copy it into the package
(``vllm_treespec/heads/eagle3-smollm2-135m/``, package data; committed to git as a normal file), after checking it.

    .venv/bin/python scripts/ship_head.py [SRC]      # SRC default: <cache>/eagle3-smollm2-135m (train-eagle's -o)

Checks, each failing with a message: SRC holds ``config.json`` and ``model.safetensors`` of an EAGLE-3 head (not a
KV-aware one) that loads with SmolLM2's embedding; its target is SmolLM2 (architecture, vocabulary, hidden size,
layers); floating-point weights are bf16; config + weights weigh at most 20 MB. The target is recorded in
config.json (``treespec_target``) if the trainer did not record it, and the training record's local target path is
replaced by the target's name. Only ``config.json`` and ``model.safetensors`` are copied; ``MODEL_CARD.md`` stays,
and the facts it needs (command, data, steps, time, held-out accuracy) are printed from the training record.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

FILES = ("config.json", "model.safetensors")


def fail(message: str) -> int:
    print(f"ship_head: {message}", file=sys.stderr)
    return 1


def check_dtypes(weights: Path) -> list[str]:
    """Names of floating-point tensors that are not bf16."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as f:
        tensors = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    return [f"{name} ({dtype})" for name, dtype in tensors.items() if dtype in ("F16", "F32", "F64")]


def card_facts(cfg: dict) -> list[str]:
    """The model card's numbers, from the trainer's record in config.json."""
    record = cfg.get("treespec_training") or {}
    if not record:
        return ["(config.json has no treespec_training record: fill the card from the training log)"]
    final = record.get("final_valid") or {}
    return [f"training data: {record.get('training_data')}",
            f"train conversations / tokens: {record.get('train_conversations')} / {record.get('train_tokens')}; "
            f"held-out conversations: {record.get('valid_conversations')}",
            f"steps: {record.get('steps')} of {record.get('total_steps')}; ttt steps {record.get('ttt_steps')}; "
            f"draft vocabulary {record.get('draft_vocab_size')}; parameters {record.get('parameters')}",
            f"time: generate {record.get('generate_s')} s, features {record.get('features_s')} s, "
            f"train {record.get('wall_s')} s",
            f"held-out (last validation, step {final.get('step')}): top-1 accuracy per depth {final.get('valid_acc')}, "
            f"loss {final.get('valid_loss')}"]


def main(argv=None) -> int:
    from vllm_treespec.eagle.default_head import MAX_SHIPPED_HEAD_BYTES, shipped_head_path, trained_head_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", nargs="?", default=None, help=f"trained head folder (default {trained_head_path()})")
    parser.add_argument("--dest", default=None, help=f"where to copy it (default {shipped_head_path()}; tests)")
    args = parser.parse_args(argv)
    src = Path(args.src) if args.src else trained_head_path()
    dest = Path(args.dest) if args.dest else shipped_head_path()
    missing = [name for name in FILES if not (src / name).is_file()]
    if missing:
        return fail(f"{src} lacks {missing}: expected a folder written by `vllm-treespec train-eagle -o {src}`")
    cfg = json.loads((src / "config.json").read_text())
    from vllm_treespec.eagle.kv_head import is_kv_aware_config

    if is_kv_aware_config(cfg):
        return fail(f"{src} is a KV-aware head; the shipped head is the EAGLE-3 one (train-eagle --mode hidden)")

    from vllm_treespec.eagle.target import TARGET_KEY, identity_from_hf_config, mismatches, target_record
    from vllm_treespec.tools.models import SMOLLM2_NAME, ensure_smollm2

    target_dir = ensure_smollm2()
    target_cfg = json.loads((target_dir / "config.json").read_text())
    served = identity_from_hf_config(target_cfg, SMOLLM2_NAME)
    why = mismatches(cfg, served)  # before recording the target: what the head's own shapes say
    if why:
        return fail(f"{src} was not trained for {served.describe()}: {'; '.join(why)}")
    cfg.setdefault(TARGET_KEY, target_record(target_cfg, SMOLLM2_NAME))
    if isinstance(cfg.get("treespec_training"), dict):  # a path on the training machine means nothing elsewhere
        cfg["treespec_training"]["target"] = SMOLLM2_NAME
    not_bf16 = check_dtypes(src / "model.safetensors")
    if not_bf16:
        return fail(f"{src}/model.safetensors has tensors that are not bf16: {not_bf16[:5]} (train-eagle exports bf16)")

    import torch

    from vllm_treespec.eagle.model import Eagle3Head
    from vllm_treespec.training.train import _target_tensors

    embed, _ = _target_tensors(str(target_dir))
    Eagle3Head.load(src, embed=embed, dtype=torch.float32)  # raises if the weights do not fit the config

    config_text = json.dumps(cfg, indent=2) + "\n"
    size = len(config_text.encode()) + (src / "model.safetensors").stat().st_size
    if size > MAX_SHIPPED_HEAD_BYTES:
        return fail(f"config + weights weigh {size / 1e6:.2f} MB, over the {MAX_SHIPPED_HEAD_BYTES / 1e6:.0f} MB "
                    f"limit for the shipped head")

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".ship-") as tmp:
        (Path(tmp) / "config.json").write_text(config_text)
        shutil.copyfile(src / "model.safetensors", Path(tmp) / "model.safetensors")
        for name in FILES:
            os.chmod(Path(tmp) / name, 0o644)
            os.replace(Path(tmp) / name, dest / name)
    print(f"ship_head: copied {src} -> {dest} ({size / 1e6:.2f} MB; target {served.describe()})")
    print("model card facts (fill the TODOs of MODEL_CARD.md):")
    for line in card_facts(cfg):
        print(f"  {line}")
    print(f"then: git add {dest / 'config.json'} {dest / 'model.safetensors'} {dest / 'MODEL_CARD.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
