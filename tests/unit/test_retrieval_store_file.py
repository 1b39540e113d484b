"""StoreFile: a global store of finished outputs saved to a datastore file and loaded by the next engine."""

from __future__ import annotations

import os

import numpy as np
import pytest

from vllm_treespec.retrieval import DatastoreError, StoreFile, SuffixRetriever, check_datastore, load_datastore
from vllm_treespec.retrieval.datastore import build_from_token_documents
from vllm_treespec.retrieval.store import GlobalSuffixStore
from vllm_treespec.retrieval.store_file import documents_of


def documents(store: GlobalSuffixStore) -> list[list[int]]:
    return [d.tolist() for d in documents_of(store.sam.tokens[:len(store)])]


def test_a_saved_store_loads_into_the_next_one_in_order_and_retrieves(tmp_path):
    path = tmp_path / "outputs.tsds"
    first = SuffixRetriever(global_max_tokens=1 << 10, min_prob=0.0)
    keeper = StoreFile(path, first.global_store, vocab_size=100, tokenizer="toy", save_every=2)
    assert keeper.load() == 0 and not path.exists()  # no file yet: an empty store, the file comes with a save
    outputs = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 40, 41]]
    for i, out in enumerate(outputs):
        first.retrieve(i, np.array([1, 2] + out), 4, prompt_len=2)  # prompt [1, 2], then the output
        first.release([i])
        saved = keeper.saved_if_due()
        assert saved == (i == 1)  # every second finished output
    assert documents(load_store(path)) == outputs[:2]  # the third is not saved yet
    keeper.save()  # as at shutdown
    assert documents(load_store(path)) == outputs
    header = check_datastore(path)
    assert (header.vocab_size, header.tokenizer, header.num_documents) == (100, "toy", 3)
    assert not [p for p in os.listdir(tmp_path) if p != "outputs.tsds"]  # no temporary file left

    second = SuffixRetriever(global_max_tokens=1 << 10, min_prob=0.0)
    assert StoreFile(path, second.global_store, vocab_size=100, tokenizer="toy", save_every=2).load() == 3
    tree = second.retrieve("new", np.array([70, 5, 6]), 4, prompt_len=3)  # 5 6 -> {7, 40} from two outputs
    roots = sorted(int(t) for t, p in zip(tree.token_ids, tree.parents) if p == -1)
    assert roots == [7, 40]


def load_store(path, max_tokens=1 << 10) -> GlobalSuffixStore:
    store = GlobalSuffixStore(max_tokens)
    StoreFile(path, store, vocab_size=None, tokenizer="", save_every=1).load()
    return store


def test_loading_more_than_the_store_holds_keeps_the_newest_outputs(tmp_path):
    path = tmp_path / "outputs.tsds"
    outputs = [np.arange(i * 10, i * 10 + 9) for i in range(10)]  # 10 outputs of 9 tokens (10 with a separator)
    build_from_token_documents(outputs, path, vocab_size=128, tokenizer="toy")
    store = load_store(path, max_tokens=40)
    kept = documents(store)
    assert kept and kept == [o.tolist() for o in outputs[-len(kept):]] and len(kept) < 10
    assert outputs[-1].tolist() in kept


def test_nothing_new_writes_nothing_and_a_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "outputs.tsds"
    store = GlobalSuffixStore(1 << 10)
    keeper = StoreFile(path, store, vocab_size=None, tokenizer="toy", save_every=1)
    keeper.save()
    assert not path.exists()  # an empty store is not written
    store.add(np.array([3, 4, 5]))
    assert keeper.saved_if_due() and check_datastore(path).vocab_size == 6  # no model: the ids' own range
    before = path.read_bytes()
    keeper.save()
    assert path.read_bytes() == before and keeper.unsaved == 0

    store.add(np.array([6, 7]))

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)  # the new file written, then the rename fails
    with pytest.raises(OSError, match="No space"):
        keeper.save()
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["outputs.tsds"]  # the old file, no stray half
    assert keeper.unsaved == 1 and not keeper.saved_if_due()  # retried after save_every more outputs, not each one
    store.add(np.array([8, 9]))
    assert keeper.saved_if_due() and documents(load_store(path)) == [[3, 4, 5], [6, 7], [8, 9]]


def test_a_file_of_a_larger_vocabulary_is_refused_naming_it(tmp_path):
    path = tmp_path / "other.tsds"
    build_from_token_documents([np.array([1, 2, 3])], path, vocab_size=50000, tokenizer="other")
    keeper = StoreFile(path, GlobalSuffixStore(64), vocab_size=100, tokenizer="toy", save_every=1)
    with pytest.raises(DatastoreError, match="other.tsds.*50000"):
        keeper.load(model_vocab_size=100)
    assert load_datastore(path).header.tokenizer == "other"  # left as it was
