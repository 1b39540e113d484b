"""`train-eagle --init-from`: continuing a head on new prompts keeps its weights and draft vocabulary, and records one
ShareGPT span covering both runs' prompts (the span benchmarks refuse)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.eagle_helpers import small_head
from vllm_treespec.eagle.default_head import shipped_head_path
from vllm_treespec.eagle.target import HeadTargetMismatch
from vllm_treespec.training.train import build_parser, initial_head, training_plan


def test_a_continued_head_starts_from_the_saved_weights_and_draft_vocabulary(tmp_path):
    head, path = small_head(tmp_path, norm_before_fc=True)
    loaded = initial_head(path, head.embed.weight.detach().clone(), (1, 3, 5), "hidden")
    assert loaded.cfg.draft_vocab_size == head.cfg.draft_vocab_size
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    saved = head.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), name
    assert all(p.dtype == torch.float32 for p in loaded.parameters())


def test_a_head_of_other_layers_or_another_mode_is_refused_with_the_fix(tmp_path):
    head, path = small_head(tmp_path)
    embed = head.embed.weight.detach().clone()
    with pytest.raises(ValueError, match=r"reads target layers \[1, 3, 5\].*--aux-layers 1,3,5"):
        initial_head(path, embed, (2, 4, 6), "hidden")
    with pytest.raises(ValueError, match=r"a 'hidden' head, but --mode is 'kv'; pass --mode hidden"):
        initial_head(path, embed, (1, 3, 5), "kv")


@pytest.fixture(scope="module")
def smollm2_dir():
    from vllm_treespec.tools.models import ensure_smollm2

    return str(ensure_smollm2())


def fake_head(folder, config: dict):
    """A head folder as training_plan sees it: config.json and a weights file (not read before training)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def plan(argv, model_dir):
    return training_plan(build_parser().parse_args(["-o", "unused", *argv]), model_dir, "SmolLM2-135M-Instruct")


def test_new_prompts_follow_the_heads_own_and_the_span_covers_both(tmp_path, smollm2_dir):
    head = fake_head(tmp_path / "head", {"treespec_training": {"sharegpt_positions": [1000, 2169]}})
    assert plan([], smollm2_dir) == (None, 1000, (1000, 2169))
    init, first, span = plan(["--init-from", str(head)], smollm2_dir)
    assert (init, first, span[0]) == (head, 2169, 1000) and span[1] > 3000
    assert plan(["--init-from", str(head), "--num-prompts", "8"], smollm2_dir)[1:] == (2169, (1000, 2179))
    # overlapping prompts are allowed (the span stays one interval); a gap is refused before any work
    assert plan(["--init-from", str(head), "--prompts-from", "1500", "--num-prompts", "8"], smollm2_dir)[1:] == \
        (1500, (1000, 2169))
    with pytest.raises(SystemExit, match=r"--prompts-from 3000: .* would leave a gap; start at 2169 or earlier"):
        plan(["--init-from", str(head), "--prompts-from", "3000", "--num-prompts", "8"], smollm2_dir)
    shipped = shipped_head_path()
    init, first, span = plan(["--init-from", "shipped", "--num-prompts", "8"], smollm2_dir)
    shipped_span = json.loads((shipped / "config.json").read_text())["treespec_training"]["sharegpt_positions"]
    assert init == shipped and first == shipped_span[1] and span[0] == shipped_span[0]
    # the first positions after a head's span may be unfit prompts (here 3340): skipped, not a gap
    head_3340 = fake_head(tmp_path / "head_3340", {"treespec_training": {"sharegpt_positions": [1000, 3340]}})
    assert plan(["--init-from", str(head_3340), "--num-prompts", "8"], smollm2_dir)[1:] == (3340, (1000, 3351))


def test_a_missing_head_or_one_for_another_model_is_refused(tmp_path, smollm2_dir):
    with pytest.raises(SystemExit, match=r"--init-from .*missing: no head there"):
        plan(["--init-from", str(tmp_path / "missing")], smollm2_dir)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--init-from .*no_weights: no head there \(config.json and weights\)"):
        plan(["--init-from", str(no_weights)], smollm2_dir)
    other = fake_head(tmp_path / "other", {"treespec_target": {"name": "other", "vocab_size": 1000,
                                                                "hidden_size": 64}})
    with pytest.raises(HeadTargetMismatch, match=r"--init-from: the draft head .*vocab size 1000 vs 49152"):
        plan(["--init-from", str(other)], smollm2_dir)


def test_a_continued_head_records_the_head_it_started_from(tmp_path):
    from vllm_treespec.training.train import continued_record

    first = tmp_path / "first"
    first.mkdir()
    (first / "config.json").write_text(json.dumps({"treespec_training": {
        "target": "/local/path", "sharegpt_positions": [1000, 2169], "steps": 852, "final_valid": {"step": 852}}}))
    assert continued_record("shipped", first) == {"head": "shipped", "sharegpt_positions": [1000, 2169], "steps": 852}


def test_only_the_stages_that_write_a_head_ask_for_its_folder(capsys):
    from vllm_treespec.training.train import main

    for stage in ("all", "export"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--stage", stage])
        assert exit_info.value.code == 2
        assert f"-o/--out is needed with --stage {stage}" in capsys.readouterr().err
    for stage in ("generate", "features", "train"):
        assert build_parser().parse_args(["--stage", stage]).out is None
