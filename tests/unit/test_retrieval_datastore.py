"""Corpus datastore: round trip, corpus file parsing, CLI, and clear errors on corrupt or mismatched files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vllm_treespec.retrieval import DatastoreError, SuffixAutomaton, build_datastore, load_datastore
from vllm_treespec.retrieval.cli import main as datastore_main
from vllm_treespec.retrieval.datastore import FORMAT_VERSION, build_from_token_documents, iter_documents

DOCS = [np.array([1, 2, 3, 4, 2, 3, 5]), np.array([2, 3, 4, 9]), np.array([7, 7, 7])]


class CharTokenizer:
    """Stands in for a Hugging Face tokenizer: one id per character (ord % 128)."""

    def __len__(self) -> int:
        return 128

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) % 128 for c in t] for t in texts]}


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "corpus.ds"
    build_from_token_documents(DOCS, path, vocab_size=16, tokenizer="toy")
    return path


def test_round_trip_is_memory_mapped_and_equal(store_path):
    ds = load_datastore(store_path, verify_checksums=True)
    ref = SuffixAutomaton()
    for d in DOCS:
        ref.add_document(d)
    ref = ref.compact()
    h = ds.header
    assert (h.format_version, h.vocab_size, h.tokenizer, h.num_documents) == (FORMAT_VERSION, 16, "toy", 3)
    assert (h.num_tokens, h.num_states, h.num_edges) == (len(ref), ref.num_states, ref.num_edges)
    for name in ("states", "edges", "tokens"):
        a = getattr(ds.automaton, name)
        assert isinstance(a, np.memmap) and not a.flags.writeable
        np.testing.assert_array_equal(a, getattr(ref, name))
    state, length = ds.automaton.match([9, 2, 3])
    assert length == 2 and ds.automaton.count(state) == 3
    tok, par, prob = ds.automaton.tree(state, 8, 4)
    assert dict(zip(tok[par == -1].tolist(), prob[par == -1].tolist())) == pytest.approx({4: 2 / 3, 5: 1 / 3})


def corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_corrupt_and_mismatched_files_fail_clearly(store_path, tmp_path):
    blob = store_path.read_bytes()
    cases = {
        "magic": (lambda p: corrupt(p, 0, b"NOTADSTO"), "not a vllm-treespec datastore"),
        "short": (lambda p: p.write_bytes(blob[:10]), "too short"),
        "truncated": (lambda p: p.write_bytes(blob[: len(blob) // 2]), "truncated or corrupt"),
        "header": (lambda p: corrupt(p, 16, b"\xc1\xc1\xc1\xc1"), "corrupt header"),
        "hlen": (lambda p: corrupt(p, 8, (10**9).to_bytes(8, "little")), "header length exceeds"),
    }
    for name, (damage, message) in cases.items():
        p = tmp_path / f"{name}.ds"
        p.write_bytes(blob)
        damage(p)
        with pytest.raises(DatastoreError, match=message) as info:
            load_datastore(p)
        assert str(p) in str(info.value)
    with pytest.raises(DatastoreError, match="cannot read"):
        load_datastore(tmp_path / "missing.ds")
    with pytest.raises(DatastoreError, match="vocabulary of 16 tokens"):
        load_datastore(store_path, model_vocab_size=8)
    with pytest.warns(UserWarning, match="built with tokenizer 'toy'"):
        load_datastore(store_path, expected_tokenizer="other")


def test_damaged_arrays_are_caught(store_path, tmp_path):
    ds = load_datastore(store_path)
    specs = ds.header.arrays
    blob = store_path.read_bytes()
    # an edge pointing far outside the automaton: structural validation refuses it (no out-of-bounds kernel reads)
    p = tmp_path / "edge.ds"
    p.write_bytes(blob)
    corrupt(p, specs["edges"].offset + 4, np.int32(10**6).tobytes())
    with pytest.raises(DatastoreError, match="corrupt suffix automaton: edge target out of range"):
        load_datastore(p)
    # a flipped count passes the structure check but not the checksum
    p = tmp_path / "count.ds"
    p.write_bytes(blob)
    corrupt(p, specs["states"].offset + 5 * 4 + 8, np.int32(99).tobytes())
    load_datastore(p)
    with pytest.raises(DatastoreError, match="checksum mismatch in array 'states'"):
        load_datastore(p, verify_checksums=True)


def test_version_mismatch(store_path, tmp_path):
    import msgspec

    from vllm_treespec.retrieval.datastore import DatastoreHeader

    blob = bytearray(store_path.read_bytes())
    hlen = int.from_bytes(blob[8:16], "little")
    header = msgspec.msgpack.decode(bytes(blob[16:16 + hlen]), type=DatastoreHeader)
    header.format_version = FORMAT_VERSION + 1
    new = msgspec.msgpack.encode(header)
    assert len(new) == hlen
    blob[16:16 + hlen] = new
    p = tmp_path / "v2.ds"
    p.write_bytes(bytes(blob))
    with pytest.raises(DatastoreError, match=f"format version {FORMAT_VERSION + 1} is not supported"):
        load_datastore(p)


def test_corpus_files_text_jsonl_and_truncated_sharegpt(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["q one", "q two"]}) + "\n\n" +
                                      json.dumps({"text": "plain", "meta": {"id": "x"}}) + "\n")
    conversations = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"hi {i}"},
                                                        {"from": "gpt", "value": f"hello {i}"}]} for i in range(3)]
    full = json.dumps(conversations)
    (tmp_path / "c.json").write_text(full[: full.index('"c2"') + 10])  # cut inside the third conversation
    assert list(iter_documents(tmp_path / "a.txt")) == ["hello world"]
    assert list(iter_documents(tmp_path / "b.jsonl")) == ["q one", "q two", "plain"]
    with pytest.warns(UserWarning, match="ends early after 2 complete elements"):
        assert list(iter_documents(tmp_path / "c.json")) == ["hi 0", "hello 0", "hi 1", "hello 1"]
    out = tmp_path / "corpus.ds"
    with pytest.warns(UserWarning):
        header = build_datastore("chars", [tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.json"], out,
                                 tokenizer=CharTokenizer(), progress=False)
    assert header.num_documents == 8 and header.vocab_size == 128
    ds = load_datastore(out)
    state, length = ds.automaton.match([ord(c) for c in "say hel"])
    # " hel" never occurs; "hel" does: in "hello world", "hello 0" and "hello 1"
    assert length == 3 and ds.automaton.count(state) == 3
    assert ds.automaton.tokens[: len("hello world")].tolist() == [ord(c) for c in "hello world"]


def test_token_id_lists_are_documents_as_they_are_between_tokenised_texts(tmp_path):
    # a model's own answers as `vllm-treespec train-eagle --stage generate` writes them: prompt and answer as ids
    lines = [{"question_id": "a", "prompt_ids": [90, 91], "output_ids": [5, 6, 7, 5, 6, 8]},
             {"text": "xy"}, {"question_id": "b", "prompt_ids": [92], "output_ids": [6, 7, 9]}]
    (tmp_path / "answers.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    docs = list(iter_documents(tmp_path / "answers.jsonl"))
    assert [d if isinstance(d, str) else d.tolist() for d in docs] == [[5, 6, 7, 5, 6, 8], "xy", [6, 7, 9]]
    out = tmp_path / "answers.ds"
    # a text waiting for its tokenizer batch is indexed before the id list after it: the file's order is kept
    header = build_datastore("chars", [tmp_path / "answers.jsonl"], out, tokenizer=CharTokenizer(), progress=False)
    assert header.num_documents == 3
    sep = -1
    assert load_datastore(out).automaton.tokens.tolist() == [5, 6, 7, 5, 6, 8, sep, ord("x"), ord("y"), sep,
                                                             6, 7, 9, sep]
    # ids the tokenizer does not have are refused, not indexed
    for foreign in ([3, 500], [3, 2**32 + 5]):  # the second would wrap to 5 as int32
        (tmp_path / "foreign.jsonl").write_text(json.dumps({"output_ids": foreign}) + "\n")
        with pytest.raises(ValueError, match="outside"):
            build_datastore("chars", [tmp_path / "foreign.jsonl"], tmp_path / "f.ds", tokenizer=CharTokenizer(),
                            progress=False)


def test_cli_build_and_info(tmp_path, capsys, monkeypatch):
    import vllm_treespec.retrieval.datastore as datastore

    (tmp_path / "a.txt").write_text("abcabcabd")
    monkeypatch.setattr(datastore, "_load_tokenizer", lambda name: CharTokenizer(), raising=True)
    out = tmp_path / "x.ds"
    assert datastore_main(["build", "--tokenizer", "chars", str(tmp_path / "a.txt"), "-o", str(out),
                           "--no-progress"]) == 0
    assert "1 documents, 10 tokens" in capsys.readouterr().out
    assert datastore_main(["info", str(out), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert '"tokenizer": "chars"' in printed and "checksums ok" in printed
    (tmp_path / "bad.ds").write_bytes(b"garbage")
    assert datastore_main(["info", str(tmp_path / "bad.ds")]) == 1
    assert "too short" in capsys.readouterr().err


def test_package_imports_without_vllm_and_torch():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('vllm', 'torch', 'transformers'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import vllm_treespec.retrieval as r
import vllm_treespec.retrieval.cli
t = r.SuffixRetriever().retrieve('a', [1, 2, 3, 1, 2], 4)
assert t.token_ids.tolist() == [3, 1, 2], t
assert not any(m.split('.')[0] in ('vllm', 'torch', 'transformers') for m in sys.modules)
print('ok')
"""
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
