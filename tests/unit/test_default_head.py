"""The default EAGLE-3 head (trained into the cache folder, else shipped with the package) and the check that a head
was trained for the served model, without an engine: resolution, ``vllm-treespec model smollm2-eagle3``, the refusal
of a mismatched head by eagle_tree / kv_aware / graft, graft's fallback to retrieval-only, the trainer's record."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from eagle_helpers import HIDDEN, VOCAB, small_head
from vllm_treespec.eagle import default_head
from vllm_treespec.eagle.target import (TARGET_KEY, HeadTargetMismatch, ModelIdentity, check_head_target,
                                        head_config, identity_from_hf_config, mismatches, target_record)

SMOLLM2 = ModelIdentity("SmolLM2-135M-Instruct", "LlamaForCausalLM", 49152, 576, 30)
TINY = ModelIdentity("tiny-llama", "LlamaForCausalLM", 49152, 128, 2)


def fake_vllm_config(architecture="LlamaForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, layers=8,
                     model="served-model"):
    hf_config = SimpleNamespace(architectures=[architecture], vocab_size=vocab_size, hidden_size=hidden_size,
                                num_hidden_layers=layers)
    model_config = SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config, model=model,
                                   get_total_num_hidden_layers=lambda: layers)
    return SimpleNamespace(model_config=model_config)


def record_target(folder, **fields) -> None:
    """Write a trainer's target record into a head's config.json."""
    cfg = head_config(folder)
    cfg[TARGET_KEY] = {"name": "small-target", "architecture": "LlamaForCausalLM", "vocab_size": VOCAB,
                       "hidden_size": HIDDEN, "num_hidden_layers": 8, **fields}
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def head_dirs(tmp_path, monkeypatch):
    """An empty cache folder and an empty shipped-heads folder; returns (trained path, shipped path)."""
    monkeypatch.setenv("VLLM_TREESPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_head, "SHIPPED_HEADS_DIR", tmp_path / "package-heads")
    monkeypatch.setattr(default_head, "_logged", set())
    return default_head.trained_head_path(), default_head.shipped_head_path()


def place_head(tmp_path, folder, seed=0):
    """A small random head saved into ``folder`` (config.json + model.safetensors)."""
    _, path = small_head(tmp_path / f"src-{seed}", seed=seed)
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tmp_path / f"src-{seed}" / "head" / name).read_bytes())
    return folder


@pytest.fixture
def tree_logs():
    """Records of the "vllm.treespec" logger (vLLM's logging config may stop it from reaching the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.treespec")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


# ----------------------------------------------------------------------------------------------------------------
# which head is the default


def test_trained_head_wins_over_shipped_and_choice_is_logged_once(tmp_path, head_dirs, tree_logs):
    trained, shipped = head_dirs
    assert default_head.find_default_head() is None
    place_head(tmp_path, shipped)
    assert default_head.find_default_head() == shipped
    place_head(tmp_path, trained, seed=1)
    assert default_head.find_default_head() == trained
    assert default_head.find_default_head() == trained
    messages = [r.getMessage() for r in tree_logs]
    assert sum(str(shipped) in m and "shipped" in m for m in messages) == 1
    assert sum(str(trained) in m and "trained into the cache" in m for m in messages) == 1


def test_incomplete_cache_head_does_not_shadow_the_shipped_one(tmp_path, head_dirs):
    trained, shipped = head_dirs
    place_head(tmp_path, shipped)
    trained.mkdir(parents=True)
    (trained / "config.json").write_text("{}")  # e.g. a training run that has not exported weights
    assert default_head.find_default_head() == shipped


def test_eagle_tree_without_checkpoint_uses_the_default_head(tmp_path, head_dirs):
    from vllm_treespec.proposers.eagle_tree import EagleTreeOptions
    from vllm_treespec.proposers.kv_aware import KVAwareOptions

    trained, shipped = head_dirs
    with pytest.raises(ValueError, match="no checkpoint given and no default head.*train-eagle"):
        EagleTreeOptions()
    # kv_aware's default mode has no shipped head: the error names the mode that has one
    with pytest.raises(ValueError, match='train-eagle --mode hybrid.*"mode": "hidden"'):
        KVAwareOptions()
    place_head(tmp_path, shipped)
    assert EagleTreeOptions().resolved_checkpoint() == str(shipped)
    assert KVAwareOptions(mode="hidden").resolved_checkpoint() == str(shipped)
    place_head(tmp_path, trained, seed=1)
    assert EagleTreeOptions(checkpoint="auto").resolved_checkpoint() == str(trained)


def test_model_cli_prints_the_head_folder_last(tmp_path, head_dirs, capsys):
    from vllm_treespec.tools.models import main

    trained, shipped = head_dirs
    assert main(["smollm2-eagle3"]) == 1
    assert "no EAGLE-3 head for SmolLM2" in capsys.readouterr().err
    place_head(tmp_path, shipped)
    assert main(["smollm2-eagle3"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(shipped)
    other_cache = tmp_path / "other-cache"
    place_head(tmp_path, other_cache / default_head.DEFAULT_HEAD_NAME, seed=2)
    assert main(["smollm2-eagle3", "--cache-dir", str(other_cache)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(other_cache / default_head.DEFAULT_HEAD_NAME)


# ----------------------------------------------------------------------------------------------------------------
# does a head fit the served model


def test_head_without_target_record_is_checked_on_vocab_hidden_size_and_aux_layers(tmp_path):
    _, path = small_head(tmp_path)  # aux layers (1, 3, 5)
    cfg = head_config(path)
    assert TARGET_KEY not in cfg
    fits = ModelIdentity("x", "MistralForCausalLM", VOCAB, HIDDEN, 6)  # architecture not recorded: not compared
    assert mismatches(cfg, fits) == []
    assert mismatches(cfg, ModelIdentity("x", None, VOCAB + 1, HIDDEN, 6)) == [f"vocab size {VOCAB} vs {VOCAB + 1}"]
    assert mismatches(cfg, ModelIdentity("x", None, VOCAB, 2 * HIDDEN, 6)) == [f"hidden size {HIDDEN} vs {2 * HIDDEN}"]
    assert mismatches(cfg, ModelIdentity("x", None, VOCAB, HIDDEN, 5)) == ["aux layers [1, 3, 5] vs 5 layers"]


def test_head_with_target_record_is_checked_on_architecture_and_layers(tmp_path):
    _, path = small_head(tmp_path)
    record_target(tmp_path / "head")
    cfg = head_config(path)
    assert mismatches(cfg, ModelIdentity("renamed", "LlamaForCausalLM", VOCAB, HIDDEN, 8)) == []  # not the name
    assert mismatches(cfg, ModelIdentity("x", "Qwen2ForCausalLM", VOCAB, HIDDEN, 8)) == [
        "architecture LlamaForCausalLM vs Qwen2ForCausalLM"]
    assert mismatches(cfg, ModelIdentity("x", "LlamaForCausalLM", VOCAB, HIDDEN, 12)) == ["8 layers vs 12"]


def test_mismatch_message_names_the_option_and_both_models(tmp_path):
    _, path = small_head(tmp_path)
    record_target(tmp_path / "head")
    with pytest.raises(HeadTargetMismatch) as exc:
        check_head_target(path, TINY, "eagle_tree option 'checkpoint'")
    message = str(exc.value)
    assert message.startswith("eagle_tree option 'checkpoint': ")
    assert f"small-target (LlamaForCausalLM, vocab {VOCAB}, hidden {HIDDEN}, 8 layers)" in message
    assert "tiny-llama (LlamaForCausalLM, vocab 49152, hidden 128, 2 layers)" in message
    assert "train-eagle --model" in message
    check_head_target(path, None, "eagle_tree option 'checkpoint'")  # served model unknown: nothing to compare


def test_trainer_records_the_target(tmp_path):
    transformers = pytest.importorskip("transformers")
    from vllm_treespec.tools.models import TINY_LLAMA_ARCH

    cfg = transformers.LlamaConfig(vocab_size=49152, **TINY_LLAMA_ARCH, architectures=["LlamaForCausalLM"])
    record = target_record(cfg, "tiny-llama")
    assert record == {"name": "tiny-llama", "architecture": "LlamaForCausalLM", "vocab_size": 49152,
                      "hidden_size": 128, "num_hidden_layers": 2}
    assert identity_from_hf_config(cfg.to_dict(), "tiny-llama") == TINY


@pytest.mark.parametrize("method", ["eagle_tree", "kv_aware"])
def test_eagle_tree_and_kv_aware_refuse_a_head_for_another_model(tmp_path, method):
    from vllm_treespec.proposers.eagle_tree import EagleTreeOptions, EagleTreeProposer
    from vllm_treespec.proposers.kv_aware import KVAwareOptions, KVAwareProposer

    _, path = small_head(tmp_path)
    proposer, options = ((EagleTreeProposer, EagleTreeOptions) if method == "eagle_tree"
                         else (KVAwareProposer, KVAwareOptions))
    with pytest.raises(HeadTargetMismatch, match=rf"^{method} option 'checkpoint': .*hidden size {HIDDEN} vs 576"):
        proposer(fake_vllm_config(vocab_size=VOCAB, hidden_size=576), options(checkpoint=path))
    fits = proposer(fake_vllm_config(), options(checkpoint=path))
    assert fits.drafter.checkpoint == path


def test_eagle_tree_refuses_a_default_head_for_another_model(tmp_path, head_dirs):
    from vllm_treespec.proposers.eagle_tree import EagleTreeOptions, EagleTreeProposer

    place_head(tmp_path, head_dirs[1])
    with pytest.raises(HeadTargetMismatch, match=r"^eagle_tree option 'checkpoint' \(not given: the default head"):
        EagleTreeProposer(fake_vllm_config(hidden_size=576), EagleTreeOptions())


def test_graft_refuses_a_head_path_for_another_model(tmp_path):
    from vllm_treespec.proposers.graft.drafter import EagleModelDrafter, load_model_drafter

    _, path = small_head(tmp_path)
    with pytest.raises(HeadTargetMismatch, match=rf"^graft option 'eagle_checkpoint': .*vocab size {VOCAB} vs 49152"
                                                 r".*\"eagle_checkpoint\": \"none\""):
        load_model_drafter(path, fake_vllm_config(vocab_size=49152))
    assert isinstance(load_model_drafter(path, fake_vllm_config()), EagleModelDrafter)


def test_graft_eagle_dtype_reaches_the_drafter(tmp_path):
    """graft's ``eagle_dtype`` picks the head's compute mode as eagle_tree's ``dtype`` does ("fastest" by default)."""
    from vllm_treespec.proposers.graft.drafter import load_model_drafter
    from vllm_treespec.proposers.graft.options import GraftOptions

    head, path = small_head(tmp_path)
    assert GraftOptions().eagle_dtype == "fastest"
    assert load_model_drafter(path, fake_vllm_config()).drafter.dtype_name == "fastest"
    drafter = load_model_drafter(path, fake_vllm_config(), dtype="int8").drafter
    drafter.load(head.embed.weight)
    assert drafter.compute == "int8" and all(hasattr(m, "int8_weight") for m in drafter.head.modules()
                                             if type(m) is torch.nn.Linear)


def test_graft_auto_skips_a_default_head_for_another_model_with_one_line(tmp_path, head_dirs, tree_logs):
    from vllm_treespec.proposers.graft.drafter import EagleModelDrafter, load_model_drafter

    _, shipped = head_dirs
    assert load_model_drafter("auto", fake_vllm_config()) is None  # no head at all
    place_head(tmp_path, shipped)
    tree_logs.clear()
    assert load_model_drafter("auto", fake_vllm_config(hidden_size=576)) is None
    warnings = [r.getMessage() for r in tree_logs if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "eagle_checkpoint='auto'" in warnings[0] and f"hidden size {HIDDEN} vs 576" in \
        warnings[0], warnings
    assert isinstance(load_model_drafter("auto", fake_vllm_config()), EagleModelDrafter)
    assert load_model_drafter("auto", None) is None  # no served model to check the head against


# ----------------------------------------------------------------------------------------------------------------
# the shipped head itself


def shipped_or_skip():
    folder = default_head.shipped_head_path()
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"no shipped head yet: {folder}/model.safetensors is absent (scripts/ship_head.py copies it in)")
    return folder


def test_shipped_head_is_small_bf16_and_records_smollm2_as_target():
    folder = shipped_or_skip()
    from safetensors import safe_open

    size = sum((folder / name).stat().st_size for name in ("config.json", "model.safetensors"))
    assert size <= default_head.MAX_SHIPPED_HEAD_BYTES
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes <= {"BF16", "I64", "BOOL"}, dtypes
    cfg = head_config(folder)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg[TARGET_KEY] == {"name": "SmolLM2-135M-Instruct", "architecture": "LlamaForCausalLM",
                               "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}
    assert mismatches(cfg, SMOLLM2) == [] and mismatches(cfg, TINY)
    assert "TODO" not in (folder / "MODEL_CARD.md").read_text(), "fill the model card's TODOs"


@pytest.mark.parametrize("spec,option", [
    ({"method": "eagle_tree"}, "eagle_tree option 'checkpoint'"),
    ({"method": "kv_aware"}, "kv_aware option 'checkpoint'"),
    ({"method": "graft"}, "graft option 'eagle_checkpoint'"),
])
def test_a_head_for_another_model_is_refused_when_the_config_is_read(tmp_path, spec, option):
    """In the engine's main process (EngineArgs.create_speculative_config -> translate with the served model's
    config), so the user sees which option to fix instead of a worker's start-up failure."""
    from vllm_treespec.config import translate

    _, path = small_head(tmp_path)
    spec = {**spec, option.split("'")[1]: path}
    with pytest.raises(HeadTargetMismatch, match=rf"^{option}: .*hidden size {HIDDEN} vs 576"):
        translate(spec, None, fake_vllm_config(hidden_size=576).model_config)
    assert translate(spec, None, fake_vllm_config().model_config)[2]  # the model it was trained for
    assert translate(spec, None)[2]  # no served model to compare with (tools that only check syntax)


def test_graft_auto_is_not_refused_when_the_config_is_read(tmp_path, head_dirs):
    from vllm_treespec.config import translate

    place_head(tmp_path, head_dirs[1])  # a default head for another model: graft falls back to retrieval-only
    assert translate({"method": "graft"}, None, fake_vllm_config(hidden_size=576).model_config)[2]
