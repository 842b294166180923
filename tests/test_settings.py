"""The parallel settings, resolved in one place from the config and the machine."""

from __future__ import annotations

import pytest

import topology
from mobius.app.run import check_parallel
from mobius.app.settings import DEVICE_RESERVE_BYTES, Machine, mode_options, resolve, static_mode, update_cores
from mobius.config import config_from_dict
from mobius.errors import ConfigError, NotAvailableError

GiB = 2**30


def _cfg(**parallel):
    return config_from_dict({"model": {"preset": "gpt2-tiny"}, "parallel": parallel}, "test.yaml")


def _box(groups, p2p: bool = False, cpus: int = 32) -> Machine:
    return Machine(topology.Topology.synthetic(groups, memory_bytes=24 * GiB, p2p=p2p), cpus, local=False)


@pytest.mark.parametrize("mode", ["single", "pipeline", "zero", "auto"])
def test_asking_for_cuda_without_a_gpu_stops_in_every_mode(mode: str) -> None:
    devices = 1 if mode == "single" else 2
    with pytest.raises(NotAvailableError, match="parallel.device=cuda but no CUDA GPU"):
        check_parallel(_cfg(mode=mode, device="cuda", devices=devices), Machine.cpu_only())


def test_cpu_workers_stand_in_for_gpus() -> None:
    s = resolve(_cfg(mode="pipeline", devices=2), Machine(None, 8, local=True))
    assert (s.device, s.gpus, s.workers, s.p2p, s.shared_gpu) == ("cpu", 0, 2, False, False)
    assert s.cpu_threads == 4 and s.groups == ((0,), (1,)) and s.memory_bytes == 4 * GiB


def test_a_workers_cpu_threads_are_its_share_of_the_cores_unless_set() -> None:
    box = Machine(topology.Topology.synthetic([1], memory_bytes=24 * GiB), 16, local=True)
    assert resolve(_cfg(mode="pipeline", devices=1, device="cuda"), box).cpu_threads == 14  # 2 for dispatch, copies
    assert resolve(_cfg(mode="pipeline", devices=1, device="cuda", cpu_threads=8), box).cpu_threads == 8
    with pytest.raises(ConfigError, match="cpu_threads"):
        _cfg(mode="pipeline", cpu_threads=0)


def test_pinned_updates_keep_off_each_gpu_workers_dispatch_cores() -> None:
    """``parallel.cpu_pinning``: a GPU worker's CPU updates keep to its share of the cores less the first 2 (its
    dispatch and copy threads'); CPU workers, whose dispatch thread computes, are not pinned; an optimizer thread
    started under pinning runs where it was told, and so do the threads its parallel loops start; one started after
    it is unpinned where the OS puts it."""
    import os
    import threading

    import torch

    from scheduler.updater import CpuUpdater, set_update_cores

    box = Machine(topology.Topology.synthetic([2], memory_bytes=24 * GiB), 16, local=True)
    s = resolve(_cfg(mode="pipeline", devices=2, device="cuda", cpu_pinning=True), box)
    assert s.cpu_pinning and "(updates pinned)" in s.describe() and s.cpu_threads == 6
    assert not resolve(_cfg(mode="pipeline", devices=2, device="cuda"), box).cpu_pinning
    assert not resolve(_cfg(mode="pipeline", devices=2, cpu_pinning=True), Machine(None, 8, local=True)).cpu_pinning
    assert update_cores(range(16), 0, 2) == (2, 3, 4, 5, 6, 7) and update_cores(range(16), 1, 2) == tuple(range(10, 16))
    assert update_cores([7, 3, 5, 1], 0, 1) == (5, 7) and update_cores(range(4), 1, 2) is None
    mine, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    where: list = []

    def tasks() -> set[int]:
        return {int(t) for t in os.listdir("/proc/self/task")}

    def job(into: list, before: set[int]) -> int:
        torch.set_num_threads(2)  # an update's parallel loop: its threads start here
        torch.ones(1 << 22).add_(1)
        # (on Linux a thread's cores; 0: the calling thread's)
        into.append((os.sched_getaffinity(0), [os.sched_getaffinity(t) for t in tasks() - before]))
        return 0

    try:
        for cores in ([mine[-1]], None):
            set_update_cores(cores)
            done, before = threading.Event(), tasks()
            updater = CpuUpdater()
            updater.submit(lambda: job(where, before), None, done)
            assert done.wait(10)
            updater.close()
    finally:
        set_update_cores(None)
        torch.set_num_threads(threads)
    (pinned, started), (free, _) = where
    assert pinned == {mine[-1]} and len(started) >= 2 and all(c == {mine[-1]} for c in started)  # and its loops'
    assert free == set(mine) and os.sched_getaffinity(0) == set(mine)  # unpinned; this thread untouched


def test_auto_needs_no_plan_only_for_one_device_without_a_gpu() -> None:
    assert static_mode(_cfg(devices=1), Machine.cpu_only()) == ("single", "auto: one device and no GPU, plain "
                                                                          "training on the CPU")
    assert static_mode(_cfg(devices=1), _box([1])) is None  # compares the planners' predictions
    assert static_mode(_cfg(mode="zero", devices=4), _box([2, 2])) == ("zero", "")
    s = resolve(_cfg(devices=4), _box([2, 2]), "pipeline", "the reason")
    assert s.mode == "pipeline" and s.workers == 4 and "(the reason)" in s.describe()
    assert resolve(_cfg(devices=4), _box([2, 2]), "single").workers == 1  # auto may pick one GPU of several


def test_auto_lists_why_a_mode_cannot_run() -> None:
    why = mode_options(_cfg(devices=3), _box([2, 2]))
    assert why["pipeline"] == "" and why["single"] == ""
    assert "train.micro_batches=4 evenly among parallel.devices=3" in why["zero"]
    assert "parallel.devices=2 CPU worker processes stand in" in mode_options(_cfg(devices=2), Machine.cpu_only())["single"]


def test_the_round_robin_schedule_is_the_pipelines() -> None:
    """Asked for with another mode it is refused; under auto only the pipeline remains."""
    with pytest.raises(NotAvailableError, match="parallel.schedule=round_robin is a schedule of parallel.mode=pipeline"):
        resolve(_cfg(mode="zero", devices=4, schedule="round_robin"), _box([2, 2]))
    why = mode_options(_cfg(devices=4, schedule="round_robin"), _box([2, 2]))
    assert why["pipeline"] == "" and "schedule=round_robin" in why["single"] and "schedule=round_robin" in why["zero"]


def test_a_whole_gpu_keeps_a_reserve_and_root_complexes_group_the_workers() -> None:
    s = resolve(_cfg(mode="pipeline", devices=4), _box([2, 2]))
    assert s.device == "cuda" and s.gpus == 4 and not s.memory_capped
    assert s.memory_bytes == 24 * GiB - DEVICE_RESERVE_BYTES
    assert s.groups == ((0, 1), (2, 3))
    assert s.cpu_threads == 32 // 4 - 2  # the worker's share, less its dispatch and copy threads


def test_workers_sharing_a_gpu_split_it_and_stage_their_transfers() -> None:
    s = resolve(_cfg(mode="pipeline", devices=2, p2p="auto"), _box([1], p2p=True))
    assert s.shared_gpu and s.memory_capped and s.memory_bytes == 12 * GiB and not s.p2p
    assert s.groups == ((0, 1),)
    with pytest.raises(ConfigError, match="one GPU per worker"):
        resolve(_cfg(mode="pipeline", devices=2, p2p="on"), _box([1]))


def test_workers_sharing_a_gpu_are_planned_on_its_link_shared() -> None:
    """Two workers on one GPU: each alone moves at the GPU's host link, and both together share it (one root
    complex of that rate), as a worker alone on the GPU would be planned."""
    from mobius.app.planning import hardware

    alone_cfg, shared_cfg = _cfg(mode="pipeline", devices=1), _cfg(mode="pipeline", devices=2)
    alone = hardware(alone_cfg, resolve(alone_cfg, _box([1])), _box([1]))
    shared = hardware(shared_cfg, resolve(shared_cfg, _box([1])), _box([1]))
    link = min(alone.h2d_Bps[0], alone.d2h_Bps[0])
    assert shared.num_gpus == 2 and shared.groups == [[0, 1]]
    assert shared.h2d_Bps == shared.d2h_Bps == [link] * 2 and shared.rc_h2d_Bps == shared.rc_d2h_Bps == [link]


def test_peer_access_decides_p2p() -> None:
    assert resolve(_cfg(mode="pipeline", devices=2), _box([2], p2p=True)).p2p
    assert not resolve(_cfg(mode="pipeline", devices=2), _box([2], p2p=False)).p2p
    assert not resolve(_cfg(mode="pipeline", devices=2, p2p="off"), _box([2], p2p=True)).p2p


def test_a_memory_cap_larger_than_the_gpu_share_is_refused() -> None:
    raw = {"model": {"preset": "gpt2-tiny"}, "parallel": {"mode": "pipeline", "devices": 2},
           "partition": {"gpu_memory_gib": 16}}
    with pytest.raises(ConfigError, match="gpu_memory_gib=16 for 2 worker"):
        resolve(config_from_dict(raw, "t.yaml"), _box([1]))
    raw["partition"]["gpu_memory_gib"] = 10
    s = resolve(config_from_dict(raw, "t.yaml"), _box([1]))
    assert s.memory_bytes == 10 * GiB and s.memory_capped


def test_single_mode_runs_on_one_device() -> None:
    with pytest.raises(ConfigError, match="parallel.mode=single runs on one device"):
        resolve(_cfg(mode="single", devices=2), _box([2]))


@pytest.mark.parametrize("user", [None, "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_cuda_workers_grow_allocator_segments_unless_the_user_configured_it(monkeypatch: pytest.MonkeyPatch,
                                                                            user: str | None) -> None:
    import os

    import torch

    from mobius.app.launch import expandable_segments

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    if user:
        monkeypatch.setenv(user, "max_split_size_mb:64")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    expandable_segments()
    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") == (None if user == "PYTORCH_ALLOC_CONF" else
                                                         "max_split_size_mb:64" if user else "expandable_segments:True")
    if not user:  # too late once CUDA is up: nothing changes
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        expandable_segments()
        assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
