"""Every input a user can get wrong ends in one clear line and exit code 2, before any run directory
exists; nothing a user owns is overwritten; no file a user is given can run code."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mobius import cli
from mobius.config import ConfigError, config_from_dict, load_config

TINY = "model:\n  preset: gpt2-tiny\ndata:\n  path: {data}\n  seq_len: 16\n  cache_dir: {cache}\n" \
       "train:\n  max_steps: 2\n  micro_batch_size: 2\n  micro_batches: 1\n  eval_every: 0\n" \
       "parallel:\n  mode: single\n  device: cpu\noutput:\n  dir: {out}\n  plot: false\n"


@pytest.fixture
def run_yaml(tmp_path: Path, text_file: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(TINY.format(data=text_file, cache=tmp_path / "cache", out=tmp_path / "out"))
    return path


def _binary(tmp_path: Path, name: str) -> Path:
    f = tmp_path / name
    f.write_bytes(bytes(range(256)) * 64)
    return f


def _latin1(tmp_path: Path, name: str) -> Path:
    f = tmp_path / name
    f.write_bytes(("caf\xe9 na\xefve r\xe9sum\xe9 " * 200).encode("latin-1"))
    return f


def _unsupported_family(tmp_path: Path) -> Path:
    d = tmp_path / "falcon"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 64}))
    return d


CASES = {  # name -> (extra CLI arguments given the tmp dir, the message expected)
    "misspelt key": (lambda t: ["--train.lrr=1e-3"], "unknown key train.lrr (did you mean train.lr?)"),
    "lr nan": (lambda t: ["--train.lr=.nan"], "train.lr must be a finite number, got nan"),
    "lr inf": (lambda t: ["--train.lr=inf"], "train.lr must be a finite number, got inf"),
    "lr negative": (lambda t: ["--train.lr=-1e-3"], "train.lr must be > 0, got -0.001"),
    "ratio below 0": (lambda t: ["--train.min_lr_ratio=-0.1"], "train.min_lr_ratio must be >= 0 and <= 1, got -0.1"),
    "override not YAML": (lambda t: ["--train.lr=[1, 2"], "override --train.lr: '[1, 2' is not a valid YAML value"),
    "missing checkpoint": (lambda t: [f"--model.checkpoint={t / 'nowhere'}"], "no such directory"),
    "unsupported family": (lambda t: [f"--model.checkpoint={_unsupported_family(t)}"],
                           "model_type 'falcon' is not supported"),
    "binary .jsonl": (lambda t: [f"--data.path={_binary(t, 'x.jsonl')}"], "not a text file (a NUL byte at byte offset 0)"),
    "binary .txt": (lambda t: [f"--data.path={_binary(t, 'x.txt')}"], "not a text file (a NUL byte at byte offset 0)"),
    "latin-1 text": (lambda t: [f"--data.path={_latin1(t, 'x.txt')}"], "not UTF-8 text (800 invalid byte(s)"),
    "missing data": (lambda t: [f"--data.path={t / 'none.txt'}"], "data.path"),
    "missing tokenizer": (lambda t: [f"--data.tokenizer={t / 'tok.json'}"], "data.tokenizer"),
    "resume without checkpoints": (lambda t: ["--resume"], "--resume: no step checkpoint under"),
    "resume and overwrite": (lambda t: ["--resume", "--overwrite"], "pass one of them"),
    "unknown mode": (lambda t: ["--parallel.mode=turbo"], "parallel.mode must be one of"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_input_is_one_line_and_exit_2_before_any_run_directory(case: str, run_yaml: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    extra, message = CASES[case]
    code = cli.main(["train", str(run_yaml), *extra(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("mobius: error: "), err
    assert message in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_config_file_that_is_not_utf8_names_the_file_and_offset(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    f = tmp_path / "run.yaml"
    f.write_bytes(b"model:\n  preset: gpt2-tiny\n# caf\xe9\n")
    assert cli.main(["train", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mobius: error: {f}: not UTF-8 text (byte 0xe9 at offset 32 cannot be read); save the file as UTF-8"


def test_a_finished_run_is_not_overwritten_unless_asked(run_yaml: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", str(run_yaml)]) == 0
    final = tmp_path / "out" / "final" / "model.safetensors"
    before = final.stat().st_mtime_ns
    assert cli.main(["train", str(run_yaml)]) == 2
    assert "already holds a run (metrics.jsonl, final)" in capsys.readouterr().err
    assert final.stat().st_mtime_ns == before
    assert cli.main(["train", str(run_yaml), "--overwrite"]) == 0
    assert final.stat().st_mtime_ns != before
    assert not (tmp_path / "out" / ".mobius-replaced").exists()  # the old run went with the new one's checkpoint


def test_resume_removes_what_an_interrupted_checkpoint_write_left(run_yaml: Path, tmp_path: Path) -> None:
    assert cli.main(["train", str(run_yaml), "--output.save_every=1", "--train.max_steps=4"]) == 0
    ckpts = tmp_path / "out" / "checkpoints"
    stale, other = ckpts / ".step-000005.tmp-abc123", ckpts / ".mine"
    stale.mkdir()
    other.mkdir()  # not mobius's naming: left alone
    shutil.rmtree(tmp_path / "out" / "final")
    assert cli.main(["train", str(run_yaml), "--resume", "--output.save_every=1", "--train.max_steps=5"]) == 0
    assert not stale.exists() and other.exists()


class _Boom:
    """Unpickling this runs code: it creates a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_resume_state_never_runs_code_from_a_crafted_pickle(run_yaml: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["train", str(run_yaml), "--output.save_every=1"]) == 0
    step = tmp_path / "out" / "checkpoints" / "step-000001"
    marker = tmp_path / "pwned"
    (step / "trainer_state.json").unlink()
    (step / "trainer_state.pt").write_bytes(pickle.dumps(_Boom(marker)))
    shutil.rmtree(tmp_path / "out" / "final")
    assert cli.main(["train", str(run_yaml), "--resume", str(step)]) == 2
    assert "never loaded" in capsys.readouterr().err and not marker.exists()
    # weights as a pickle (pytorch_model.bin) are read with torch's weights-only unpickler
    for f in step.glob("model*.safetensors"):
        f.unlink()
    torch.save({"transformer.wte.weight": _Boom(marker)}, step / "pytorch_model.bin")
    assert cli.main(["train", str(run_yaml), f"--model.checkpoint={step}", "--output.dir=" + str(tmp_path / "b")]) == 2
    assert "pickled code is never loaded" in capsys.readouterr().err and not marker.exists()


def test_a_library_warning_reaches_the_user_as_one_line_naming_the_library(run_yaml: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Issue 65: Python prints a warning as two lines (the message, then the source line that issued it); the
    ``mobius`` command logs its first line, naming its category and the library that issued it."""
    import types
    import warnings

    from mobius.app.library_warnings import show_one_line

    assert cli.main(["train", str(run_yaml), "--train.lrr=1"]) == 2  # any command, however it ends
    assert warnings.showwarning is show_one_line
    lib = types.ModuleType("somelib.core")
    exec("import warnings\ndef deprecated():\n    warnings.warn('first line\\nsecond line', FutureWarning, "
         "stacklevel=2)\n", lib.__dict__)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show_one_line
        lib.deprecated()
    assert caplog.messages == ["FutureWarning from somelib: first line"]


# ---- the config loader never fails with anything but ConfigError ------------------------------------
KEYS = {"model": ["checkpoint", "preset", "dropout", "activation_checkpointing", "junk"],
        "train": ["lr", "max_steps", "micro_batches", "min_lr_ratio", "beta1", "precision", "grad_clip", "seed"],
        "data": ["seq_len", "val_fraction", "path"], "parallel": ["mode", "devices", "p2p", "stages"],
        "output": ["save_every", "keep_last", "dir"], "zero": ["chunk_size", "gpu_chunks"], "nonsense": ["x"]}
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                   st.text(max_size=12), st.sampled_from(["gpt2-tiny", "auto", "bf16", "pipeline", "1e-4", "on"]),
                   st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
SECTIONS = st.dictionaries(st.sampled_from(sorted(KEYS)), st.one_of(
    st.dictionaries(st.sampled_from(sorted({k for ks in KEYS.values() for k in ks})), VALUES, max_size=4),
    VALUES), max_size=5)


@given(SECTIONS)
@settings(max_examples=300, deadline=None)
def test_any_mapping_gives_a_config_or_a_config_error(raw: dict) -> None:
    try:
        config_from_dict(raw, "fuzz.yaml")
    except ConfigError as e:
        assert str(e).startswith("fuzz.yaml: ") or "model." in str(e)


@given(st.text(max_size=200))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_file_text_gives_a_config_or_a_config_error(tmp_path: Path, text: str) -> None:
    f = tmp_path / "fuzz.yaml"
    f.write_text(text, encoding="utf-8")
    try:
        load_config(f)
    except ConfigError:
        pass


def test_the_help_states_each_numbers_domain() -> None:
    from mobius.config import describe_fields

    text = describe_fields()
    assert "train.lr (default 0.0003, > 0)" in text and "train.min_lr_ratio (default 0.1, >= 0 and <= 1)" in text
    assert yaml.safe_load("x: .nan")["x"] != yaml.safe_load("x: .nan")["x"]  # YAML's nan is a float nan
