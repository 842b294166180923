"""Tokenizers, the token cache, packing, shuffling and the resumable position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import needs_proc, proc_status
from mobius.data import (BUILTIN_STDLIB, build_data, byte_tokenizer, documents, load_tokenizer,
                         tokenize_to_cache)
from mobius.errors import ConfigError, MobiusError
from mobius.stdlib_docs import docstrings_in, stdlib_docstrings, stdlib_files


def test_byte_tokenizer_round_trip(tmp_path: Path) -> None:
    tok = byte_tokenizer()
    text = "héllo\tworld\n  ünïcode ✓"
    ids = tok.encode_batch([text])[0]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 257 and tok.eos_id == 256
    saved = tok.save(tmp_path)
    again = load_tokenizer(str(tmp_path), None)
    assert again.encode_batch([text])[0] == ids and again.eos_id == 256
    assert "tokenizer.json" in saved


def test_checkpoint_tokenizer_files_are_used(tmp_path: Path) -> None:
    import json

    vocab = {ch: i for i, ch in enumerate(["a", "b", "c", "Ġ", "ab", "<|endoftext|>"])}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = load_tokenizer(None, str(tmp_path))
    assert tok.encode_batch(["ab c"])[0] == [4, 3, 2]
    assert tok.eos_id == 5
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing"), None)


def test_jsonl_text_field_and_errors(jsonl_file: Path, tmp_path: Path) -> None:
    docs = list(documents(str(jsonl_file), "body"))
    assert len(docs) == 200 and docs[3].startswith("record 3:")
    with pytest.raises(MobiusError, match=r"corpus\.jsonl:1: record has no 'text' field"):
        list(documents(str(jsonl_file), "text"))
    with pytest.raises(ConfigError, match="does not exist"):
        list(documents(str(tmp_path / "nothing"), "text"))


@needs_proc
def test_a_jsonl_file_is_read_a_line_at_a_time(tmp_path: Path) -> None:
    """Reading a 32 MB .jsonl file holds about one record, not the file's bytes, text and lines at once (2.9x the
    file); its records, a few invalid bytes (read as U+FFFD) and a blank line come out as before."""
    import json

    f = tmp_path / "big.jsonl"
    record = json.dumps({"text": "x" * 1000}) + "\n"
    f.write_bytes(record.encode() * 32_000 + b"\n" + b'{"text": "caf\xe9"}\n')
    Path("/proc/self/clear_refs").write_text("5")
    before = proc_status("VmRSS")
    count = 0
    for doc in documents(str(f), "text"):
        count += 1
    added = proc_status("VmHWM") - before
    assert count == 32_001 and doc == "caf\ufffd"
    assert added < 0.2 * f.stat().st_size, (added, f.stat().st_size)


def test_cache_is_reused_and_blocks_pack(text_file: Path, tmp_path: Path) -> None:
    tok = byte_tokenizer()
    cache = tmp_path / "cache"
    a = tokenize_to_cache(str(text_file), "text", tok, str(cache))
    files = sorted(cache.glob("tokens-*.bin"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    b = tokenize_to_cache(str(text_file), "text", tok, str(cache))
    assert files[0].stat().st_mtime_ns == mtime and np.array_equal(a, b)
    assert a[-1] == tok.eos_id and len(a) == len(text_file.read_bytes()) + 1
    data = build_data(a, seq_len=32, val_fraction=0.1, seed=0)
    batch = data.next_batch(3)
    x, y = batch.inputs, batch.targets
    assert x.shape == (3, 32) and y.shape == (3, 32) and batch.docs is None
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())  # targets are inputs shifted by one
    flat = np.asarray(a)  # every block is seq_len + 1 consecutive tokens of the cache, every token a target
    assert any(np.array_equal(np.append(x[0].numpy(), y[0, -1].numpy()), flat[i * 32:i * 32 + 33])
               for i in range(len(data.train)))
    assert batch.target_count == 3 * 32


def test_shuffle_is_seeded_and_resumable(text_file: Path, tmp_path: Path) -> None:
    tokens = tokenize_to_cache(str(text_file), "text", byte_tokenizer(), str(tmp_path))
    one = build_data(tokens, 16, 0.05, seed=1)
    two = build_data(tokens, 16, 0.05, seed=1)
    other = build_data(tokens, 16, 0.05, seed=2)
    seq_one = [one.next_batch(4).inputs for _ in range(5)]
    seq_two = [two.next_batch(4).inputs for _ in range(5)]
    assert all(np.array_equal(a, b) for a, b in zip(seq_one, seq_two))
    assert not np.array_equal(seq_one[0], other.next_batch(4).inputs)
    resumed = build_data(tokens, 16, 0.05, seed=1)
    resumed.load_state_dict(two.state_dict())
    assert np.array_equal(resumed.next_batch(4).inputs, two.next_batch(4).inputs)
    # peeking at the next step's batches (an engine that starts it early) draws nothing
    at = two.position
    peeked = two.peek_batches(4, 3)
    assert two.position == at and all(np.array_equal(p.inputs, two.next_batch(4).inputs) for p in peeked)
    # an epoch visits every training block once
    full = build_data(tokens, 16, 0.05, seed=3)
    seen = sorted(full._index(i) for i in range(len(full.train)))
    assert seen == list(range(len(full.train)))
    # held-out blocks are disjoint from training blocks and fixed
    ev1 = [b.inputs for b in full.eval_batches(2, 3)]
    ev2 = [b.inputs for b in full.eval_batches(2, 3)]
    assert all(np.array_equal(a, b) for a, b in zip(ev1, ev2)) and len(ev1) >= 1


def test_too_little_data_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "small.txt"
    f.write_text("tiny")
    tokens = tokenize_to_cache(str(f), "text", byte_tokenizer(), str(tmp_path))
    with pytest.raises(MobiusError, match="too few for one training block"):
        build_data(tokens, 64, 0.1, 0)


def test_stdlib_docstrings_exist_everywhere() -> None:
    first = [d for _, d in zip(range(50), stdlib_docstrings())]
    assert len(first) == 50 and all(isinstance(d, str) and d for d in first)
    assert BUILTIN_STDLIB == "builtin:stdlib-docs"


def test_docstrings_parsed_by_a_pool_come_in_the_files_order() -> None:
    """Two processes parse the files and the documents come out as one process reads them; a reader that
    stops early leaves no process behind."""
    import multiprocessing

    files = stdlib_files()[:48]
    alone = list(docstrings_in(files, workers=1))
    assert len(alone) > 100
    assert list(docstrings_in(files, workers=2)) == alone
    early = docstrings_in(files, workers=2)
    assert [d for _, d in zip(range(5), early)] == alone[:5]
    early.close()
    assert not multiprocessing.active_children()


def test_a_script_without_a_main_guard_gets_its_docstrings_parsed_in_its_own_process(tmp_path: Path) -> None:
    """Spawned processes run the main script again; one without the ``__main__`` guard stops each of them
    (Python says why), and the files are then parsed in the script's own process, all of them, in order."""
    import json
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("import json, sys\nfrom mobius.stdlib_docs import docstrings_in, stdlib_files\n"
                      "files = stdlib_files()[:24]\n"
                      "pooled, alone = list(docstrings_in(files, workers=2)), list(docstrings_in(files, workers=1))\n"
                      "print(json.dumps([pooled, alone]))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    pooled, alone = json.loads(r.stdout.splitlines()[-1])
    assert pooled == alone and len(alone) > 50
    assert "parsing it in this process" in r.stderr and "__main__" in r.stderr


def test_docstrings_come_in_ast_walks_order() -> None:
    """The statements-only walk finds what ``ast.walk`` finds, in its order (the demo's corpus stays as it was):
    definitions nested in classes, functions, branches, loops, handlers, ``with`` and ``match`` blocks."""
    import ast
    import sysconfig

    from mobius.stdlib_docs import docstrings_of

    source = '''"""module"""
class A:
    """a"""
    def f(self):
        """f"""
        def g():
            """g"""
        return lambda: None
    async def h(self):
        """h"""
if x:
    def i():
        """i"""
else:
    class B:
        """b"""
try:
    def j():
        """j"""
except E:
    def k():
        """k"""
finally:
    def l():
        """l"""
for _ in y:
    with z:
        def m():
            """m"""
match w:
    case 1:
        def n():
            """n"""
def o():
    """o"""
'''
    root = Path(sysconfig.get_paths()["stdlib"])
    for tree in [ast.parse(source)] + [ast.parse((root / f).read_text(encoding="utf-8"))
                                      for f in ("argparse.py", "dataclasses.py", "typing.py", "asyncio/tasks.py")]:
        walked = [ast.get_docstring(n) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        assert list(docstrings_of(tree)) == [d for d in walked if d]
    assert sorted(docstrings_of(ast.parse(source))) == sorted("module a b f g h i j k l m n o".split())
