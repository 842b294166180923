"""The CPU demo's text: the docstrings of Python's standard library (``data.path: builtin:stdlib-docs``),
parsed, never imported. The library's ~760 files take 2.5-3 s of CPU to parse on a 2-core VM, so a pool
of processes parses them (one per core, at most :data:`MAX_WORKERS`) while the main process tokenizes what
they send (the demo's first data phase: 2.1-2.2 s, against 5.8-6.6 s in one process); the documents come
out in the order of one process reading the files in sorted order. This module imports nothing heavy: the pool's
processes are spawned and import only it."""

from __future__ import annotations

import ast
import logging
import multiprocessing
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Iterator

from mobius.parallel import usable_cores

log = logging.getLogger(__name__)
MAX_WORKERS = 8
SKIPPED = frozenset({"site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "dist-packages"})
_HAS_DOCSTRING = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_BODIES = frozenset({"body", "handlers", "orelse", "finalbody", "cases"})  # fields holding statements (and handlers)


def stdlib_files() -> list[Path]:
    """The standard library's source files the demo reads, sorted (tests and GUI packages left out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py"))
            if p.relative_to(root).parts[0] not in SKIPPED and "tests" not in p.relative_to(root).parts]


def stdlib_docstrings(workers: int | None = None) -> Iterator[str]:
    """Docstrings of the standard library's modules, classes and functions (:func:`docstrings_in`)."""
    return docstrings_in(stdlib_files(), workers)


def docstrings_in(files: list[Path], workers: int | None = None) -> Iterator[str]:
    """The docstrings of ``files``, file by file in their order; ``workers`` processes parse them (default:
    one per core, at most :data:`MAX_WORKERS`; 1: this process alone)."""
    workers, done = min(workers or usable_cores(), MAX_WORKERS, len(files)), 0  # done: files whose docstrings came
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            for docs in pool.map(file_docstrings, files, chunksize=8):
                yield from docs
                done += 1
        except BrokenProcessPool:  # (a script without the `if __name__ == "__main__":` guard: each spawned
            # process runs it again and stops, as Python's message says); the files left are parsed here
            log.warning("the processes parsing the standard library stopped (see above); parsing it in this process")
        finally:  # (also when the reader stops early: the files not parsed yet are dropped)
            pool.shutdown(cancel_futures=True)
    for path in files[done:]:
        yield from file_docstrings(path)


def file_docstrings(path: Path) -> list[str]:
    """The docstrings of one source file (none when it does not parse or read as UTF-8)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    return list(docstrings_of(tree))


def docstrings_of(tree: ast.AST) -> Iterator[str]:
    """The docstrings in ``tree`` in ``ast.walk``'s order (breadth first), visiting statements only: a
    definition is never inside an expression, so the order is the same and the walk a third as long."""
    todo = [tree]
    while todo:
        level, todo = todo, []
        for node in level:
            if isinstance(node, _HAS_DOCSTRING):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc
            for name in node._fields:
                if name in _BODIES:
                    todo.extend(getattr(node, name))
