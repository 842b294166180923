"""The Mobius pipeline schedule as data: one ordered list of actions per worker (GPU).

Stage ``j`` runs on worker ``gpu_of[j]`` (round-robin over the mapping's slots). Each worker runs
its stages' forwards in ascending order, every micro-batch of a stage before the next stage, then
the backwards in descending order (GPipe with more stages than GPUs, Mobius §3.1, Fig. 4). The last
stage runs forward, loss and backward per micro-batch in one action (``fb``), so it needs no
recompute, and the last forward stage of every worker stays resident for its first backward.

The list is built by small passes:

1. :func:`compute_order` — forward / fb / backward actions per worker;
2. :func:`add_swaps` — ``upload`` / ``free`` around each residency of a stage on its worker, the
   upload moved one stage earlier when prefetching (two device slots: running + prefetch);
3. :func:`add_transfers` — ``recv``/``send`` of activations and their gradients between the
   workers of adjacent stages, then ``download`` of a stage's gradients and its ``update`` (CPU
   AdamW) after its last backward.

The executor dispatches on :attr:`Action.kind`; :func:`timeline` prints the lists as a grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

Kind = Literal["upload", "free", "forward", "fb", "backward", "recv_act", "send_act", "recv_grad", "send_grad",
               "download", "update"]
COMPUTE = ("forward", "fb", "backward")


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int
    micro: int = -1  # -1 for per-stage actions (upload, free, download, update)
    phase: Literal["f", "b"] = "f"  # which pass an upload / free belongs to
    peer: int = -1  # the other worker of a send / recv

    def __str__(self) -> str:
        short = {"upload": "U", "free": "X", "forward": "F", "fb": "FB", "backward": "B", "recv_act": "ra",
                 "send_act": "sa", "recv_grad": "rg", "send_grad": "sg", "download": "D", "update": "O"}[self.kind]
        m = f",{self.micro}" if self.micro >= 0 else ""
        p = self.phase if self.kind in ("upload", "free") else ""
        return f"{short}{p}{self.stage}{m}"


@dataclass(frozen=True)
class Schedule:
    num_stages: int
    num_workers: int
    micro_batches: int
    gpu_of: tuple[int, ...]  # stage -> worker
    actions: tuple[tuple[Action, ...], ...]  # worker -> ordered actions
    prefetch: bool

    @cached_property
    def upload_order(self) -> dict[tuple[int, str], int]:
        """(stage, pass) -> position in :func:`uploads_in_order` (the root-complex serving order)."""
        return {key: i for i, key in enumerate(uploads_in_order(self))}

    def stages_of(self, worker: int) -> list[int]:
        return [j for j in range(self.num_stages) if self.gpu_of[j] == worker]


def compute_order(num_stages: int, gpu_of: tuple[int, ...], micro_batches: int, worker: int) -> list[Action]:
    """Forward of each stage on all micro-batches (ascending stages), then backward (descending)."""
    mine = [j for j in range(num_stages) if gpu_of[j] == worker]
    last = num_stages - 1
    out: list[Action] = []
    for j in mine:
        kind = "fb" if j == last else "forward"
        out += [Action(kind, j, m) for m in range(micro_batches)]
    for j in reversed(mine):
        if j != last:
            out += [Action("backward", j, m) for m in range(micro_batches)]
    return out


def _residencies(compute: list[Action]) -> list[tuple[int, str, int, int]]:
    """(stage, phase, first index, last index) of each uninterrupted run of one stage's compute."""
    runs: list[tuple[int, str, int, int]] = []
    for i, a in enumerate(compute):
        phase = "b" if a.kind == "backward" else "f"
        if runs and runs[-1][0] == a.stage:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2], i)
        else:
            runs.append((a.stage, phase, i, i))
    return runs


def add_swaps(compute: list[Action], prefetch: bool) -> list[Action]:
    """Insert uploads and frees. A stage stays resident across the forward/backward turn.

    With prefetch the next residency's upload is issued as soon as the one before the current
    residency is freed (the current stage computes while the next one uploads); without, only
    after the current residency is freed.
    """
    runs = _residencies(compute)
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for r, (stage, phase, first, last) in enumerate(runs):
        continues = r + 1 < len(runs) and runs[r + 1][0] == stage  # forward -> backward of the same stage
        resumed = r > 0 and runs[r - 1][0] == stage
        if not continues:
            after.setdefault(last, []).append(Action("free", stage, phase=phase))
        if resumed:
            continue
        upload = Action("upload", stage, phase=phase)
        if r == 0 or not prefetch:
            before.setdefault(first, []).insert(0, upload)
        else:  # issued when the previous residency starts computing (its predecessor is freed by then)
            before.setdefault(runs[r - 1][2], []).append(upload)
    out: list[Action] = []
    for i, a in enumerate(compute):
        out += before.get(i, [])
        out.append(a)
        out += after.get(i, [])
    return out


def add_transfers(actions: list[Action], num_stages: int, gpu_of: tuple[int, ...]) -> list[Action]:
    """Insert activation / gradient receives before, and sends after, each compute action; the
    gradient download and CPU update after a stage's last backward (or last fb)."""
    last = num_stages - 1
    last_compute: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in ("backward", "fb"):
            last_compute[a.stage] = i
    out: list[Action] = []
    for i, a in enumerate(actions):
        j, m = a.stage, a.micro
        if a.kind in ("forward", "fb") and j > 0:
            out.append(Action("recv_act", j, m, peer=gpu_of[j - 1]))
        if a.kind == "backward":
            out.append(Action("recv_grad", j, m, peer=gpu_of[j + 1]))
        out.append(a)
        if a.kind == "forward" and j < last:
            out.append(Action("send_act", j, m, peer=gpu_of[j + 1]))
        if a.kind in ("backward", "fb") and j > 0:
            out.append(Action("send_grad", j, m, peer=gpu_of[j - 1]))
        if last_compute.get(j) == i:
            out += [Action("download", j), Action("update", j)]
    return out


def build_schedule(num_stages: int, num_workers: int, micro_batches: int, gpu_of: list[int] | None = None,
                   prefetch: bool = True) -> Schedule:
    """The per-worker action lists of one training step."""
    gpu_of_t = tuple(gpu_of) if gpu_of is not None else tuple(j % num_workers for j in range(num_stages))
    assert len(gpu_of_t) == num_stages and set(gpu_of_t) <= set(range(num_workers))
    lists = []
    for w in range(num_workers):
        acts = compute_order(num_stages, gpu_of_t, micro_batches, w)
        acts = add_swaps(acts, prefetch)
        acts = add_transfers(acts, num_stages, gpu_of_t)
        lists.append(tuple(acts))
    sched = Schedule(num_stages, num_workers, micro_batches, gpu_of_t, tuple(lists), prefetch)
    check(sched)
    return sched


def check(s: Schedule) -> None:
    """Internal invariants: every compute happens while its stage is resident, at most two stages
    are resident at once, and each stage is downloaded and updated exactly once."""
    for w, acts in enumerate(s.actions):
        resident: set[int] = set()
        for a in acts:
            if a.kind == "upload":
                assert a.stage not in resident, (w, str(a))
                resident.add(a.stage)
                assert len(resident) <= 2, (w, str(a), resident)
            elif a.kind == "free":
                resident.remove(a.stage)
            elif a.kind in COMPUTE:
                assert a.stage in resident, (w, str(a))
        assert not resident, (w, resident)
        for j in s.stages_of(w):
            assert sum(a.kind == "download" and a.stage == j for a in acts) == 1
            assert sum(a.kind == "update" and a.stage == j for a in acts) == 1


def timeline(s: Schedule, width: int = 6) -> str:
    """The schedule as a grid: one row per worker, one column per issued action (issue order)."""
    rows = []
    for w, acts in enumerate(s.actions):
        cells = [str(a).ljust(width) for a in acts]
        rows.append(f"gpu{w} | " + "".join(cells))
    legend = ("U=upload X=free F=forward FB=forward+loss+backward B=backward(recompute) ra/sa=recv/send activation "
              "rg/sg=recv/send gradient D=download grads O=CPU update; suffix f/b: pass, then stage[,micro-batch]")
    return "\n".join(rows + [legend])


def uploads_in_order(s: Schedule) -> list[tuple[int, str]]:
    """All uploads of a step in the order their stages start computing (forward ascending, then
    backward descending) — the order in which copies sharing a root complex are served."""
    fwd = [(j, "f") for j in range(s.num_stages)]
    bwd = [(a.stage, "b") for acts in s.actions for a in acts if a.kind == "upload" and a.phase == "b"]
    return fwd + sorted(bwd, key=lambda x: -x[0])
