"""A global store of finished outputs kept across engine restarts, in a datastore file.

A server's :class:`~.store.GlobalSuffixStore` learns the model's phrasing from every finished request and loses it
when the engine stops; a datastore of the model's own earlier answers was worth 7-21% more tokens a second to graft
at batch 1 in fp32 (docs/benchmarks.md). :class:`StoreFile` loads the store from its file when the engine starts,
saves it every ``save_every`` finished outputs and when the engine shuts down. The file is an ordinary datastore
(:mod:`.datastore`): ``vllm-treespec datastore info`` reads it, and another engine can use it read-only as its
``datastore``. Saving compacts the automaton and writes it (0.34-0.53 s and 51 MiB at the store's bound of 2^20
tokens on the development machine; loading 0.53 s), to a file of its own first and then renamed over the old one, so
a reader or a crash never sees half a file, and two engines saving to one path leave one store whole (the last
saved).
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np

from .datastore import load_datastore, save_datastore
from .store import GlobalSuffixStore
from .tree import SEP


def documents_of(tokens: np.ndarray) -> Iterator[np.ndarray]:
    """The documents of a token stream whose documents each end in :data:`~.tree.SEP`, in order."""
    tokens = np.asarray(tokens)
    start = 0
    for end in np.flatnonzero(tokens == SEP):
        if end > start:
            yield np.array(tokens[start:end], dtype=np.int32)
        start = end + 1
    if start < tokens.shape[0]:
        yield np.array(tokens[start:], dtype=np.int32)


class StoreFile:
    """Keeps ``store`` in the datastore file ``path``: :meth:`load` at start, :meth:`saved_if_due` after outputs
    are added, :meth:`save` at shutdown. ``vocab_size`` and ``tokenizer`` go into the file's header."""

    def __init__(self, path: str | os.PathLike, store: GlobalSuffixStore, *, vocab_size: int | None, tokenizer: str,
                 save_every: int) -> None:
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        self.path = os.fspath(path)
        self.store = store
        self.vocab_size = vocab_size  # None (no model known): the smallest vocabulary that holds the stored ids
        self.tokenizer = tokenizer
        self.save_every = int(save_every)
        self._saved_at = store.documents_added  # documents added when the file last matched the store
        self._tried_at = self._saved_at  # ... when a save was last tried: a failing disk is retried every save_every

    def load(self, *, model_vocab_size: int | None = None, expected_tokenizer: str | None = None) -> int:
        """Add the file's documents to the store, oldest first (past the store's bound only the newest stay).
        Returns how many were read; 0 when there is no file yet. A corrupt or foreign file raises
        :class:`~.datastore.DatastoreError` naming it."""
        if not os.path.exists(self.path):
            return 0
        datastore = load_datastore(self.path, model_vocab_size=model_vocab_size, expected_tokenizer=expected_tokenizer)
        count = 0
        for document in documents_of(datastore.automaton.tokens):
            self.store.add(document)
            count += 1
        self._saved_at = self._tried_at = self.store.documents_added
        return count

    @property
    def unsaved(self) -> int:
        """Documents added to the store since the file last matched it."""
        return self.store.documents_added - self._saved_at

    def saved_if_due(self) -> bool:
        """Save when ``save_every`` documents arrived since the last save (or the last failed try). Returns whether
        it saved."""
        if self.store.documents_added - self._tried_at < self.save_every:
            return False
        self.save()
        return True

    def save(self) -> None:
        """Write the store to the file now (nothing when nothing arrived since the last save or load). An
        ``OSError`` (disk full, folder gone) propagates, leaving the old file; the store is kept and a later save
        tries again."""
        if self.unsaved == 0:
            return
        self._tried_at = self.store.documents_added
        stored = self.store.sam.tokens[:len(self.store)]
        vocab_size = self.vocab_size if self.vocab_size is not None else int(stored.max(initial=0)) + 1
        save_datastore(self.path, self.store.sam.compact(), vocab_size=vocab_size, tokenizer=self.tokenizer,
                       num_documents=self.store.num_documents)
        self._saved_at = self._tried_at
