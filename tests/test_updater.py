"""The optimizer thread (``scheduler.updater.CpuUpdater``): jobs in the order queued, a job queued ``first``
(a delayed update's compute copy) ahead of the others that wait, once its condition holds; failures kept for the
dispatch thread."""

from __future__ import annotations

import threading

import pytest

from scheduler.updater import CpuUpdater


class _Gate:
    """What a job waits for before it starts (a download's event)."""

    def __init__(self) -> None:
        self.open, self.waiting = threading.Event(), threading.Event()

    def synchronize(self) -> None:
        self.waiting.set()
        assert self.open.wait(10)


def test_a_job_queued_first_runs_before_the_jobs_waiting_and_the_rest_in_order() -> None:
    updater, ran, gate = CpuUpdater(), [], _Gate()
    done = {name: threading.Event() for name in ("adam0", "adam1", "adam2", "copy2", "copy3")}

    def job(name: str):
        return lambda: ran.append(name) or 0

    updater.submit(job("adam0"), gate, done["adam0"])  # holds the thread until its gradients are down
    assert gate.waiting.wait(10)  # begun: what is queued now waits
    updater.submit(job("adam1"), None, done["adam1"])
    updater.submit(job("copy2"), None, done["copy2"], first=True)
    updater.submit(job("adam2"), None, done["adam2"])
    updater.submit(job("copy3"), None, done["copy3"], first=True)
    gate.open.set()
    updater.sync()
    assert ran == ["adam0", "copy2", "copy3", "adam1", "adam2"]
    assert all(e.is_set() for e in done.values())
    updater.close()


def test_a_job_queued_first_after_a_condition_waits_for_the_jobs_that_make_it_true() -> None:
    """A delayed compute copy queued while its stage's previous update still waits behind another: it runs right
    after that update, ahead of the jobs queued after it, and never before it."""
    updater, ran, gate = CpuUpdater(), [], _Gate()
    done = {name: threading.Event() for name in ("adam0", "adam1", "adam2", "copy1", "copy0")}
    runs = {"adam1": 0}

    def job(name: str):
        def run() -> int:
            ran.append(name)
            runs[name] = runs.get(name, 0) + 1
            return 0
        return run

    updater.submit(job("adam0"), gate, done["adam0"])  # holds the thread
    assert gate.waiting.wait(10)
    updater.submit(job("adam1"), None, done["adam1"])
    updater.submit(job("copy1"), None, done["copy1"], first=True, after=lambda: runs["adam1"] >= 1)
    updater.submit(job("copy0"), None, done["copy0"], first=True)
    updater.submit(job("adam2"), None, done["adam2"])
    gate.open.set()
    updater.sync()
    assert ran == ["adam0", "copy0", "adam1", "copy1", "adam2"]
    assert all(e.is_set() for e in done.values())
    updater.close()


def test_a_failed_job_sets_its_event_and_is_raised_where_checked() -> None:
    updater, done, after = CpuUpdater(), threading.Event(), threading.Event()

    def fails() -> int:
        raise ValueError("no memory for the moments")

    updater.submit(fails, None, done)
    updater.submit(lambda: 0, None, after)
    with pytest.raises(RuntimeError, match="a CPU update failed: ValueError: no memory for the moments"):
        updater.sync()
    assert done.is_set() and after.is_set()
    updater.close()
