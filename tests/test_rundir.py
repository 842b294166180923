"""Nothing lost, nothing silent (issue 25), tried in-process: every way a user's run directory, inputs,
resumed checkpoint, disk or zero-mode settings can be wrong ends in exit code 2 and one line naming
the key or file and the figures, with no traceback, no run directory made or changed where none
should be, and no worker started. The process-level ways of stopping are in test_supervision.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator

import pytest

from conftest import TEXT, make_hf_model
from mobius import cli
from mobius.app.rundir import LOCK_FILE, RunDir, recover, results
from mobius.checkpoint import ResumeState
from mobius.errors import ConfigError
from mobius.files import REPLACED_DIR

TINY = "model:\n  preset: gpt2-tiny\ndata:\n  path: {data}\n  seq_len: 16\n  cache_dir: {cache}\n" \
       "train:\n  max_steps: 2\n  micro_batch_size: 2\n  micro_batches: 1\n  eval_every: 0\n" \
       "parallel:\n  mode: single\n  device: cpu\npartition:\n  cache_dir: {cache}\noutput:\n  dir: {out}\n" \
       "  plot: false\n  save_every: 1\n"
ZERO = ["--parallel.mode=zero", "--parallel.devices=2", "--train.micro_batches=2"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run (two steps, a step checkpoint after the first) and the token and profile cache,
    made once: each test works on a copy."""
    root = tmp_path_factory.mktemp("rundir")
    (root / "corpus.txt").write_text(TEXT * 40)
    run_yaml = root / "run.yaml"
    run_yaml.write_text(TINY.format(data=root / "corpus.txt", cache=root / "cache", out=root / "out"))
    assert cli.main(["train", str(run_yaml)]) == 0
    return root


@pytest.fixture
def run(shared: Path, tmp_path: Path) -> Path:
    """This test's run file and its run directory (a copy of the finished run)."""
    shutil.copytree(shared / "out", tmp_path / "out")
    path = tmp_path / "run.yaml"
    path.write_text(TINY.format(data=shared / "corpus.txt", cache=shared / "cache", out=tmp_path / "out"))
    return path


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (hidden ones too) with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file()} if root.exists() else {}


def one_line(err: str) -> str:
    """The one line mobius ends with: the only ``mobius:`` line, the last, and no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("mobius:")]
    assert len(ours) == 1 and lines[-1] == ours[0] and "Traceback" not in err, err[-3000:]
    return ours[0]


# ---- helpers the table's rows use ------------------------------------------------------------------
def _binary(t: Path) -> Path:
    (t / "x.txt").write_bytes(bytes(range(256)) * 64)
    return t / "x.txt"


def _edited(t: Path) -> Path:
    """The run's data edited: the same size, another content."""
    (t / "corpus.txt").write_text((TEXT * 40).replace("lazy dog", "lazy cat"))
    return t / "corpus.txt"


def _tokenizer(t: Path) -> Path:
    from conftest import save_special_tokenizer

    return save_special_tokenizer(t / "tok", "<|begin_of_text|>", "<|end_of_text|>")


def _hold_lock(t: Path) -> None:
    RunDir.claim(t / "out", resume="auto", overwrite=False)  # never released: this process holds the lock


def _a_file(t: Path) -> Path:
    (t / "plain-file").write_text("not a directory\n")
    return t / "plain-file"


def _mismatched_checkpoint(t: Path) -> Path:
    """A GPT-2 checkpoint whose config.json says vocab_size 320 while its weights hold 300 rows."""
    d = t / "gpt2-bad"
    make_hf_model("gpt2").save_pretrained(d)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "vocab_size": 320}))
    return d


def _read_only(monkeypatch: pytest.MonkeyPatch, t: Path) -> None:
    real = Path.mkdir

    def mkdir(self: Path, *args: object, **kw: object) -> None:
        if str(self).startswith(str(t / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        real(self, *args, **kw)
    monkeypatch.setattr(Path, "mkdir", mkdir)


def _little_disk(monkeypatch: pytest.MonkeyPatch, t: Path) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 * 2**30, 10 * 2**30, 4096))


def _disk_fills(monkeypatch: pytest.MonkeyPatch, t: Path) -> None:
    """The disk fills up as the token cache's first tokens are written."""
    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr("mobius.data.cache._check_space", full)


@dataclasses.dataclass(frozen=True)
class Case:
    args: Callable[[Path], list[str]]
    message: str
    setup: Callable[[Path], object] = lambda t: None
    patch: Callable[[pytest.MonkeyPatch, Path], None] = lambda m, t: None
    fresh: bool = False  # no run in output.dir beforehand: none may be left


CASES = {
    # 1. a user's results are never lost
    "overwrite, then unreadable data": Case(lambda t: ["--overwrite", f"--data.path={_binary(t)}"],
                                            "not a text file (a NUL byte at byte offset 0)"),
    "overwrite, then a missing checkpoint": Case(lambda t: ["--overwrite", f"--model.checkpoint={t / 'nowhere'}"],
                                                 "model.checkpoint"),
    "overwrite, then a plan that cannot be made": Case(lambda t: ["--overwrite", *ZERO, "--zero.chunk_size=1000000000"],
                                                       "zero.chunk_size=1,000,000,000 is above the model's"),
    "a second run into the directory": Case(lambda t: ["--overwrite"], "is in use by another mobius run (pid "
                                            f"{os.getpid()} on host", setup=_hold_lock),
    # 2. what is resumed is what the config trains
    "resume, another preset": Case(lambda t: ["--resume", "--model.preset=gpt2"],
                                   "the checkpoint's n_layer is 4, but the config (model.preset gpt2) builds 12"),
    "resume, data edited": Case(lambda t: ["--resume", f"--data.path={_edited(t)}"], "the data changed since the "
                                "checkpoint: the content of data.path"),
    "resume, another seq_len": Case(lambda t: ["--resume", "--data.seq_len=8"], "training blocks of "
                                    "data.seq_len=8 now"),
    "resume, another tokenizer": Case(lambda t: ["--resume", f"--data.tokenizer={_tokenizer(t)}"],
                                      "the checkpoint trained with another tokenizer than data.tokenizer"),
    # 3. one line where a traceback was
    "seq_len above the positions": Case(lambda t: ["--overwrite", "--data.seq_len=300"],
                                        "data.seq_len (300) exceeds the model's 256 positions"),
    "seq_len above the positions, zero": Case(lambda t: ["--overwrite", "--data.seq_len=300", *ZERO],
                                              "data.seq_len (300) exceeds the model's 256 positions"),
    "output.dir is a file": Case(lambda t: [f"--output.dir={_a_file(t)}"], "is a file, not a directory", fresh=True),
    "output.dir below a file": Case(lambda t: [f"--output.dir={_a_file(t)}/run"], "cannot create it (Not a "
                                    "directory)", fresh=True),
    "output.dir read-only": Case(lambda t: [f"--output.dir={t / 'ro' / 'run'}"], "cannot create it (Read-only "
                                 "file system)", patch=_read_only, fresh=True),
    "no disk for the token cache": Case(lambda t: [f"--data.cache_dir={t / 'cache'}", f"--output.dir={t / 'new'}"],
                                        "MiB free, but the token cache needs about", patch=_little_disk, fresh=True),
    "the disk fills while tokenizing": Case(lambda t: [f"--data.cache_dir={t / 'cache'}", f"--output.dir={t / 'new'}"],
                                            "cannot write the token cache (No space left on device)",
                                            patch=_disk_fills, fresh=True),
    "no disk for a checkpoint": Case(lambda t: [f"--output.dir={t / 'new'}"], "MiB free, but the final checkpoint of "
                                     "this model takes about", patch=_little_disk, fresh=True),
    "weights disagree with config.json": Case(lambda t: [f"--model.checkpoint={_mismatched_checkpoint(t)}",
                                                         "--model.preset=null", f"--output.dir={t / 'new'}"],
                                              "weight transformer.wte.weight has shape (300, 32), but config.json "
                                              "describes (320, 32) (config.json's vocab_size is 320)", fresh=True),
    "weights disagree with config.json, zero": Case(lambda t: [f"--model.checkpoint={_mismatched_checkpoint(t)}",
                                                               "--model.preset=null", f"--output.dir={t / 'new'}",
                                                               *ZERO], "has shape (300, 32), but config.json describes",
                                                    fresh=True),
    # 4. zero mode's limits, before any worker
    "zero, chunks far too small": Case(lambda t: ["--overwrite", *ZERO, "--zero.chunk_size=10"],
                                       "more than 4096 chunks, more than the search simulates in seconds"),
    "zero, plan does not fit": Case(lambda t: ["--overwrite", *ZERO, "--zero.chunk_size=500000",
                                               "--partition.gpu_memory_gib=0.01"],
                                    "MiB per rank for its chunks and rCache (2 chunk(s) of 500,000 parameters"),
    "zero, memory far too small": Case(lambda t: ["--overwrite", *ZERO, "--partition.gpu_memory_gib=0.0001"],
                                       "does not fit in 0.10 MiB per rank (partition.gpu_memory_gib"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_failure_is_one_line_before_anything_changes(name: str, run: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    case = CASES[name]
    if case.fresh:
        shutil.rmtree(tmp_path / "out")
    case.setup(tmp_path)
    args = case.args(tmp_path)
    before = {d: snapshot(tmp_path / d) for d in ("out", "new", "cache")}
    case.patch(monkeypatch, tmp_path)
    monkeypatch.setattr("mobius.app.run.spawn", lambda *a: pytest.fail("a worker was started"))
    code = cli.main(["train", str(run), *args])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith("mobius: error: ") and case.message in line, line
    assert {d: snapshot(tmp_path / d) for d in before} == before  # no run directory made, changed or removed
    assert not list((tmp_path / "cache").glob("tokens-*"))


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = (out / "metrics.jsonl").read_text()
    claim = RunDir.claim(out, None, overwrite=True)  # a new run passed its checks, then was killed -9
    claim.set_aside()
    assert results(out) == [] and (out / REPLACED_DIR / "final").is_dir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # what it wrote before dying
    os.close(claim.lock_fd)
    RunDir.claim(out, None, overwrite=True).release()  # the next claim puts the old run back
    assert (out / "metrics.jsonl").read_text() == old and results(out) == ["metrics.jsonl", "final", "checkpoints"]
    assert not (out / REPLACED_DIR).exists() and not (out / LOCK_FILE).exists()
    assert cli.main(["train", str(run), "--overwrite", "--train.max_steps=1"]) == 0  # a run that finishes
    assert not (out / REPLACED_DIR).exists() and (out / "metrics.jsonl").read_text().count("\n") == 1


def test_a_crashed_runs_lock_does_not_block(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text('{"pid": 999999999, "host": "gone", "started": "yesterday"}\n')  # nobody holds it
    claim = RunDir.claim(out, None, overwrite=False)
    with pytest.raises(ConfigError, match=f"in use by another mobius run \\(pid {os.getpid()} on host"):
        RunDir.claim(out, None, overwrite=False)
    claim.release()
    assert os.listdir(out) == []
    RunDir.claim(out / "a" / "b", None, overwrite=False).release()
    assert os.listdir(out) == []  # what the claim made is gone again when the run left nothing there


def test_a_run_stopped_before_its_first_step_leaves_a_directory_a_plain_rerun_takes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text("{}\n")
    (out / "metrics.jsonl").write_text("")
    assert results(out) == []
    RunDir.claim(out, None, overwrite=False).release()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics.jsonl\) with no step checkpoint to resume; "
                                          r"pass --overwrite"):
        RunDir.claim(out, None, overwrite=False)
    recover(out)  # nothing set aside: nothing to do


FULL_DISK = {  # how safetensors words the operating system's ENOSPC
    "safetensors>=0.5": "Error while serializing: I/O error: No space left on device (os error 28)",
    "safetensors<0.5": 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                       '"No space left on device" })'}


@pytest.mark.parametrize("words", FULL_DISK)
def test_a_full_disk_while_checkpointing_is_one_line_and_the_last_checkpoint_survives(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, words: str) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, []

    def save_file(*args: object, **kw: object) -> None:
        calls.append(1)
        if len(calls) > 2:  # step 1's weights and moments are written, then the disk is full
            raise SafetensorError(FULL_DISK[words])
        real(*args, **kw)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "new"
    assert cli.main(["train", str(run), f"--output.dir={out}", "--train.max_steps=3"]) == 2
    line = one_line(capsys.readouterr().err)
    step1, step2 = out / "checkpoints" / "step-000001", out / "checkpoints" / "step-000002"
    assert line == (f"mobius: error: cannot write checkpoint {step2}: No space left on device; the last complete "
                    f"checkpoint, {step1}, is intact (--resume continues from it)")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]
    assert ResumeState(step1).trainer["step"] == 1 and not (out / LOCK_FILE).exists()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 15 MiB (a tmpfs), where this machine lets the test mount one."""
    import subprocess

    where = tmp_path / "disk"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=15m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (the test above injects safetensors' words for a full disk)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_really_full_disk_in_single_mode_is_one_line_and_the_run_resumes_from_the_last_checkpoint(
        run: Path, tmp_path: Path, small_disk: Path, capsys: pytest.CaptureFixture) -> None:
    """The disk fills while the second step checkpoint is written (about 10 MiB each: the first fits the
    15 MiB, the second does not): one line naming the last complete checkpoint, which resumes."""
    out = small_disk / "out"
    assert cli.main(["train", str(run), f"--output.dir={out}", "--train.max_steps=3", "--output.keep_last=3"]) == 2
    step1, step2 = out / "checkpoints" / "step-000001", out / "checkpoints" / "step-000002"
    assert one_line(capsys.readouterr().err) == (
        f"mobius: error: cannot write checkpoint {step2}: No space left on device; the last complete checkpoint, "
        f"{step1}, is intact (--resume continues from it)")
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)  # to a disk with room, where it goes on
    assert cli.main(["train", str(run), f"--output.dir={moved}", "--train.max_steps=3", "--resume"]) == 0
    lines = (moved / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]


STATE_EDITS = {  # trainer_state.json key -> (value written, the message's end)
    "step": ("abc", "step must be an integer, got 'abc'"),
    "data.position": (-3, "data.position must be >= 0, got -3"),
    "losses": (["x"], "losses must be a list of numbers, got ['x']"),
    "engine.optimizer_step": (1.5, "engine.optimizer_step must be an integer, got 1.5"),
    "engine.scaler": ([], "engine.scaler must be an object, got []"),
    "data.fingerprint": (7, "data.fingerprint must be a string, got 7"),
    "rng": (None, "rng must be an object, got None"),
}


def test_a_malformed_trainer_state_is_one_line_naming_the_field(run: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture) -> None:
    file = tmp_path / "out" / "checkpoints" / "step-000001" / "trainer_state.json"
    good = json.loads(file.read_text())
    for key, (value, message) in STATE_EDITS.items():
        state = json.loads(json.dumps(good))
        *path, last = key.split(".")
        holder = state
        for part in path:
            holder = holder[part]
        holder[last] = value
        file.write_text(json.dumps(state))
        before = snapshot(tmp_path / "out")
        assert cli.main(["train", str(run), "--resume"]) == 2, key
        assert one_line(capsys.readouterr().err) == f"mobius: error: {file}: {message}"
        assert snapshot(tmp_path / "out") == before


def test_resume_accepts_new_data_when_told_and_a_mere_touch_is_no_change(run: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from mobius.app.run import prepare
    from mobius.config import load_config

    data = tmp_path / "corpus.txt"
    data.write_text(TEXT * 40)  # the same text in another file: tokenized again, the same fingerprint
    assert prepare(load_config(run, [f"--data.path={data}"]), "auto").resume is not None
    _edited(tmp_path)
    assert cli.main(["train", str(run), "--resume", "--train.max_steps=3", f"--data.path={data}",
                     "--data.accept_new_data=true"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out


def test_more_cpu_workers_than_cores_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """In every mode that runs CPU workers (auto on the CPU compares only those), not in single mode nor on GPUs."""
    from mobius.app.run import warn_oversubscribed
    from mobius.app.settings import Machine
    from mobius.config import config_from_dict

    def said(parallel: dict, cores: int = 2) -> str:
        cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "train": {"micro_batches": 4},
                                "parallel": {"device": "cpu", **parallel}})
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            warn_oversubscribed(cfg, dataclasses.replace(Machine.cpu_only(), cpu_count=cores))
        return caplog.text

    for mode in ("zero", "pipeline", "auto"):
        assert "parallel.devices=4: 4 CPU worker processes on this machine's 2 cores" in said({"mode": mode,
                                                                                               "devices": 4})
    assert said({"mode": "zero", "devices": 4}, cores=4) == ""
    assert said({"mode": "auto", "devices": 1}, cores=1) == ""  # auto on one CPU device: single mode, no worker


class _Spent(Exception):
    """What a test raises where a run would start spending time (its fork server, its data, its plan)."""


def test_too_many_cpu_workers_are_said_before_the_run_spends_anything(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 65: 16 CPU workers on 2 cores were said 12 s after the start, once their CPU AdamW was measured."""
    from mobius.app import run
    from mobius.app.settings import Machine
    from mobius.config import config_from_dict

    def spent(*args: object, **kwargs: object) -> None:
        raise _Spent
    for name in ("start_helpers_early", "prepare", "plan_run"):
        monkeypatch.setattr(run, name, spent)
    cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "train": {"micro_batches": 16},
                            "parallel": {"mode": "zero", "devices": 16, "device": "cpu"},
                            "output": {"dir": str(tmp_path / "out")}})
    with caplog.at_level(logging.WARNING), pytest.raises(_Spent):
        run.train(cfg, machine=dataclasses.replace(Machine.cpu_only(), cpu_count=2))
    assert "parallel.devices=16: 16 CPU worker processes on this machine's 2 cores" in caplog.text


def test_chunk_size_bounds_name_both_numbers() -> None:
    from mobius.layout import ParamInfo
    from partition.zero.search import MAX_CHUNKS, check_chunk_size

    params = [ParamInfo(("a",), (1000, 100), (0,), True), ParamInfo(("b",), (50_000,), (1,), False)]
    check_chunk_size(150_000, params, align=64)
    check_chunk_size(-(-150_000 // MAX_CHUNKS), params, align=64)
    with pytest.raises(ConfigError, match=r"zero.chunk_size=150,017 is above the model's 150,000 parameters \(one "
                                          r"chunk of 150,016 holds them all\); set zero.chunk_size between 37 and "
                                          r"150,016"):
        check_chunk_size(150_017, params, align=64)
    with pytest.raises(ConfigError, match=r"zero.chunk_size=36 cuts the model's 150,000 parameters into more than "
                                          r"4096 chunks"):
        check_chunk_size(36, params, align=64)


def test_shared_memory_files_of_a_dead_run_are_removed_and_only_those(tmp_path: Path) -> None:
    import subprocess
    import sys

    from scheduler.arbiter import remove_stale

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    names = {f"mobius-arbiter-{gone}-0123abcd": False, f"mobius-29500-mobius-{gone}-89abcdef": False,  # older naming
             f"mobius-arbiter-{os.getpid()}-0123abcd": True, "mobius-notes": True, "sem.mp-x1y2z3": True}
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 16)
    removed = remove_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted(n for n, kept in names.items() if not kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n, kept in names.items() if kept)
