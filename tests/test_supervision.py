"""Worker supervision, tried as a user meets it: a worker that raises, a worker killed with -9,
Ctrl-C and SIGTERM. Each ends every process of the run in time, with the exit code and a one-line
message naming the rank and the cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the run's processes through /proc")
ROOT = Path(__file__).resolve().parents[1]


def _run_file(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> Path:
    cfg = {"model": {"checkpoint": str(deep_checkpoint)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": 100000, "micro_batch_size": 2, "micro_batches": 2, "eval_every": 0},
           "parallel": {"mode": "pipeline", "devices": 2, "stages": 4, "device": "cpu"},
           "partition": {"cache_dir": str(tmp_path / "cache")},
           "output": {"dir": str(tmp_path / "out"), "plot": False}}
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    return path


def _group(pgid: int) -> list[int]:
    """Every live process of a process group (the run: the parent, its workers, their helpers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _workers(pgid: int) -> list[int]:
    found = []
    for pid in _group(pgid):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _start(run_file: Path, tmp_path: Path, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "mobius.cli", "train", str(run_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    assert len(_workers(proc.pid)) >= 2, "the two workers should be running"
    return proc


def _finish(proc: subprocess.Popen, within: float) -> tuple[int, str, float]:
    start = time.time()
    _, err = proc.communicate(timeout=120)
    took = time.time() - start
    while _group(proc.pid) and time.time() - start < within:
        time.sleep(0.1)
    assert not _group(proc.pid), f"processes of the run left behind: {_group(proc.pid)}"
    assert time.time() - start < within, f"the run took {time.time() - start:.1f} s to end"
    return proc.returncode, err, took


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("mobius: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_worker_that_raises_ends_the_run_with_its_message(tmp_path: Path, deep_checkpoint: Path,
                                                            corpus: Path) -> None:
    """Rank 1 raises inside its third step (as CUDA out of memory would); a sitecustomize module on
    PYTHONPATH injects the failure into the workers, nothing in mobius knows about it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "from scheduler import engine\n"
        "step = engine.PipelineEngine.train_step\n"
        "def failing(self, i, batches, lr):\n"
        "    if os.environ.get('RANK') == '1' and i == 2:\n"
        "        raise RuntimeError('CUDA out of memory. Tried to allocate 20.00 GiB (injected)')\n"
        "    return step(self, i, batches, lr)\n"
        "engine.PipelineEngine.train_step = failing\n")
    run_file = _run_file(tmp_path, deep_checkpoint, corpus)
    proc = subprocess.Popen([sys.executable, "-m", "mobius.cli", "train", str(run_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"})
    code, err, _ = _finish(proc, within=180)
    assert code == 2
    assert _one_line(err) == ("mobius: error: worker rank 1 failed: RuntimeError: CUDA out of memory. Tried to "
                              "allocate 20.00 GiB (injected)")


def test_a_killed_worker_stops_the_run_within_30_s(tmp_path: Path, deep_checkpoint: Path, corpus: Path) -> None:
    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus), tmp_path)
    victim = max(_workers(proc.pid))
    os.kill(victim, signal.SIGKILL)
    code, err, _ = _finish(proc, within=30)
    line = _one_line(err)
    assert code == 2 and line.startswith("mobius: error: worker rank ")
    assert "killed" in line and "the other workers were stopped" in line


@pytest.mark.parametrize("how,code", [("ctrl-c", 130), ("sigterm", 143)])
def test_ctrl_c_and_sigterm_stop_every_worker_within_10_s(tmp_path: Path, deep_checkpoint: Path, corpus: Path,
                                                          how: str, code: int) -> None:
    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus), tmp_path)
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # a terminal sends it to the whole foreground group
    else:
        os.kill(proc.pid, signal.SIGTERM)  # a job scheduler stopping the parent only
    returncode, err, took = _finish(proc, within=10)
    assert returncode == code, err[-3000:]
    assert "stopped by SIG" in _one_line(err) and took < 10
