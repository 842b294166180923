"""Past one machine through torchrun, tried on one: two "nodes" on localhost (two ``torchrun --nnodes 2
--nproc-per-node 2`` invocations meeting at a c10d rendezvous, gloo, CPU worker processes), zero mode."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from mobius.app.launch import free_port
from mobius.app.run import train
from mobius.config import config_from_dict
from mobius.models.hf import read_state_dict
from spawned import EXACT_EPS
from test_supervision import _group, ended_within, shm_files

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the run's processes through /proc")
ROOT = Path(__file__).resolve().parents[1]


CHAT = {"chat_template": "builtin:demo-chat", "seq_len": 32, "val_fraction": 0.1}  # conversations' data keys (and
# EXACT_EPS: masked targets make near-zero gradients whose float noise AdamW at eps 1e-8 would amplify)


def _raw(tmp: Path, ck: Path, corpus: Path, out: str, mode: str, data: dict | None = None, **train_keys: object) -> dict:
    return {"model": {"checkpoint": str(ck)},
            "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp / "cache"), **(data or {})},
            "train": {"max_steps": 4, "micro_batch_size": 2, "micro_batches": 4, "lr": 1e-2, "warmup_steps": 1,
                      "weight_decay": 0.1, "eval_every": 0, "eval_batches": 2, "seed": 3, **train_keys},
            "parallel": {"mode": mode, "device": "cpu"},
            "partition": {"cache_dir": str(tmp / "cache")},
            "output": {"dir": str(tmp / out), "plot": False, "save_every": 2}}


def _two_nodes(run_file: Path, nodes: int = 2) -> list[subprocess.Popen]:
    """Every node's torchrun, each in its own session (so that every process it leaves can be found). The
    first hosts the rendezvous store, as the node named in ``--rdzv-endpoint`` does across machines: the
    others start once it listens (on one machine the first agent to bind the port would host it)."""
    port, run_id = free_port(), f"test-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
           "--max-restarts", "0", "-m", "mobius", "train", str(run_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = []
    for _ in range(nodes):
        started.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        start_new_session=True, env=env))
        deadline = time.time() + 120
        while not _listens(port) and started[0].poll() is None and time.time() < deadline:
            time.sleep(0.05)
    return started


def _listens(port: int) -> bool:
    """Whether a TCP socket on this machine listens on ``port`` (IPv4 or IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def _losses(run_dir: Path) -> torch.Tensor:
    return torch.tensor([json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()])


def _short_chats(tmp: Path) -> Path:
    """200 short conversations (one or two exchanges) that a row of 16 positions holds about half of."""
    f = tmp / "chats.jsonl"
    turns = lambda i: [{"role": "user", "content": f"q{i % 10}"}, {"role": "assistant", "content": "ab"[i % 2]}]  # noqa: E731
    f.write_text("".join(json.dumps({"messages": turns(i) + (turns(i + 1) if i % 5 == 0 else [])}) + "\n"
                         for i in range(200)))
    return f


@pytest.mark.slow
def test_two_nodes_train_like_one_device_and_their_checkpoint_resumes_on_one(tmp_path: Path,
                                                                            deep_checkpoint: Path) -> None:
    """Conversations, packed and masked (each node prepares its data: the same blocks and targets)."""
    chats = _short_chats(tmp_path)
    raw = lambda out, mode: _raw(tmp_path, deep_checkpoint, chats, out, mode, data=CHAT, eps=EXACT_EPS)  # noqa: E731
    ref = train(config_from_dict(raw("ref", "single"), "ref.yaml"))
    run_file = tmp_path / "run.yaml"
    run_file.write_text(json.dumps(raw("two", "zero")))
    nodes = _two_nodes(run_file)
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in outs)
    assert sum("done: 4 steps" in out for out, _ in outs) == 1  # rank 0 reports the run
    two = tmp_path / "two"
    assert "mode zero: 4 CPU worker process(es) on 2 nodes" in "".join(err for _, err in outs)
    torch.testing.assert_close(_losses(two), torch.tensor(ref.losses), rtol=0, atol=1e-5)
    weights, expected = read_state_dict(two / "final"), read_state_dict(ref.final_dir)
    assert set(weights) == set(expected)
    for k in expected:  # one Hugging Face checkpoint, every rank's part in it
        torch.testing.assert_close(weights[k], expected[k], rtol=0, atol=1e-5, msg=k)
    # the 4-rank step checkpoint resumes on one process and goes on as the reference did
    resumed = train(config_from_dict(raw("resumed", "single"), "resumed.yaml"),
                    resume=str(two / "checkpoints" / "step-000002"))
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(ref.losses), rtol=0, atol=1e-5)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            out.append(int(entry))
    return out


def _rank_of(pid: int) -> int:
    env = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in x)
    return int(env["RANK"])


def _ended(nodes: list[subprocess.Popen], within: float) -> list[str]:
    """Every node's stderr once it ended; if one is still running after ``within`` seconds, the test fails with
    the stacks of every rank left (``mobius`` prints them on SIGUSR1)."""
    deadline = time.time() + within
    try:
        return [p.communicate(timeout=max(0.1, deadline - time.time()))[1] for p in nodes]
    except subprocess.TimeoutExpired:
        for rank in [pid for p in nodes for pid in _children(p.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGUSR1)
        time.sleep(2)
        for p in nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        errs = [p.communicate()[1] for p in nodes]
        pytest.fail(f"the nodes did not end within {within} s; their stderr:\n" + "\n".join(e[-6000:] for e in errs))


@pytest.mark.slow
def test_a_killed_worker_on_one_node_ends_both_within_30_s_naming_its_rank(tmp_path: Path, deep_checkpoint: Path,
                                                                            corpus: Path) -> None:
    run_file = tmp_path / "run.yaml"
    run_file.write_text(json.dumps(_raw(tmp_path, deep_checkpoint, corpus, "out", "zero", max_steps=100000)))
    nodes = _two_nodes(run_file)
    metrics, deadline = tmp_path / "out" / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert all(p.poll() is None for p in nodes), nodes[0].communicate()[1][-3000:]
        time.sleep(0.2)
    workers = _children(nodes[1].pid)
    assert len(workers) == 2, "the second node should run two workers"
    victim = workers[0]
    rank = _rank_of(victim)
    os.kill(victim, signal.SIGKILL)
    start = time.time()
    errs = _ended(nodes, within=60)
    took = time.time() - start
    assert took < 30, f"the nodes took {took:.1f} s to end"
    assert all(p.returncode != 0 for p in nodes)
    assert not any(_group(p.pid) for p in nodes), "processes of the run were left behind"
    report = re.search(rf"rank\s*: {rank} \(local_rank: \d+\)\s+exitcode\s*: -9 .*SIGKILL", errs[1])
    assert report, errs[1][-3000:]  # torchrun's report on that node names the killed rank
    lines = [line for line in errs[0].splitlines() if line.startswith("mobius: error: rank ")]
    assert lines and all("lost its connection to another rank" in line for line in lines), errs[0][-3000:]


@pytest.mark.parametrize("mode", ["pipeline", "zero"])
def test_torchrun_killed_with_9_leaves_no_process_and_no_shared_memory_file_5_s_later(
        tmp_path: Path, deep_checkpoint: Path, corpus: Path, mode: str) -> None:
    """torchrun's agent killed with -9 while its ranks train: every rank (and whatever it started) ends
    within 5 s, and the shared-memory files they had are removed."""
    raw = _raw(tmp_path, deep_checkpoint, corpus, "out", mode, max_steps=100000, micro_batches=2)
    if mode == "pipeline":
        raw["parallel"]["stages"] = 4
    run_file = tmp_path / "run.yaml"
    run_file.write_text(json.dumps(raw))
    (node,) = _two_nodes(run_file, nodes=1)
    metrics, deadline = tmp_path / "out" / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert node.poll() is None, node.communicate()[1][-3000:]
        time.sleep(0.2)
    assert len(_children(node.pid)) == 2, "torchrun should run two ranks"
    shared = shm_files(_group(node.pid))
    os.kill(node.pid, signal.SIGKILL)
    node.communicate(timeout=30)
    assert ended_within(node.pid, 5) == [], "processes of the run outlived torchrun by 5 s"
    assert [p for p in shared if p.exists()] == [], "shared-memory files of the run were left behind"


def test_the_pipeline_under_torchrun_on_one_node_trains_like_one_device(tmp_path: Path, deep_checkpoint: Path,
                                                                        corpus: Path) -> None:
    """... and, being long enough to measure (6 steps), keeps its compute for the next plan like a run mobius
    started (:mod:`partition.calibrate`)."""
    ref = train(config_from_dict(_raw(tmp_path, deep_checkpoint, corpus, "ref", "single", max_steps=6), "ref.yaml"))
    run_file = tmp_path / "run.yaml"
    raw = _raw(tmp_path, deep_checkpoint, corpus, "pipe", "pipeline", max_steps=6)
    raw["parallel"]["stages"] = 4
    run_file.write_text(json.dumps(raw))
    (node,) = _two_nodes(run_file, nodes=1)
    out, err = node.communicate(timeout=300)
    assert node.returncode == 0, err[-3000:]
    assert "mode pipeline: 2 CPU worker process(es)" in err and "done: 6 steps" in out
    torch.testing.assert_close(_losses(tmp_path / "pipe"), torch.tensor(ref.losses), rtol=0, atol=1e-5)
    kept = list((tmp_path / "cache" / "partition" / "in_run").glob("*.json"))
    assert len(kept) == 1 and len(json.loads(kept[0].read_text())["runs"]) == 1


def test_the_pipeline_across_nodes_is_refused_in_one_line(tmp_path: Path, deep_checkpoint: Path,
                                                          corpus: Path) -> None:
    run_file = tmp_path / "run.yaml"
    run_file.write_text(json.dumps(_raw(tmp_path, deep_checkpoint, corpus, "pipe", "pipeline")))
    nodes = _two_nodes(run_file)
    errs = [p.communicate(timeout=120)[1] for p in nodes]
    assert all(p.returncode != 0 for p in nodes)
    lines = [x for e in errs for x in e.splitlines() if x.startswith("mobius: error: ")]
    assert lines and all("parallel.mode=pipeline runs on one machine" in x and "2 nodes" in x
                                   for x in lines), errs[0][-3000:]
