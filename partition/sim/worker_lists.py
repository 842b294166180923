"""A worker of the simulation: its action list split per engine (:class:`WorkerLists`, fixed for the run) and
the state of those engines in the current step (:class:`Worker`)."""

from __future__ import annotations

from dataclasses import dataclass

from partition.schedule import COMPUTE, Kind, Schedule


@dataclass
class Task:
    """One action of a worker's list, with what it waits for."""

    kind: Kind
    stage: int
    micro: int = -1
    phase: str = "f"
    occ: int = -1  # the occupancy (upload) it belongs to
    trigger: int = -1  # a d2h task: the compute task whose end produces its data
    reload: bool = False  # an upload followed by the stage's offloaded inputs (RELOAD, on the same copy thread)
    round: int = -1  # round-robin: the round of an upload or download
    unit: int = -1  # round-robin: the unit whose input an OFFLOAD keeps
    tstep: int = 0  # the training step of the lists it belongs to (round-robin lists hold several)


class WorkerLists:
    """One worker's actions per engine: its compute stream, copy thread, download stream and CPU updates."""

    def __init__(self, w: int, sched: Schedule):
        self.compute: list[Task] = []  # compute stream: forwards, backwards, device AdamWs
        self.uploads: list[Task] = []
        self.d2h: list[Task] = []  # gradient downloads and input offloads, in issue order
        self.updates: dict[int, list[int]] = {}  # step -> stages with a CPU update after its REDUCE, in order
        self.reloads: list[int] = []  # compute tasks that first bring their input back from host memory
        self.program = sched.steps > 1  # one list of several steps (round-robin): its updates by step
        self._split(sched, sched.actions[w])
        self.posts = self._posts(w, sched)

    def _split(self, sched: Schedule, actions: tuple) -> None:
        """The list's actions per engine. Device updates that follow REDUCE (a barrier) run on the
        compute stream before the next step's first forward: they open the step's compute list."""
        occ_of = {(a.stage, a.phase, a.round): k for k, a in enumerate(x for x in actions if x.kind == Kind.UPLOAD)}
        rounds = sched.rounds
        opening: list[Task] = []
        reduces, reload_unit = 0, -1
        for a in actions:
            tstep = max(a.round, 0) // rounds
            if a.kind in (Kind.UPLOAD, Kind.PREFETCH):
                self.uploads.append(Task(a.kind, a.stage, phase=a.phase, occ=occ_of[(a.stage, a.phase, a.round)],
                                         round=a.round, tstep=tstep))
            elif a.kind == Kind.RELOAD and a.micro < 0:  # all of a stage's inputs, with its backward upload
                self.uploads[-1].reload = True
            elif a.kind == Kind.RELOAD:  # one micro-batch's input, before its backward (round-robin)
                reload_unit = a.unit
            elif a.kind in COMPUTE:
                r = sched.round_of(a.micro)
                phase = "b" if a.kind in (Kind.BACKWARD, Kind.RECOMPUTE) and (a.stage, "b", r) in occ_of else "f"
                self.compute.append(Task(a.kind, a.stage, a.micro, occ=occ_of.get((a.stage, phase, r), -1),
                                         tstep=max(r, 0) // rounds, unit=reload_unit))
                if reload_unit >= 0:
                    self.reloads.append(len(self.compute) - 1)
                reload_unit = -1
            elif a.kind == Kind.OFFLOAD:
                self.d2h.append(Task(a.kind, a.stage, a.micro, trigger=len(self.compute) - 1, unit=a.unit,
                                     tstep=self.compute[-1].tstep))
            elif a.kind == Kind.DOWNLOAD:
                self.d2h.append(Task(a.kind, a.stage, occ=self.compute[-1].occ, trigger=len(self.compute) - 1,
                                     round=a.round, tstep=tstep))
            elif a.kind == Kind.UPDATE:
                self.updates.setdefault(max(reduces - 1, 0) if sched.barrier else 0, []).append(a.stage)
            elif a.kind == Kind.DEVICE_UPDATE:
                (opening if reduces else self.compute).append(Task(a.kind, a.stage))
            reduces += a.kind == Kind.REDUCE
        self.compute = opening + self.compute
        for t in self.d2h:
            t.trigger += len(opening)
        downloaded = {t.occ for t in self.d2h if t.kind == Kind.DOWNLOAD}
        last = {t.occ: i for i, t in enumerate(self.compute) if t.occ >= 0}
        self.release_at = {i: occ for occ, i in last.items() if occ not in downloaded}  # compute -> occupancy freed
        self.triggers: dict[int, list[int]] = {}
        for k, t in enumerate(self.d2h):
            self.triggers.setdefault(t.trigger, []).append(k)

    def _posts(self, w: int, sched: Schedule) -> list[int]:
        """Per compute task, the messages the worker's dispatch thread posts after it and before the next:
        the send of its output, the receive of the next one's input (to and from other workers)."""
        def crossing(stage: int, micro: int) -> int:
            return int(0 <= stage < sched.num_stages and sched.worker_for(stage, micro) != w)

        def ends(task: Task) -> tuple[int, int]:  # (receives, sends)
            if task.kind not in (Kind.FORWARD, Kind.BACKWARD, Kind.FB):
                return 0, 0
            back = task.kind != Kind.FORWARD
            return (crossing(sched.producer(task.stage, back), task.micro),
                    crossing(sched.consumer(task.stage, back), task.micro))
        edges = [ends(t) for t in self.compute]
        posts = [sends + (edges[i + 1][0] if i + 1 < len(edges) else 0) for i, (_, sends) in enumerate(edges)]
        if posts:
            posts[0] += edges[0][0]
        return posts

    def updates_of(self, step: int) -> list[int]:
        """The stages whose CPU updates of ``step`` the worker runs (a step's lists repeat unless they are a
        program of several)."""
        return self.updates.get(step if self.program else 0, [])


class Worker:
    """One worker's lists and the state of its engines in the current step."""

    def __init__(self, w: int, gpu: int, sched: Schedule):
        self.w, self.gpu = w, gpu
        self.lists = WorkerLists(w, sched)
        self.reset()

    def reset(self) -> None:
        self.ci = self.ui = self.di = self.ri = 0
        self.busy_until: float | None = None  # when the compute engine is free (its compute and posted messages)
        self.running: tuple[Task, float, float] | None = None  # the compute in it: (task, start, posted seconds)
        self.comp_end = 0.0  # when that compute ends at its current rate
        self.comp_left = 0.0  # its seconds left at full speed (CPU workers share the host's cores: share_host)
        self.comp_rate = 1.0
        self.last_end = 0.0
        self.uploading = self.downloading = False
        self.upload_done: dict[int, float] = {}
        self.prefetched: dict[int, float] = {}  # occupancy -> bytes of it that wait in the prefetch buffer
        self.released: dict[int, float] = {}
        self.d2h_ready: dict[int, float] = {}  # d2h task -> time its data is produced
        self.pending_sends = 0
        self.woken = True  # something its next compute waits for may have happened since it last checked
        self.upload_held: tuple[int, int] | None = None  # (ui, Clock.unheld) when its next upload last had to wait


def downloads_per_step(sched: Schedule) -> dict[tuple[int, int], int]:
    """(step of the lists, stage) -> the gradient downloads of that stage in that step."""
    rounds = sched.rounds
    out: dict[tuple[int, int], int] = {}
    for acts in sched.actions:
        for a in acts:
            if a.kind == Kind.DOWNLOAD:
                key = (max(a.round, 0) // rounds, a.stage)
                out[key] = out.get(key, 0) + 1
    return out
