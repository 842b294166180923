"""Tokenizers and packed, cached, resumable training data from local files.

* Tokenizers go through the ``tokenizers`` library: the checkpoint's own ``tokenizer.json`` (or
  GPT-2 style ``vocab.json`` + ``merges.txt``), or a byte-level tokenizer (256 byte tokens and an
  end-of-text token) for from-scratch runs, which is also saved as a ``tokenizer.json``.
* Text comes from ``.txt`` files (one document each), ``.jsonl`` files (one document per record,
  field configurable) or directories of them; ``builtin:stdlib-docs`` gathers the docstrings of
  Python's standard library, text present wherever Python is.
* Documents are tokenized once, each followed by the end-of-text token (and preceded by the
  beginning-of-text token when the checkpoint's ``tokenizer_config.json`` names one apart from it,
  as Llama 3 and Mistral were trained), and cached as a memory-mapped array
  keyed by the sources and the tokenizer, with a fingerprint of the documents' content that
  checkpoints keep (a resume checks it); training reads blocks of ``seq_len + 1`` tokens in a
  seeded, per-epoch shuffled order whose position is saved with checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

from mobius.batch import MicroBatch
from mobius.errors import ConfigError, DataError, MobiusError
from mobius.files import write_text_atomic
from mobius.stdlib_docs import stdlib_docstrings

if TYPE_CHECKING:
    import tokenizers

log = logging.getLogger(__name__)

BUILTIN_STDLIB = "builtin:stdlib-docs"
EOT = "<|endoftext|>"
MAX_INVALID_UTF8 = 0.001  # share of a data file's bytes that may be invalid UTF-8 (each read as U+FFFD)
REPLACEMENT = "\ufffd"


# ---------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------
@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the tokens mobius packs documents with: ``[bos] doc eos``."""

    tokenizer: "tokenizers.Tokenizer"
    eos_id: int
    name: str  # identifies the tokenizer (and its bos / eos choice) in cache keys
    bos_id: int | None = None  # begins every document (the checkpoint's tokenizer config names one apart from eos)
    config: dict | None = None  # the tokenizer_config.json it came with, written back with checkpoints

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def pack(self, ids: list[int]) -> list[int]:
        """One document's ids as training text: ``[bos] ids eos``."""
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def save(self, directory: Path) -> dict[str, Path]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (the checkpoint's own, or a minimal
        one naming the end-of-text token); returns name -> path."""
        directory.mkdir(parents=True, exist_ok=True)
        tok = directory / "tokenizer.json"
        self.tokenizer.save(str(tok))
        conf = directory / "tokenizer_config.json"
        if self.config is not None:
            conf.write_text(json.dumps(self.config, indent=2, ensure_ascii=False) + "\n")
        else:
            eos = self.tokenizer.id_to_token(self.eos_id)
            conf.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                                        "bos_token": eos, "unk_token": eos}, indent=2) + "\n")
        return {"tokenizer.json": tok, "tokenizer_config.json": conf}


def byte_tokenizer() -> TextTokenizer:
    """256 byte tokens (GPT-2's byte-to-unicode alphabet, no merges) and ``<|endoftext|>`` = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return TextTokenizer(tok, tok.token_to_id(EOT), "bytes-v1")


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256+n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def _eos_of(tok: "tokenizers.Tokenizer", path: Path) -> int:
    for candidate in (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>"):
        i = tok.token_to_id(candidate)
        if i is not None:
            return i
    raise MobiusError(f"{path}: tokenizer has no end-of-text token (looked for {EOT}, </s>, <eos>, <|end_of_text|>)")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_ids(tok: "tokenizers.Tokenizer", file: Path) -> tuple[int | None, int, dict | None]:
    """(bos, eos, config) from the ``tokenizer_config.json`` beside ``file``: its eos_token ends every
    document; its bos_token begins every one when it differs from eos and ``add_bos_token`` is not
    false (Llama 3, Mistral; Qwen names none). Without a config: no bos, eos found by name."""
    conf_file = file.parent / "tokenizer_config.json"
    if not conf_file.is_file():
        return None, _eos_of(tok, file), None
    try:
        conf = json.loads(conf_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MobiusError(f"{conf_file}: cannot be read as JSON ({e})") from None
    ids = {}
    for role in ("bos", "eos"):
        text = _token_text(conf.get(f"{role}_token"))
        ids[role] = tok.token_to_id(text) if text else None
        if text and ids[role] is None:
            raise MobiusError(f"{conf_file}: {role}_token {text!r} is not in the tokenizer's vocabulary")
    eos = ids["eos"] if ids["eos"] is not None else _eos_of(tok, file)
    bos = ids["bos"] if ids["bos"] != eos and conf.get("add_bos_token", True) is not False else None
    return bos, eos, conf


def load_tokenizer(spec: str | None, checkpoint: str | None) -> TextTokenizer:
    """The tokenizer a run uses: ``spec`` if given, else the checkpoint's own, else byte-level."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    for base in ([Path(spec)] if spec else []) + ([Path(checkpoint)] if checkpoint and not spec else []):
        file = base if base.is_file() else base / "tokenizer.json"
        if file.is_file():
            try:
                tok = Tokenizer.from_file(str(file))
            except Exception as e:  # tokenizers raises its own Exception type
                raise MobiusError(f"{file}: not a valid tokenizer.json ({e})") from e
            bos, eos, conf = _special_ids(tok, file)
            return TextTokenizer(tok, eos, f"{_file_digest(file)}:b{bos}:e{eos}", bos, conf)
        vocab, merges = base / "vocab.json", base / "merges.txt"
        if vocab.is_file() and merges.is_file():
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            return TextTokenizer(tok, _eos_of(tok, vocab), _file_digest(vocab) + _file_digest(merges))
        if spec:
            raise ConfigError(f"data.tokenizer {spec}: no tokenizer.json (or vocab.json + merges.txt) there")
        log.warning("checkpoint %s has no tokenizer files; using byte-level tokens", checkpoint)
    return byte_tokenizer()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------
def source_files(path: str) -> list[Path]:
    """The .txt / .jsonl files a ``data.path`` names, in a stable order."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path {path} does not exist")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl") and f.is_file())
    if not files:
        raise ConfigError(f"data.path {path} holds no .txt or .jsonl files")
    for f in files:
        if f.suffix not in (".txt", ".jsonl"):
            raise ConfigError(f"data.path {f}: only .txt and .jsonl files are supported")
    return files


def documents(path: str, text_field: str) -> Iterator[str]:
    """Every document of a data source, in order (each file checked to be text first)."""
    if path == BUILTIN_STDLIB:
        yield from stdlib_docstrings()
        return
    for f in source_files(path):
        if f.suffix == ".txt":
            yield read_text(f)
            continue
        for n, line in enumerate(text_lines(f), 1):  # split at "\n" only: JSON strings may hold U+2028
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{f}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{f}:{n}: record has no {text_field!r} field (set data.text_field)")
            yield str(record[text_field])


def read_text(path: Path) -> str:
    """A data file as text: refused when it holds a NUL byte (a binary file) or more than
    :data:`MAX_INVALID_UTF8` of its bytes are not UTF-8; a few invalid bytes read as U+FFFD."""
    return "".join(text_lines(path))


def text_lines(path: Path) -> Iterator[str]:
    """A data file's lines (each with its ``"\n"``), read one at a time: a large .jsonl file is never in memory
    whole (its bytes, its text and its lines at once took 2.9x the file). Refused as :func:`read_text` says: a
    NUL byte as soon as it is read, invalid UTF-8 once it passes the file's tolerance."""
    size, offset, invalid, first = path.stat().st_size, 0, 0, -1
    with path.open("rb") as fh:
        for raw in fh:
            nul = raw.find(b"\0")
            if nul >= 0:
                raise DataError(f"{path}: not a text file (a NUL byte at byte offset {offset + nul}); data must be "
                                "UTF-8 text")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                first = offset + e.start if first < 0 else first
                line = raw.decode("utf-8", errors="replace")
                invalid += line.count(REPLACEMENT) - raw.count(REPLACEMENT.encode())
                if invalid > MAX_INVALID_UTF8 * size:
                    raise DataError(f"{path}: not UTF-8 text ({invalid} invalid byte(s) in the first "
                                    f"{offset + len(raw)} of {size}, the first at byte offset {first}; at most "
                                    f"{100 * MAX_INVALID_UTF8:g}% are tolerated)") from None
            offset += len(raw)
            yield line
    if invalid:
        log.warning("%s: %d byte(s) are not UTF-8 (the first at byte offset %d); read as U+FFFD", path, invalid, first)


def _source_key(path: str, text_field: str) -> str:
    if path == BUILTIN_STDLIB:
        return f"{path}:{sys.version}:{sysconfig.get_paths()['stdlib']}"
    stats = [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in source_files(path)]
    return f"{text_field}|" + "|".join(stats)


# ---------------------------------------------------------------------------------------------
# Token cache
# ---------------------------------------------------------------------------------------------
def tokenize_to_cache(path: str, text_field: str, tokenizer: TextTokenizer, cache_dir: str) -> np.ndarray:
    """Token ids of all documents, each ``[bos] doc eos``, cached as a memory-mapped array."""
    return token_cache(path, text_field, tokenizer, cache_dir)[0]


def token_cache(path: str, text_field: str, tokenizer: TextTokenizer, cache_dir: str) -> tuple[np.ndarray, str]:
    """The cached token ids (tokenized on a cache miss) and the data's fingerprint: a hash of the
    documents' text, computed once while tokenizing and stored with the cache. The cache is found by
    the files' names, sizes and times; the fingerprint says what they held."""
    key = hashlib.sha256(f"{_source_key(path, text_field)}|{tokenizer.name}".encode()).hexdigest()[:20]
    cache = Path(cache_dir)
    file, meta_file = cache / f"tokens-{key}.bin", cache / f"tokens-{key}.json"
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    meta = _read_meta(meta_file) if file.is_file() else None
    if meta is not None:
        return np.memmap(file, dtype=meta["dtype"], mode="r", shape=(meta["tokens"],)), meta["fingerprint"]
    try:
        cache.mkdir(parents=True, exist_ok=True)
        n, fingerprint = _write_tokens(documents(path, text_field), tokenizer, cache, file, dtype, _source_bytes(path))
        if n == 0:
            raise MobiusError(f"data.path {path} holds no text")
        write_text_atomic(meta_file, json.dumps({"tokens": n, "dtype": np.dtype(dtype).name, "source": path,
                                                  "tokenizer": tokenizer.name, "fingerprint": fingerprint}))
    except OSError as e:  # a data file that cannot be read; a full disk, a read-only or missing cache directory
        where = Path(e.filename).resolve() if e.filename else None
        if where is not None and where != cache.resolve() and cache.resolve() not in where.parents:
            raise DataError(f"data.path {e.filename}: cannot be read ({e.strerror or e})") from None
        raise DataError(f"data.cache_dir {cache}: cannot write the token cache ({e.strerror or e})") from None
    return np.memmap(file, dtype=dtype, mode="r", shape=(n,)), fingerprint


def _read_meta(meta_file: Path) -> dict | None:
    """A cache's description; None when it is missing or from before fingerprints (tokenized again)."""
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and {"tokens", "dtype", "fingerprint"} <= set(meta) else None


def _source_bytes(path: str) -> int | None:
    """The size of a data source's files (None for the built-in text)."""
    return None if path == BUILTIN_STDLIB else sum(f.stat().st_size for f in source_files(path))


def _write_tokens(docs: Iterator[str], tokenizer: TextTokenizer, cache: Path, file: Path, dtype: type,
                  total_bytes: int | None) -> tuple[int, str]:
    """Tokenize ``docs`` into ``file`` (through a temporary); (tokens written, fingerprint). Before the
    first write, the free space is checked against the cache's size estimated from the first batch."""
    from tqdm import tqdm

    fd, tmp = tempfile.mkstemp(dir=cache, prefix=".tokens-", suffix=".tmp")
    n, read, digest = 0, 0, hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, tqdm(desc="tokenizing", unit=" docs", leave=False,
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
                    bar.update(len(batch))
                    batch = []
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n, digest.hexdigest()[:32]


def _check_space(cache: Path, tokens: float, dtype: type) -> None:
    """Refuse to start a token cache that the disk under ``cache`` cannot hold (with 5% to spare)."""
    need = int(1.05 * tokens * np.dtype(dtype).itemsize)
    free = shutil.disk_usage(cache).free
    if free < need:
        raise DataError(f"data.cache_dir {cache} has {free / 2**20:,.1f} MiB free, but the token cache needs about "
                        f"{need / 2**20:,.1f} MiB (estimated from the first documents); free some space or set "
                        f"data.cache_dir to another disk")


def _chain(a: Iterator, b: list) -> Iterator:
    yield from a
    yield from b


# ---------------------------------------------------------------------------------------------
# Blocks and the sampler
# ---------------------------------------------------------------------------------------------
class PackedBlocks:
    """Consecutive blocks of ``seq_len + 1`` tokens (neighbours share one token) over a token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, count: int | None = None):
        self.tokens, self.seq_len, self.start = tokens, seq_len, start
        total = (len(tokens) - 1) // seq_len
        self.count = total - start if count is None else count

    def __len__(self) -> int:
        return self.count

    def get(self, indices: np.ndarray) -> MicroBatch:
        """Blocks by index -> inputs [B, T], targets [B, T] (every token a target) as int64."""
        rows = [np.asarray(self.tokens[(self.start + i) * self.seq_len:(self.start + i + 1) * self.seq_len + 1])
                for i in indices]
        block = torch.from_numpy(np.stack(rows).astype(np.int64))  # [B, T + 1]
        return MicroBatch(block[:, :-1].contiguous(), block[:, 1:].contiguous())


@dataclass
class TrainData:
    """Train / eval split of the packed blocks and a resumable, seeded shuffled order."""

    train: PackedBlocks
    val: PackedBlocks
    seed: int
    position: int = 0  # samples drawn so far (the resumable state)
    fingerprint: str = ""  # the documents' content (:func:`token_cache`), checked when a run resumes

    def next_batch(self, batch_size: int) -> MicroBatch:
        """The next ``batch_size`` training blocks."""
        idx = np.array([self._index(self.position + i) for i in range(batch_size)])
        self.position += batch_size
        return self.train.get(idx)

    def peek_batches(self, batch_size: int, count: int) -> list[MicroBatch]:
        """The next ``count`` batches :meth:`next_batch` will give, without drawing them."""
        position = self.position
        try:
            return [self.next_batch(batch_size) for _ in range(count)]
        finally:
            self.position = position

    def _index(self, sample: int) -> int:
        epoch, offset = divmod(sample, len(self.train))
        if not hasattr(self, "_perm") or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = (epoch, rng.permutation(len(self.train)))
        return int(self._perm[1][offset])

    def eval_batches(self, batch_size: int, batches: int) -> Iterator[MicroBatch]:
        """Fixed held-out batches (the same ones at every evaluation)."""
        n = min(batches, len(self.val) // batch_size)
        for b in range(n):
            yield self.val.get(np.arange(b * batch_size, (b + 1) * batch_size))

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "train_blocks": len(self.train),
                "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state["train_blocks"] != len(self.train):
            raise MobiusError(f"the data changed since the checkpoint: {len(self.train)} training blocks now, "
                              f"{state['train_blocks']} then")
        self.position, self.seed = state["position"], state["seed"]


def build_data(tokens: np.ndarray, seq_len: int, val_fraction: float, seed: int, min_val_blocks: int = 1,
               fingerprint: str = "") -> TrainData:
    """Split packed blocks into training blocks and a held-out tail for evaluation."""
    total = (len(tokens) - 1) // seq_len
    n_val = max(min_val_blocks, int(total * val_fraction)) if val_fraction > 0 else 0
    if total - n_val < 1:
        raise MobiusError(f"the data holds {len(tokens)} tokens, too few for one training block of "
                          f"{seq_len + 1} tokens plus {n_val} held-out blocks; lower data.seq_len or add text")
    train = PackedBlocks(tokens, seq_len, 0, total - n_val)
    val = PackedBlocks(tokens, seq_len, total - n_val, n_val)
    return TrainData(train, val, seed, fingerprint=fingerprint)
