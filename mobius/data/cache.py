"""Token caches in ``data.cache_dir``, memory-mapped, written through temporary files and renamed into place
(a description written last says the cache is whole), each with a fingerprint of what it holds that
checkpoints keep (a resume checks it).

* Text: the documents' tokens end to end, each ``[bos] doc eos``; keyed by the sources (names, sizes,
  times), ``data.text_field`` and the tokenizer; the fingerprint hashes the documents' text.
* Conversations: their tokens end to end, a target flag per token and where each conversation starts and
  was read; keyed by the sources, the tokenizer and its special tokens, the template's content and
  ``data.train_on``; the fingerprint hashes the tokens, flags and lengths. A conversation with no target
  token is left out, counted, and the first of them named.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np

from mobius.data.chat import ChatTemplate, Encoded, TrainOn, encode, render_with_targets
from mobius.data.sources import BUILTINS, Where, documents, source_bytes, source_key
from mobius.data.tokenizer import TextTokenizer
from mobius.errors import DataError, MobiusError
from mobius.files import write_text_atomic

CHAT_FORMAT = "chat-v1"  # the conversation cache's layout and rules; a change makes new keys
BATCH = 512  # conversations rendered and tokenized together


def _dtype(tokenizer: TextTokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------
def tokenize_to_cache(path: str, text_field: str, tokenizer: TextTokenizer, cache_dir: str) -> np.ndarray:
    """Token ids of all documents, each ``[bos] doc eos``, cached as a memory-mapped array."""
    return token_cache(path, text_field, tokenizer, cache_dir)[0]


def token_cache(path: str, text_field: str, tokenizer: TextTokenizer, cache_dir: str) -> tuple[np.ndarray, str]:
    """The cached token ids (tokenized on a cache miss) and the data's fingerprint: a hash of the
    documents' text, computed once while tokenizing and stored with the cache. The cache is found by
    the files' names, sizes and times; the fingerprint says what they held."""
    where = source_key(path) if path in BUILTINS else f"{text_field}|{source_key(path)}"
    key = hashlib.sha256(f"{where}|{tokenizer.name}".encode()).hexdigest()[:20]
    cache = Path(cache_dir)
    file, meta_file = cache / f"tokens-{key}.bin", cache / f"tokens-{key}.json"
    dtype = _dtype(tokenizer)
    meta = _read_meta(meta_file, {"tokens", "dtype", "fingerprint"}) if file.is_file() else None
    if meta is not None:
        return np.memmap(file, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],)), meta["fingerprint"]
    with _cache_errors(cache):
        cache.mkdir(parents=True, exist_ok=True)
        n, docs, fingerprint = _write_tokens(documents(path, text_field), tokenizer, cache, file, dtype,
                                             source_bytes(path))
        if n == 0:
            raise MobiusError(f"data.path {path} holds no text")
        write_text_atomic(meta_file, json.dumps({"tokens": n, "dtype": np.dtype(dtype).name, "source": path,
                                                  "tokenizer": tokenizer.name, "fingerprint": fingerprint,
                                                  "documents": docs}))
    return np.memmap(file, dtype=dtype, mode="r", shape=(n,)), fingerprint


def text_documents(path: str, text_field: str, tokenizer: TextTokenizer, cache_dir: str) -> int | None:
    """How many documents a text cache holds (None for a cache from before they were counted)."""
    where = source_key(path) if path in BUILTINS else f"{text_field}|{source_key(path)}"
    key = hashlib.sha256(f"{where}|{tokenizer.name}".encode()).hexdigest()[:20]
    meta = _read_meta(Path(cache_dir) / f"tokens-{key}.json", {"documents"})
    return None if meta is None else meta["documents"]


@contextlib.contextmanager
def _cache_errors(cache: Path) -> Iterator[None]:
    """An OSError as the data file that cannot be read, or the cache that cannot be written (a full disk, a
    read-only or missing cache directory)."""
    try:
        yield
    except OSError as e:
        where = Path(e.filename).resolve() if e.filename else None
        if where is not None and where != cache.resolve() and cache.resolve() not in where.parents:
            raise DataError(f"data.path {e.filename}: cannot be read ({e.strerror or e})") from None
        raise DataError(f"data.cache_dir {cache}: cannot write the token cache ({e.strerror or e})") from None


def _read_meta(meta_file: Path, needed: set[str]) -> dict | None:
    """A cache's description; None when it is missing or lacks ``needed`` (made again)."""
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and needed <= set(meta) else None


def _write_tokens(docs: Iterator[str], tokenizer: TextTokenizer, cache: Path, file: Path, dtype: type,
                  total_bytes: int | None) -> tuple[int, int, str]:
    """Tokenize ``docs`` into ``file`` (through a temporary); (tokens written, documents, fingerprint). Before
    the first write, the free space is checked against the cache's size estimated from the first batch."""
    from tqdm import tqdm

    n, docs_read, read, digest = 0, 0, 0, hashlib.sha256()
    with _temporary(cache, file) as out, tqdm(desc="tokenizing", unit=" docs", leave=False,
                                              disable=not sys.stderr.isatty()) as bar:
        batch: list[str] = []
        for doc in _chain(docs, [None]):
            if doc is not None:
                batch.append(doc)
                text = doc.encode("utf-8", "surrogatepass")
                digest.update(len(text).to_bytes(8, "little") + text)
                read += len(text)
            if batch and (doc is None or len(batch) == 256):
                packed = [tokenizer.pack(ids) for ids in tokenizer.encode_batch(batch)]
                if n == 0 and total_bytes:
                    _check_space(cache, sum(map(len, packed)) / max(read, 1) * total_bytes, dtype)
                for ids in packed:
                    np.asarray(ids, dtype=dtype).tofile(out)
                    n += len(ids)
                docs_read += len(batch)
                bar.update(len(batch))
                batch = []
    return n, docs_read, digest.hexdigest()[:32]


@contextlib.contextmanager
def _temporary(cache: Path, file: Path) -> Iterator[BinaryIO]:
    """A file opened for writing under a temporary name in ``cache``, renamed to ``file`` when the block ends
    without an error (removed when it ends with one)."""
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{file.name}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_space(cache: Path, tokens: float, dtype: type, per_token: int = 0) -> None:
    """Refuse to start a token cache that the disk under ``cache`` cannot hold (with 5% to spare); ``per_token``:
    bytes stored per token besides its id."""
    need = int(1.05 * tokens * (np.dtype(dtype).itemsize + per_token))
    free = shutil.disk_usage(cache).free
    if free < need:
        raise DataError(f"data.cache_dir {cache} has {free / 2**20:,.1f} MiB free, but the token cache needs about "
                        f"{need / 2**20:,.1f} MiB (estimated from the first documents); free some space or set "
                        f"data.cache_dir to another disk")


def _chain(a: Iterator, b: list) -> Iterator:
    yield from a
    yield from b


# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------
@dataclass
class ChatCache:
    """Conversations as tokens: conversation ``r`` is ``tokens[starts[r]:starts[r + 1]]``, its targets where
    ``targets`` is 1; it was read at ``where(r)``."""

    tokens: np.ndarray  # [N] uint16 / uint32, memory-mapped
    targets: np.ndarray  # [N] uint8, memory-mapped: 1 where the token is a target
    starts: np.ndarray  # [R + 1] int64
    hits: np.ndarray  # [R] int64: target tokens of each conversation
    origins: np.ndarray  # [R, 2] int64: (index into sources, line / item / row / record)
    sources: list[tuple[str, str]]  # (file or built-in source, how its records are counted: Where.kind)
    fingerprint: str
    records: int  # records read, those left out included
    no_target: int  # records left out: no target token
    no_target_at: str | None  # where the first of them was read

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def lengths(self) -> np.ndarray:
        """[R] tokens of each conversation."""
        return np.diff(self.starts)

    def where(self, r: int) -> Where:
        source, kind = self.sources[int(self.origins[r, 0])]
        return Where(source, kind, int(self.origins[r, 1]))  # type: ignore[arg-type]


Conversations = Callable[[], Iterator[tuple[Where, list[dict]]]]  # the records as messages, read anew per call


def chat_cache(path: str, conversations: Conversations, template: ChatTemplate, train_on: TrainOn,
               tokenizer: TextTokenizer, cache_dir: str) -> ChatCache:
    """The cached conversations of data source ``path`` (rendered, tokenized and flagged on a cache miss); a source
    none of whose conversations has a target token is a :class:`DataError`, and leaves no cache."""
    key = hashlib.sha256(f"{CHAT_FORMAT}|{source_key(path)}|{tokenizer.name}|"
                         f"{json.dumps(template.tokens, sort_keys=True)}|{template.digest}|{train_on}".encode())
    cache = Path(cache_dir)
    files = {part: cache / f"chat-{key.hexdigest()[:20]}.{part}" for part in ("tokens", "targets", "index.npz", "json")}
    meta = _read_meta(files["json"], {"tokens", "dtype", "fingerprint", "records", "no_target", "sources"})
    if meta is None:
        with _cache_errors(cache):
            cache.mkdir(parents=True, exist_ok=True)
            meta = _write_chat(conversations(), template, train_on, tokenizer, cache, files, source_bytes(path))
            if meta["tokens"] == 0:
                for file in files.values():
                    file.unlink(missing_ok=True)
                raise DataError(f"data.path {path}: none of its {meta['records']} records has a target token "
                                f"(data.train_on={train_on}; the first: {meta['no_target_at']})")
            write_text_atomic(files["json"], json.dumps(meta))
    index, n = np.load(files["index.npz"]), meta["tokens"]
    return ChatCache(_mapped(files["tokens"], meta["dtype"], n), _mapped(files["targets"], np.uint8, n),
                     index["starts"], index["hits"],
                     index["origins"], [tuple(s) for s in meta["sources"]], meta["fingerprint"], meta["records"],
                     meta["no_target"], meta.get("no_target_at"))


def _mapped(file: Path, dtype: type | str, n: int) -> np.ndarray:
    """``n`` values of ``dtype`` memory-mapped from ``file`` (none: an empty array, as an empty file cannot be)."""
    return np.memmap(file, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype=dtype)


def _write_chat(conversations: Iterator[tuple[Where, list[dict]]], template: ChatTemplate, train_on: TrainOn,
                tokenizer: TextTokenizer, cache: Path, files: dict[str, Path], total_bytes: int | None) -> dict:
    """Render, tokenize and flag ``conversations`` into the cache's files, a batch at a time; its description."""
    dtype, digest = _dtype(tokenizer), hashlib.sha256()
    writer = _ChatWriter(dtype, digest)
    with _temporary(cache, files["tokens"]) as tokens_out, _temporary(cache, files["targets"]) as targets_out:
        for wheres, chars, enc in _encoded(conversations, template, train_on, tokenizer):
            if writer.tokens == 0 and total_bytes:
                _check_space(cache, len(enc.ids) / max(chars, 1) * total_bytes, dtype, per_token=1)
            writer.add(enc, wheres, tokens_out, targets_out)
        with _temporary(cache, files["index.npz"]) as index_out:
            np.savez(index_out, starts=np.array(writer.starts, dtype=np.int64), hits=np.array(writer.hits, np.int64),
                     origins=np.array(writer.origins, dtype=np.int64).reshape(-1, 2))
    return {"tokens": writer.tokens, "dtype": np.dtype(dtype).name, "fingerprint": digest.hexdigest()[:32],
            "records": writer.records, "no_target": writer.no_target, "no_target_at": writer.no_target_at,
            "sources": [list(s) for s in writer.sources], "tokenizer": tokenizer.name, "template": template.origin,
            "train_on": train_on}


def _encoded(conversations: Iterator[tuple[Where, list[dict]]], template: ChatTemplate, train_on: TrainOn,
             tokenizer: TextTokenizer) -> Iterator[tuple[list[Where], int, Encoded]]:
    """Batches of conversations rendered (here) and tokenized (in a thread: the tokenizer leaves Python's lock
    while it works, so the next batch renders meanwhile): (where each was read, rendered characters, tokens)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    def rendered(batch: list[tuple[Where, list[dict]]]) -> tuple[list[Where], list[str], list]:
        texts, spans = zip(*(render_with_targets(template, messages, where, train_on) for where, messages in batch))
        return [where for where, _ in batch], list(texts), list(spans)

    with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
        pending: tuple[list[Where], int, Future] | None = None
        for batch in _batches(conversations, BATCH):
            wheres, texts, spans = rendered(batch)
            if pending is not None:
                yield pending[0], pending[1], pending[2].result()
            pending = wheres, sum(map(len, texts)), pool.submit(encode, tokenizer, texts, spans)
        if pending is not None:
            yield pending[0], pending[1], pending[2].result()


class _ChatWriter:
    """What :func:`_write_chat` has written: counts, conversation starts and where each was read."""

    def __init__(self, dtype: type, digest: "hashlib._Hash"):
        self.dtype, self.digest = dtype, digest
        self.tokens = self.records = self.no_target = 0
        self.no_target_at: str | None = None
        self.starts, self.hits, self.origins = [0], [], []
        self.sources: dict[tuple[str, str], int] = {}

    def add(self, enc: Encoded, wheres: list[Where], tokens_out: BinaryIO, targets_out: BinaryIO) -> None:
        """One batch's conversations, those with a target token written, the others counted."""
        starts = np.cumsum(enc.lengths) - enc.lengths  # [R]
        enc.targets[starts[enc.lengths > 0]] = False  # a conversation's first token follows nothing: never a label
        hits = np.add.reduceat(np.append(enc.targets, False).astype(np.int64), starts)  # [R] target tokens
        hits[enc.lengths == 0] = 0  # (reduceat of an empty slice gives the element at its start)
        keep = hits > 0
        self.records += len(wheres)
        if not keep.all():
            self.no_target += int((~keep).sum())
            self.no_target_at = self.no_target_at or str(wheres[int(np.argmin(keep))])
        kept = np.repeat(keep, enc.lengths)  # [N]
        ids, flags, lengths = enc.ids[kept].astype(self.dtype), enc.targets[kept].astype(np.uint8), enc.lengths[keep]
        for part in (ids, flags, lengths):
            self.digest.update(part.tobytes())
        ids.tofile(tokens_out)
        flags.tofile(targets_out)
        self.starts.extend((self.tokens + np.cumsum(lengths)).tolist())
        self.hits.extend(hits[keep].tolist())
        self.tokens += int(lengths.sum())
        for where in (w for w, k in zip(wheres, keep) if k):
            src = self.sources.setdefault((where.source, where.kind), len(self.sources))
            self.origins.append((src, where.index))


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
