"""Corpus datastore: a compact suffix automaton over a tokenised corpus, in one memory-mappable file.

File layout (format version 1, all integers little-endian):

====================  =================================================================================
bytes 0..7            magic ``b"VTSPECDS"``
bytes 8..15           uint64 ``H``, length of the header
bytes 16..16+H        msgpack-encoded :class:`DatastoreHeader` (msgspec)
64-byte aligned       raw C-order arrays, at the offsets the header lists: ``states`` int32 [S, 5],
                      ``edges`` int32 [E, 3], ``tokens`` int32 [N] (documents joined by SEP = -1)
====================  =================================================================================

The tables are those of :class:`~.sam.StaticSuffixAutomaton`. Loading maps the arrays read-only (``np.memmap``),
checks magic, version, sizes, shapes and the automaton's structure (so a damaged file cannot make a kernel read out of
bounds), and optionally the per-array CRC32 checksums. Every problem raises :class:`DatastoreError` naming the file.
"""

from __future__ import annotations

import json
import os
import re
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgspec
import numpy as np

from .sam import StaticSuffixAutomaton, SuffixAutomaton

MAGIC = b"VTSPECDS"
FORMAT_VERSION = 1
_ALIGN = 64
_PREFIX = struct.Struct("<8sQ")
_ARRAYS = {"states": (np.int32, 2), "edges": (np.int32, 2), "tokens": (np.int32, 1)}


class DatastoreError(ValueError):
    """A datastore file that is missing, corrupt, of another format version, or for another tokenizer."""


class ArraySpec(msgspec.Struct, forbid_unknown_fields=True):
    dtype: str
    shape: list[int]
    offset: int
    crc32: int


class DatastoreHeader(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    magic: str
    format_version: int
    vocab_size: int
    tokenizer: str
    num_tokens: int
    num_documents: int
    num_states: int
    num_edges: int
    arrays: dict[str, ArraySpec]


class Datastore(msgspec.Struct, kw_only=True):
    """A loaded datastore: its header and its (memory-mapped) automaton."""

    path: str
    header: DatastoreHeader
    automaton: Any  # StaticSuffixAutomaton


def _crc(a: np.ndarray) -> int:
    crc = 0
    flat = a.reshape(-1).view(np.uint8)
    for i in range(0, flat.shape[0], 1 << 24):
        crc = zlib.crc32(flat[i:i + (1 << 24)], crc)
    return crc


def save_datastore(path: str | os.PathLike, automaton: StaticSuffixAutomaton, *, vocab_size: int, tokenizer: str,
                   num_documents: int) -> DatastoreHeader:
    arrays = {"states": automaton.states, "edges": automaton.edges, "tokens": automaton.tokens}
    # offsets depend on the header length, which depends on the offsets' digits: fix them at a generous header size
    specs = {name: ArraySpec(str(a.dtype), list(a.shape), 0, _crc(a)) for name, a in arrays.items()}
    header = DatastoreHeader(magic=MAGIC.decode(), format_version=FORMAT_VERSION, vocab_size=int(vocab_size),
                             tokenizer=tokenizer, num_tokens=len(automaton), num_documents=int(num_documents),
                             num_states=automaton.num_states, num_edges=automaton.num_edges, arrays=specs)
    reserved = _align(_PREFIX.size + len(msgspec.msgpack.encode(header)) + 256)
    offset = reserved
    for name, a in arrays.items():
        specs[name].offset = offset
        offset = _align(offset + a.nbytes)
    blob = msgspec.msgpack.encode(header)
    assert _PREFIX.size + len(blob) <= reserved
    tmp = Path(f"{os.fspath(path)}.{os.getpid()}.tmp")  # two processes saving to one path do not share it
    try:
        with open(tmp, "wb") as f:
            f.write(_PREFIX.pack(MAGIC, len(blob)))
            f.write(blob)
            for name, a in arrays.items():
                f.seek(specs[name].offset)
                f.write(np.ascontiguousarray(a).tobytes())
            f.truncate(offset)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves the old file, not a stray half of the new one
        raise
    return header


def _fail(path: str, msg: str) -> DatastoreError:
    return DatastoreError(f"datastore {path!r}: {msg}")


def _read_header(path: str) -> tuple[DatastoreHeader, dict[str, tuple[Any, ArraySpec]]]:
    """The header and the arrays' (dtype, spec), after checking magic, header, format version and that every array
    lies inside the file. Reads only the header."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise _fail(path, "file too short to be a datastore")
            magic, hlen = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise _fail(path, f"not a vllm-treespec datastore (magic {magic!r}, expected {MAGIC!r})")
            if hlen > size - _PREFIX.size:
                raise _fail(path, "header length exceeds the file size (truncated or corrupt file)")
            blob = f.read(hlen)
    except OSError as e:
        raise DatastoreError(f"cannot read datastore {path!r}: {e}") from e
    try:
        header = msgspec.msgpack.decode(blob, type=DatastoreHeader)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise _fail(path, f"corrupt header ({e})") from e
    if header.magic != MAGIC.decode():
        raise _fail(path, f"corrupt header (magic field {header.magic!r})")
    if header.format_version != FORMAT_VERSION:
        raise _fail(path, f"format version {header.format_version} is not supported (this build reads version "
                          f"{FORMAT_VERSION}); rebuild it with `vllm-treespec datastore build`")
    if set(header.arrays) != set(_ARRAYS):
        raise _fail(path, f"arrays {sorted(header.arrays)} do not match the expected {sorted(_ARRAYS)}")
    specs = {}
    for name, (dtype, ndim) in _ARRAYS.items():
        spec = header.arrays[name]
        if spec.dtype != np.dtype(dtype).name or len(spec.shape) != ndim or min(spec.shape, default=0) < 0:
            raise _fail(path, f"array {name!r} has dtype {spec.dtype} and shape {spec.shape}")
        nbytes = int(np.prod(spec.shape)) * np.dtype(dtype).itemsize
        if spec.offset < _PREFIX.size + hlen or spec.offset + nbytes > size:
            raise _fail(path, f"array {name!r} lies outside the file (truncated or corrupt file)")
        specs[name] = (dtype, spec)
    counts = tuple(header.arrays[name].shape[0] for name in ("states", "edges", "tokens"))
    if counts != (header.num_states, header.num_edges, header.num_tokens):
        raise _fail(path, "array sizes disagree with the header counts")
    return header, specs


def _checked(path: str, model_vocab_size: int | None) -> tuple[DatastoreHeader, dict[str, tuple[Any, ArraySpec]]]:
    header, specs = _read_header(path)
    if model_vocab_size is not None and header.vocab_size > model_vocab_size:
        raise _fail(path, f"built for a vocabulary of {header.vocab_size} tokens (tokenizer {header.tokenizer!r}) "
                          f"but the model has only {model_vocab_size}")
    return header, specs


def check_datastore(path: str | os.PathLike, *, model_vocab_size: int | None = None) -> DatastoreHeader:
    """Cheap check that reads only the header: magic, format version, array layout against the file size, and the
    vocabulary against ``model_vocab_size``. Option validation calls it, so a wrong file fails when the config is
    read, before an engine starts; :func:`load_datastore` also checks the automaton's structure."""
    return _checked(os.fspath(path), model_vocab_size)[0]


def load_datastore(path: str | os.PathLike, *, model_vocab_size: int | None = None,
                   expected_tokenizer: str | None = None, verify_checksums: bool = False) -> Datastore:
    """Open a datastore read-only (memory-mapped) and validate it; see the module docstring.

    ``model_vocab_size``: fail if the datastore's tokenizer has more tokens than the model's (padded) vocabulary.
    ``expected_tokenizer``: warn if the datastore was built with a tokenizer of another name."""
    path = os.fspath(path)
    header, specs = _checked(path, model_vocab_size)
    if expected_tokenizer is not None and header.tokenizer != expected_tokenizer:
        warnings.warn(f"datastore {path!r} was built with tokenizer {header.tokenizer!r}, not {expected_tokenizer!r}",
                      stacklevel=2)
    arrays = {}
    for name, (dtype, spec) in specs.items():
        nbytes = int(np.prod(spec.shape)) * np.dtype(dtype).itemsize
        a = (np.memmap(path, dtype=dtype, mode="r", offset=spec.offset, shape=tuple(spec.shape)) if nbytes
             else np.zeros(spec.shape, dtype))
        if verify_checksums and _crc(a) != spec.crc32:
            raise _fail(path, f"checksum mismatch in array {name!r} (corrupt file)")
        arrays[name] = a
    try:
        automaton = StaticSuffixAutomaton(arrays["states"], arrays["edges"], arrays["tokens"])
    except ValueError as e:
        raise _fail(path, str(e)) from e
    return Datastore(path=path, header=header, automaton=automaton)


def build_from_token_documents(documents: Iterable[np.ndarray], out_path: str | os.PathLike, *, vocab_size: int,
                               tokenizer: str, max_tokens: int | None = None) -> DatastoreHeader:
    """Index tokenised documents (stopping before ``max_tokens`` tokens, separators included) and save them."""
    sam = SuffixAutomaton(capacity=1 << 16)
    num_docs = 0
    for doc in documents:
        doc = np.asarray(doc).reshape(-1)
        if doc.shape[0] == 0:
            continue
        if doc.min() < 0 or doc.max() >= vocab_size:  # checked before the cast, which would wrap a huge id
            raise ValueError(f"document {num_docs} has token ids outside [0, {vocab_size}): ids of another "
                             "tokenizer?")
        doc = doc.astype(np.int32, copy=False)
        if max_tokens is not None and len(sam) + doc.shape[0] + 1 > max_tokens:
            break
        sam.add_document(doc)
        num_docs += 1
    return save_datastore(out_path, sam.compact(), vocab_size=vocab_size, tokenizer=tokenizer,
                          num_documents=num_docs)


# --- corpus files ---------------------------------------------------------------------------------------------------
#: JSON keys whose string values (or lists of strings) are taken as documents: ShareGPT ``value``, chat ``content``,
#: MT-Bench ``turns``, HumanEval ``prompt``/``canonical_solution``, and common instruction-data fields.
TEXT_KEYS = frozenset({"text", "value", "content", "turns", "prompt", "completion", "response", "output",
                       "canonical_solution", "question", "answer", "instruction", "input"})
#: JSON keys whose lists of integers are taken as documents already tokenised: a model's own answers as
#: ``vllm-treespec train-eagle --stage generate`` writes them (``output_ids``), or any ``token_ids`` list
TOKEN_ID_KEYS = frozenset({"output_ids", "token_ids"})
_SKIP = re.compile(r"[\s,]*")


def documents_from_json(obj: Any, key: str | None = None) -> Iterator[str | np.ndarray]:
    """The documents in ``obj``: strings under :data:`TEXT_KEYS` anywhere in it (a bare top-level string counts too),
    and lists of token ids under :data:`TOKEN_ID_KEYS` (as int64 arrays, taken as they are)."""
    if key in TOKEN_ID_KEYS and isinstance(obj, list) and obj and all(type(x) is int for x in obj):
        yield np.asarray(obj, dtype=np.int64)
    elif isinstance(obj, str):
        if (key is None or key in TEXT_KEYS) and obj:
            yield obj
    elif isinstance(obj, list):
        for x in obj:
            yield from documents_from_json(x, key)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from documents_from_json(v, k)


def iter_json_values(text: str, path: str = "<json>") -> Iterator[Any]:
    """Elements of a top-level JSON array (or the single top-level value), tolerating a truncated file: decoding
    stops with a warning at the first element that does not parse (e.g. the truncated ShareGPT dump)."""
    decoder = json.JSONDecoder()
    i = _SKIP.match(text, 0).end()
    if i >= len(text):
        return
    if text[i] != "[":
        try:
            yield decoder.raw_decode(text, i)[0]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return
    i += 1
    count = 0
    while True:
        i = _SKIP.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            warnings.warn(f"{path}: JSON ends early after {count} complete elements; using those", stacklevel=2)
            return
        count += 1
        yield value


def iter_documents(path: str | os.PathLike) -> Iterator[str | np.ndarray]:
    """Documents of a corpus file: ``.jsonl`` (one JSON value per line), ``.json`` (an array, possibly truncated),
    anything else as one plain-text document. A document is text, or token ids (:func:`documents_from_json`)."""
    path = os.fspath(path)
    suffix = Path(path).suffix.lower()
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
                    yield from documents_from_json(obj)
    elif suffix == ".json":
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for value in iter_json_values(text, path):
            yield from documents_from_json(value)
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text:
            yield text


def _tokenised(documents: Iterable[str | np.ndarray], tokenizer: Any, batch_size: int) -> Iterator[np.ndarray]:
    """Token ids of each document, in order: texts through ``tokenizer``, ``batch_size`` a call; ids as they are."""
    batch: list[str] = []

    def flush() -> list[np.ndarray]:
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"] if batch else []
        batch.clear()
        return [np.asarray(i, dtype=np.int32) for i in ids]

    for doc in documents:
        if isinstance(doc, str):
            batch.append(doc)
            if len(batch) == batch_size:
                yield from flush()
        else:
            yield from flush()  # the texts before an id list keep their place
            yield doc
    yield from flush()


def build_datastore(tokenizer_name_or_path: str, files: Iterable[str | os.PathLike], out_path: str | os.PathLike, *,
                    max_tokens: int | None = None, batch_size: int = 64, progress: bool = True,
                    tokenizer: Any = None) -> DatastoreHeader:
    """Tokenise corpus ``files`` (text / jsonl / JSON incl. ShareGPT; token-id lists under :data:`TOKEN_ID_KEYS` as
    they are) and write a datastore to ``out_path``.

    ``tokenizer`` (anything callable like a Hugging Face tokenizer, returning ``{"input_ids": [...]}`` for a list of
    strings, with ``len()`` = vocabulary size) overrides loading ``tokenizer_name_or_path`` with
    ``transformers.AutoTokenizer``."""
    from tqdm import tqdm

    if tokenizer is None:
        tokenizer = _load_tokenizer(tokenizer_name_or_path)
    vocab_size = len(tokenizer)
    files = [os.fspath(f) for f in files]
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"corpus file not found: {f}")
    bar = tqdm(desc="tokenising", unit="doc", disable=not progress)

    def documents() -> Iterator[np.ndarray]:
        for f in files:
            bar.set_postfix_str(os.path.basename(f))
            for ids in _tokenised(iter_documents(f), tokenizer, batch_size):
                bar.update(1)
                yield ids

    try:
        return build_from_token_documents(documents(), out_path, vocab_size=vocab_size,
                                          tokenizer=str(tokenizer_name_or_path), max_tokens=max_tokens)
    finally:
        bar.close()


def _load_tokenizer(name_or_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
