"""The CPU demos' data: the docstrings of Python's standard library (``data.path: builtin:stdlib-docs``), and
conversations about its public functions, classes and methods, each answered with the first paragraph of its
docstring (``builtin:stdlib-chat``);
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
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from mobius.parallel import usable_cores

log = logging.getLogger(__name__)
MAX_WORKERS = 8
SKIPPED = frozenset({"site-packages", "test", "idlelib", "lib2to3", "tkinter", "turtledemo", "dist-packages"})
_HAS_DOCSTRING = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
T = TypeVar("T")
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
    return _parsed(files, file_docstrings, workers)


def _parsed(files: list[Path], parse: Callable[[Path], list[T]], workers: int | None) -> Iterator[T]:
    """What ``parse`` (a module-level function) finds in each of ``files``, file by file in their order, parsed by
    ``workers`` processes (see :func:`docstrings_in`)."""
    workers, done = min(workers or usable_cores(), MAX_WORKERS, len(files)), 0  # done: files whose results came
    if workers > 1:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            for found in pool.map(parse, files, chunksize=8):
                yield from found
                done += 1
        except BrokenProcessPool:  # (a script without the `if __name__ == "__main__":` guard: each spawned
            # process runs it again and stops, as Python's message says); the files left are parsed here
            log.warning("the processes parsing the standard library stopped (see above); parsing it in this process")
        finally:  # (also when the reader stops early: the files not parsed yet are dropped)
            pool.shutdown(cancel_futures=True)
    for path in files[done:]:
        yield from parse(path)


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


# ---------------------------------------------------------------------------------------------
# Conversations (builtin:stdlib-chat)
# ---------------------------------------------------------------------------------------------
QUESTIONS = ("What does the {kind} `{name}` do?", "What is `{name}` in Python's standard library?",
             "Explain `{name}` in a few words.", "What is the Python {kind} `{name}` for?")


def stdlib_conversations(workers: int | None = None) -> Iterator[list[dict]]:
    """A user asks what a public function, class or method of the standard library does; the assistant answers
    with the first paragraph of its docstring. The question's wording is chosen by the name (deterministic)."""
    for name, kind, doc in _parsed(stdlib_files(), file_definitions, workers):
        answer = " ".join(doc.split("\n\n")[0].split())
        question = QUESTIONS[zlib.crc32(name.encode()) % len(QUESTIONS)].format(kind=kind, name=name)
        yield [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def file_definitions(path: Path) -> list[tuple[str, str, str]]:
    """(qualified name, kind, docstring) of a module's public functions and classes and their public methods, in
    their order (a private module has none)."""
    parts = path.relative_to(sysconfig.get_paths()["stdlib"]).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    if any(p.startswith("_") for p in parts):
        return []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return []
    return list(_definitions(tree.body, ".".join(parts), in_class=False))


def _definitions(body: list[ast.stmt], prefix: str, in_class: bool) -> Iterator[tuple[str, str, str]]:
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        name, doc = f"{prefix}.{node.name}", ast.get_docstring(node)
        kind = "class" if isinstance(node, ast.ClassDef) else "method" if in_class else "function"
        if doc and doc.strip():
            yield name, kind, doc
        if isinstance(node, ast.ClassDef):
            yield from _definitions(node.body, name, in_class=True)
