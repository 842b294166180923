"""The files a ``data.path`` names and the records in them, each with where it was read.

* ``.txt``: one text document per file.
* ``.jsonl``: one JSON record per line, read a line at a time (:func:`text_lines`).
* ``.json``: a JSON list of records.
* ``.parquet``: a table, one record per row (pyarrow, a row group at a time).
* a directory: every such file under it, in sorted order.

Built-in sources: ``builtin:stdlib-docs`` (text: the docstrings of Python's standard library) and
``builtin:stdlib-chat`` (conversations made from them: :func:`mobius.stdlib_docs.stdlib_conversations`).
"""

from __future__ import annotations

import json
import logging
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from mobius.errors import ConfigError, DataError

log = logging.getLogger(__name__)

BUILTIN_STDLIB = "builtin:stdlib-docs"
BUILTIN_STDLIB_CHAT = "builtin:stdlib-chat"
BUILTINS = (BUILTIN_STDLIB, BUILTIN_STDLIB_CHAT)
SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
MAX_INVALID_UTF8 = 0.001  # share of a data file's bytes that may be invalid UTF-8 (each read as U+FFFD)
REPLACEMENT = "\ufffd"
PARQUET_BATCH = 1024  # rows converted to Python at a time


@dataclass(frozen=True)
class Where:
    """Where a record was read: a line of a .jsonl file (from 1), an item of a .json list or a row of a
    .parquet table (from 0), or a record of a built-in source (from 0)."""

    source: str
    kind: Literal["line", "item", "row", "record"]
    index: int

    def __str__(self) -> str:
        return f"{self.source}:{self.index}" if self.kind == "line" else f"{self.source}: {self.kind} {self.index}"


def source_files(path: str) -> list[Path]:
    """The data files a ``data.path`` names, in a stable order."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path {path} does not exist")
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in SUFFIXES and f.is_file())
    if not files:
        raise ConfigError(f"data.path {path} holds no {', '.join(SUFFIXES)} files")
    for f in files:
        if f.suffix not in SUFFIXES:
            raise ConfigError(f"data.path {f}: only {', '.join(SUFFIXES)} files are supported")
    return files


def source_key(path: str) -> str:
    """What finds a source's cache: the built-in's Python, or the files' names, sizes and times."""
    if path in BUILTINS:
        return f"{path}:{sys.version}:{sysconfig.get_paths()['stdlib']}"
    return "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in source_files(path))


def source_bytes(path: str) -> int | None:
    """The size of a data source's files (None for a built-in one)."""
    return None if path in BUILTINS else sum(f.stat().st_size for f in source_files(path))


def records(file: Path) -> Iterator[tuple[Where, object]]:
    """The records of a .jsonl, .json or .parquet file, in order, each with where it was read."""
    if file.suffix == ".jsonl":
        for n, line in enumerate(text_lines(file), 1):  # split at "\n" only: JSON strings may hold U+2028
            if line.strip():
                try:
                    yield Where(str(file), "line", n), json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{file}:{n}: not valid JSON ({e.msg})") from None
    elif file.suffix == ".json":
        try:
            items = json.loads(read_text(file))
        except json.JSONDecodeError as e:
            raise DataError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
        if not isinstance(items, list):
            raise DataError(f"{file}: a .json data file holds a list of records, not a {type(items).__name__} "
                            f"(one record per line is a .jsonl file)")
        for i, item in enumerate(items):
            yield Where(str(file), "item", i), item
    elif file.suffix == ".parquet":
        yield from _parquet_rows(file)
    else:
        raise AssertionError(file)


def _parquet_rows(file: Path) -> Iterator[tuple[Where, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(file)
        n = 0
        for batch in table.iter_batches(batch_size=PARQUET_BATCH):
            for row in batch.to_pylist():
                yield Where(str(file), "row", n), row
                n += 1
    except pa.ArrowException as e:
        raise DataError(f"{file}: not a readable Parquet file ({e})") from None


def documents(path: str, text_field: str) -> Iterator[str]:
    """Every text document of a data source, in order (each file checked to be text first)."""
    if path == BUILTIN_STDLIB:
        from mobius.stdlib_docs import stdlib_docstrings

        yield from stdlib_docstrings()
        return
    if path == BUILTIN_STDLIB_CHAT:
        raise ConfigError(f"data.path {path} holds conversations: set data.format=chat (or auto)")
    for f in source_files(path):
        if f.suffix == ".txt":
            yield read_text(f)
            continue
        for where, record in records(f):
            if not isinstance(record, dict) or text_field not in record:
                raise DataError(f"{where}: record has no {text_field!r} field (set data.text_field)")
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
