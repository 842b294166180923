"""Worker supervision, tried as a user meets it: a worker that raises, a worker killed with -9,
Ctrl-C, SIGTERM and a hang-up (while training, and while the workers still start), the parent or
torchrun's agent killed with -9. Each ends every process of the run in time, with the exit code and
a one-line message naming the rank and the cause as the last line (no traceback, no resource-tracker
warning), and leaves no shared-memory file behind."""

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


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One token and profile cache for the module's runs (each measures nothing the previous one did)."""
    return tmp_path_factory.mktemp("supervision-cache")


def _run_file(tmp_path: Path, deep_checkpoint: Path, corpus: Path, cache: Path, mode: str = "pipeline") -> Path:
    parallel = {"mode": "pipeline" if mode == "round_robin" else mode, "devices": 1 if mode == "single" else 2,
                "device": "cpu"}
    if mode == "pipeline":
        parallel["stages"] = 4
    if mode == "round_robin":  # the workers map one anonymous memory file: it goes with the last of them
        parallel["schedule"] = "round_robin"
    cfg = {"model": {"checkpoint": str(deep_checkpoint)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(cache)},
           "train": {"max_steps": 100000, "micro_batch_size": 2, "micro_batches": 2, "eval_every": 0},
           "parallel": parallel,
           "partition": {"cache_dir": str(cache)},
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


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _workers(pgid: int) -> list[int]:
    """The run's workers: spawned processes, or forks of the fork server (whose command line they share)."""
    group = _group(pgid)
    servers = {pid for pid in group if b"forkserver" in _cmdline(pid) and b"forkserver" not in _cmdline(_parent(pid))}
    return [pid for pid in group if b"spawn_main" in _cmdline(pid) or _parent(pid) in servers]


def _start(run_file: Path, tmp_path: Path, env: dict | None = None, steps: int = 2,
           workers: int = 2) -> subprocess.Popen:
    """The run, once it has logged ``steps`` steps (0: once it has written its plan and its workers exist:
    before the plan, a fork of the fork server is the one that tells the run it has started) and runs
    ``workers`` worker processes."""
    proc = subprocess.Popen([sys.executable, "-m", "mobius.cli", "train", str(run_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})
    metrics = tmp_path / "out" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= steps):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if steps == 0 and (tmp_path / "out" / "plan.json").is_file() and _workers(proc.pid):
            return proc
        time.sleep(0.2 if steps else 0.02)
    assert len(_workers(proc.pid)) >= workers, f"the {workers} workers should be running"
    proc.workers = _workers(proc.pid)  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen, within: float) -> tuple[int, str, float]:
    start = time.time()
    _, err = proc.communicate(timeout=120)
    took = time.time() - start
    while _group(proc.pid) and time.time() - start < within:
        time.sleep(0.1)
    assert not _group(proc.pid), f"processes of the run left behind: {_group(proc.pid)}"
    assert time.time() - start < within, f"the run took {time.time() - start:.1f} s to end"
    for pid in getattr(proc, "workers", []):  # the upload arbiter's file is named by the worker that made it
        assert not list(Path("/dev/shm").glob(f"mobius-arbiter-{pid}-*")), "a shared-memory file was left behind"
    return proc.returncode, err, took


def shm_files(pids: list[int]) -> set[Path]:
    """The files in /dev/shm that processes ``pids`` have open or mapped (multiprocessing's semaphores,
    the pipeline's upload arbiter until every worker mapped it)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        for path in [line.split(maxsplit=5)[-1] for line in maps if len(line.split()) == 6] + fds:
            if path.startswith("/dev/shm/") and not path.endswith("(deleted)"):
                found.add(Path(path))
    return found


def ended_within(pgid: int, seconds: float) -> list[int]:
    """The processes of group ``pgid`` still alive after ``seconds`` (none: sooner)."""
    deadline = time.time() + seconds
    while _group(pgid) and time.time() < deadline:
        time.sleep(0.1)
    return _group(pgid)


def _one_line(err: str) -> str:
    """mobius's one line, the last of the run's output: no traceback, no resource-tracker warning."""
    lines = [line for line in err.splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("mobius: ")]
    assert len(ours) == 1 and lines[-1] == ours[0] and "Traceback" not in err, err[-3000:]
    return ours[0]


def test_a_worker_that_raises_ends_the_run_with_its_message(tmp_path: Path, deep_checkpoint: Path,
                                                            corpus: Path, cache: Path) -> None:
    """Rank 1 raises inside its third step (as CUDA out of memory would); a sitecustomize module on
    PYTHONPATH injects the failure into the workers, nothing in mobius knows about it."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "from scheduler import pipeline_engine\n"
        "step = pipeline_engine.PipelineEngine.train_step\n"
        "def failing(self, i, batches, lr, upcoming=None):\n"
        "    if os.environ.get('RANK') == '1' and i == 2:\n"
        "        raise RuntimeError('CUDA out of memory. Tried to allocate 20.00 GiB (injected)')\n"
        "    return step(self, i, batches, lr, upcoming)\n"
        "pipeline_engine.PipelineEngine.train_step = failing\n")
    run_file = _run_file(tmp_path, deep_checkpoint, corpus, cache)
    proc = subprocess.Popen([sys.executable, "-m", "mobius.cli", "train", str(run_file)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"})
    code, err, _ = _finish(proc, within=180)
    assert code == 2
    assert _one_line(err) == ("mobius: error: worker rank 1 failed: RuntimeError: CUDA out of memory. Tried to "
                              "allocate 20.00 GiB (injected)")


def test_a_killed_worker_stops_the_run_within_30_s(tmp_path: Path, deep_checkpoint: Path, corpus: Path,
                                                   cache: Path) -> None:
    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus, cache), tmp_path)
    victim = max(_workers(proc.pid))
    os.kill(victim, signal.SIGKILL)
    code, err, _ = _finish(proc, within=30)
    line = _one_line(err)
    assert code == 2 and line.startswith("mobius: error: worker rank ")
    assert "killed" in line and "the other workers were stopped" in line


@pytest.mark.parametrize("how,code", [("ctrl-c", 130), ("sigterm", 143), ("hang-up", 129)])
def test_ctrl_c_sigterm_and_sighup_stop_every_worker_within_10_s(tmp_path: Path, deep_checkpoint: Path,
                                                                 corpus: Path, cache: Path, how: str,
                                                                 code: int) -> None:
    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus, cache), tmp_path)
    if how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)  # a job scheduler stopping the parent only
    else:  # a terminal sends these to the whole foreground group
        os.killpg(proc.pid, signal.SIGINT if how == "ctrl-c" else signal.SIGHUP)
    returncode, err, took = _finish(proc, within=10)
    assert returncode == code, err[-3000:]
    assert "stopped by SIG" in _one_line(err) and took < 10


def test_a_pipeline_run_stopped_by_ctrl_c_keeps_the_compute_its_steps_measured(tmp_path: Path, deep_checkpoint: Path,
                                                                              corpus: Path) -> None:
    """Users stop long runs with Ctrl-C: the steady steps before it still teach the next plan
    (:mod:`partition.calibrate`), and the run still ends in its one line."""
    cache = tmp_path / "cache"
    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus, cache), tmp_path, steps=6)
    os.killpg(proc.pid, signal.SIGINT)
    returncode, err, _ = _finish(proc, within=10)
    assert returncode == 130 and "stopped by SIGINT" in _one_line(err), err[-3000:]
    kept = list((cache / "partition" / "in_run").glob("*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())["runs"]) == 1


def test_ctrl_c_while_the_workers_start_is_one_line_and_a_plain_rerun_follows(tmp_path: Path, deep_checkpoint: Path,
                                                                              corpus: Path, cache: Path) -> None:
    """The signal comes as soon as the first worker exists (the next may not be launched yet): none
    prints a traceback (they leave stopping to their parent, which launches them all before it
    stops them), and what the run left (its plan, no step) does not block a plain rerun."""
    from mobius.app.rundir import RunDir, results

    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus, cache), tmp_path, steps=0)
    os.killpg(proc.pid, signal.SIGINT)
    returncode, err, _ = _finish(proc, within=10)
    assert returncode == 130 and _one_line(err) == "mobius: stopped by SIGINT; every worker was stopped"
    assert results(tmp_path / "out") == []
    RunDir.claim(tmp_path / "out", None, overwrite=False).release()


@pytest.mark.parametrize("mode", ["single", "pipeline", "zero", "round_robin"])
def test_mobius_killed_with_9_leaves_no_process_and_no_shared_memory_file_5_s_later(
        tmp_path: Path, deep_checkpoint: Path, corpus: Path, cache: Path, mode: str) -> None:
    """kill -9 of ``mobius train`` while it trains (the OOM killer, a crash in native code): every
    process it started -- workers, the fork server, the resource tracker -- ends within 5 s, and the
    shared-memory files they had are removed. Workers are forks of the fork server, which lives while
    any of its children does, so each watches mobius itself, not its parent process."""
    proc = _start(_run_file(tmp_path, deep_checkpoint, corpus, cache, mode), tmp_path,
                  workers=0 if mode == "single" else 2)
    shared = shm_files(_group(proc.pid))
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert ended_within(proc.pid, 5) == [], "processes of the run outlived it by 5 s"
    assert [p for p in shared if p.exists()] == [], "shared-memory files of the run were left behind"


MARK = "MOBIUS_TEST_RUN"  # in the environment of a run under test, and so of every process it starts


def _marked(mark: str) -> dict[int, bytes]:
    """The live processes whose environment carries ``MARK=mark`` (what the run started, however reparented),
    with their command lines."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if entry.isdigit() else []
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in env:
            found[int(entry)] = _cmdline(int(entry))
    return found


class _Code:
    """Unpickling this would call a function (a harmless one)."""

    def __reduce__(self) -> tuple:
        return (os.getpid, ())


@pytest.fixture(scope="module")
def pickled_step(tmp_path_factory: pytest.TempPathFactory, deep_checkpoint: Path, corpus: Path, cache: Path) -> Path:
    """The first step checkpoint of a two-step run whose weights were then replaced by a plain pickle (protocol 4, as
    ``pickle.dumps`` writes it) of something other than tensors."""
    import pickle

    from mobius import cli

    tmp = tmp_path_factory.mktemp("pickled-step")
    assert cli.main(["train", str(_run_file(tmp, deep_checkpoint, corpus, cache, "single")), "--train.max_steps=2",
                     "--output.save_every=1"]) == 0
    step = tmp / "out" / "checkpoints" / "step-000001"
    for f in step.glob("model*.safetensors"):
        f.unlink()
    (step / "pytorch_model.bin").write_bytes(pickle.dumps({"transformer.wte.weight": _Code()}, protocol=4))
    return step


@pytest.fixture(scope="module", params=["pipeline", "zero"])
def refused(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, deep_checkpoint: Path,
            corpus: Path, cache: Path, pickled_step: Path) -> dict:
    """``mobius train --resume`` in pipeline or zero mode on a checkpoint whose weights are a pickle: refused in
    its data phase, once its fork server has started (importing torch). What ran while it ran, at its exit and a
    second later."""
    tmp = tmp_path_factory.mktemp(f"refused-{request.param}")
    mark = f"{os.getpid()}-{request.param}-{time.time_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "mobius.cli", "train",
                             str(_run_file(tmp, deep_checkpoint, corpus, cache, request.param)),
                             "--resume", str(pickled_step)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, MARK: mark})
    seen: set[bytes] = set()
    while proc.poll() is None:
        seen.update(_marked(mark).values())
        time.sleep(0.01)
    at_exit = _marked(mark)
    time.sleep(1.0)
    return {"code": proc.returncode, "err": proc.communicate()[1], "seen": seen, "at_exit": at_exit,
            "a_second_later": _marked(mark)}


def test_a_run_refused_before_its_workers_leaves_no_process_behind(refused: dict) -> None:
    """Issue 65: the fork server, started before the data is read, was still importing torch 1-2 s after
    mobius had refused the run. It ends before mobius exits; the resource tracker within a second of it."""
    assert refused["code"] == 2, refused["err"][-3000:]
    assert any(b"forkserver" in cmd for cmd in refused["seen"]), "the fork server should have started"
    assert not [cmd for cmd in refused["at_exit"].values() if b"forkserver" in cmd], refused["at_exit"]
    assert refused["a_second_later"] == {}, f"processes of the run outlived it: {refused['a_second_later']}"


def test_a_run_refused_for_pickled_weights_says_so_in_one_line(refused: dict) -> None:
    """Issue 65: torch's two lines of warning about the pickle's protocol came before mobius's one."""
    assert refused["err"].strip().splitlines() == [refused["err"].strip()], refused["err"][-3000:]
    assert refused["err"].startswith("mobius: error: ") and "pickled code is never loaded" in refused["err"]


AGENT = """
import subprocess, sys, time
worker = ("import sys, time; from mobius.app.supervise import end_when_orphaned; end_when_orphaned(3); "
          "open(sys.argv[1], 'w').close(); time.sleep(600)")
subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]])
time.sleep(600)
"""  # a stand-in for torchrun's agent: a process that started a worker


def test_a_worker_whose_agent_is_killed_with_9_stops_within_10_s(tmp_path: Path) -> None:
    """torchrun's agent killed with -9: the worker stops by itself, saying why."""
    ready = tmp_path / "ready"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(ready)], stderr=subprocess.PIPE, text=True,
                             start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 60
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    os.kill(agent.pid, signal.SIGKILL)
    _, err, _ = _finish(agent, within=10)
    assert f"mobius: worker rank 3 stopped: its parent process {agent.pid} is gone" in err


def _env_probe() -> dict:
    return {k: os.environ.get(k) for k in ("MOBIUS_PROBE", "MOBIUS_GONE", "RANK", "WORLD_SIZE")}


def test_forked_workers_run_in_the_runs_environment_at_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server keeps the environment it started with; each run's workers see the run's own,
    as spawned workers would, with the agent's per-rank variables."""
    from mobius.app.supervise import run_workers

    monkeypatch.setenv("MOBIUS_GONE", "1")
    monkeypatch.setenv("MOBIUS_PROBE", "first")
    first = run_workers(_env_probe, (), 2)  # starts the fork server here, if no test did before
    monkeypatch.delenv("MOBIUS_GONE")
    monkeypatch.setenv("MOBIUS_PROBE", "second")
    second = run_workers(_env_probe, (), 2)
    assert [first[r]["MOBIUS_PROBE"] for r in (0, 1)] == ["first", "first"]
    assert second == {r: {"MOBIUS_PROBE": "second", "MOBIUS_GONE": None, "RANK": str(r), "WORLD_SIZE": "2"}
                      for r in (0, 1)}


def test_the_fork_server_imports_nothing_that_touches_cuda() -> None:
    """Forks of a process that initialised CUDA cannot use it: the modules the server preloads must
    not call into CUDA (not even to count devices) when imported."""
    probe = ("import torch, importlib\n"
             "def touched(*a, **k):\n"
             "    raise SystemExit('CUDA touched at import')\n"
             "torch._C._cuda_getDeviceCount = touched\n"
             "torch.cuda._lazy_init = touched\n"
             "torch.cuda.is_available = touched\n"
             "torch.cuda.device_count = touched\n"
             "from mobius.app.supervise import PRELOAD\n"
             "for name in PRELOAD:\n"
             "    importlib.import_module(name)\n"
             "print('clean')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "clean", out.stdout + out.stderr


def test_a_stop_signal_during_the_launches_waits_until_the_agent_knows_every_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C between two launches: the handler runs once the agent holds every worker (it can then
    stop them all), not in between, where the started ones would outlive it."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from mobius.app.supervise import _launches_whole

    launched: list[int] = []

    def start_workers(agent: object, group: object) -> list[int]:
        launched.append(0)
        os.kill(os.getpid(), signal.SIGINT)  # between the first launch and the second
        launched.append(1)
        agent.pcontext = "both"  # type: ignore[attr-defined]
        return [0, 1]

    monkeypatch.setattr(LocalElasticAgent, "_start_workers", start_workers)
    agent, seen = type("Agent", (), {"pcontext": None})(), []

    def stop(signum: int, frame: object) -> None:
        seen.append((list(launched), agent.pcontext))
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGINT, stop)
    try:
        with _launches_whole(), pytest.raises(KeyboardInterrupt):
            LocalElasticAgent._start_workers(agent, None)
    finally:
        signal.signal(signal.SIGINT, old)
    assert seen == [([0, 1], "both")]
