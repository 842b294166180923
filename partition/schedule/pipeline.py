"""The Mobius pipeline step as data: one ordered list of actions per worker (GPU).

Stage ``j`` runs on worker ``gpu_of[j]``. Each worker runs its stages' forwards in ascending order,
every micro-batch of a stage before the next stage, then the backwards in descending order (GPipe
with more stages than GPUs, Mobius §3.1, Fig. 4). The last stage runs forward, loss and backward
per micro-batch in one action (``FB``), so it needs no recompute, and the last forward stage of
every worker stays resident for its first backward.

The runtime's executor dispatches on these lists and the planner's simulator interprets the same
lists, so what is planned is what runs. They are built by small passes:

1. :func:`compute_order` -- forward / FB / backward actions per worker;
2. :func:`add_swaps` -- ``UPLOAD`` / ``FREE`` around each residency of a stage on its worker; with
   two device slots the upload of a residency is issued when the one before it starts computing;
   with one slot and a prefetch buffer (partial prefetch, the Mobius paper's eqs. 5-6) the first
   bytes of the next residency's weights go to the buffer then (``PREFETCH``) and its ``UPLOAD``,
   once the slot is free, moves them into the slot and copies the rest;
3. :func:`add_transfers` -- receives before and sends after each compute action, for activations
   and their gradients between the workers of adjacent stages;
4. :func:`add_offloads` -- with ``offload_inputs``, a stage that leaves its slot between its forward
   and its backward (:func:`offloaded_stages`) sends each forward's input to host memory
   (``OFFLOAD``) and takes them back right after its backward upload (``RELOAD``);
5. :func:`add_updates` -- the gradient ``DOWNLOAD`` after a stage's last backward, its CPU
   ``UPDATE``, the exchange of a tied weight's two ends (``TIE``) and the step's ``REDUCE`` (loss,
   global gradient norm, fp16 overflow). Without clipping and fp16 a stage updates as soon as its
   gradients are down; with either, every update waits for the global norm (``REDUCE``) and the
   stages update in ascending order, so the next step's first stages are ready first. Under
   ``train.update: delayed`` the next step's uploads wait only for the compute copy, which the
   runtime takes when the gradients are down, so the updates after the norm go in the order of the
   downloads instead: the next step's download of a stage waits for its update.

:func:`timeline` prints the lists as a grid.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import Literal

from mobius.errors import MobiusError


class Kind(enum.Enum):
    UPLOAD = "U"
    PREFETCH = "P"  # the first bytes of a residency's weights into the prefetch buffer (one slot)
    FREE = "X"
    FORWARD = "F"
    FB = "FB"
    BACKWARD = "B"
    RECOMPUTE = "C"  # round-robin: a backward's recompute, ahead of the gradient it waits for
    RECV_ACT = "ra"
    SEND_ACT = "sa"
    RECV_GRAD = "rg"
    SEND_GRAD = "sg"
    OFFLOAD = "H"  # a forward's boundary input to host memory
    RELOAD = "L"  # a stage's boundary inputs back from host memory, after its backward upload
    DOWNLOAD = "D"
    UPDATE = "O"
    DEVICE_UPDATE = "Od"
    TIE = "T"
    REDUCE = "R"


COMPUTE = frozenset({Kind.FORWARD, Kind.FB, Kind.BACKWARD, Kind.RECOMPUTE})
Phase = Literal["f", "b"]


@dataclass(frozen=True)
class Action:
    kind: Kind
    stage: int = -1  # -1 for step-wide actions (TIE, REDUCE)
    micro: int = -1  # -1 for per-stage actions (UPLOAD, FREE, RELOAD, DOWNLOAD, UPDATE)
    phase: Phase = "f"  # which pass an UPLOAD / PREFETCH / FREE belongs to
    peer: int = -1  # the other worker of a send / receive
    round: int = -1  # round-robin schedules: the round of an UPLOAD / FREE / RELOAD / DOWNLOAD (-1: none)
    unit: int = -1  # round-robin schedules: the unit whose input an OFFLOAD keeps (-1: the stage's own input)

    def __str__(self) -> str:
        m = f",{self.micro}" if self.micro >= 0 else ""
        p = self.phase if self.kind in (Kind.UPLOAD, Kind.PREFETCH, Kind.FREE) else ""
        s = str(self.stage) if self.stage >= 0 else ""
        r = f"r{self.round}" if self.round >= 0 and self.micro < 0 else ""
        u = f"@{self.unit}" if self.unit >= 0 else ""
        return f"{self.kind.value}{p}{s}{u}{r}{m}"


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline runtime's settings of one plan: what the schedule's passes, the MIP's timing
    model, the simulator and the executor all read (one value, never re-derived)."""

    num_slots: int = 2  # device slots per worker (2: the next residency uploads while the current one computes)
    offload_inputs: bool = False  # boundary inputs of stages that leave their slot wait in host memory
    barrier: bool = False  # updates wait for the global gradient norm (clipping, fp16)
    resident: frozenset[int] = frozenset()  # stages kept on their device: no upload, download or CPU update
    kept: frozenset[int] = frozenset()  # stages whose backward uses the forward's graph (no recompute)
    grad_dtype: str = "fp32"  # gradient downloads: fp32 sums, or "half" (the training dtype)
    prefetch_bytes: int = 0  # one slot: a buffer for the first bytes of the next residency's weights (0: none)
    delayed: bool = False  # train.update: delayed -- a step computes with the weights one update older (its
    # uploads wait for the update of the step before the previous one, and the step does not wait for its updates)
    states: str = "fp32"  # train.optimizer_states: the AdamW moments' precision (host bytes and CPU update rate)

    def __post_init__(self) -> None:
        if self.prefetch_bytes < 0 or self.prefetch_bytes and self.num_slots != 1:
            raise ScheduleError(f"a prefetch buffer ({self.prefetch_bytes} bytes) goes with one device slot, not "
                                f"{self.num_slots}: two slots prefetch whole stages")

    @property
    def grad_bytes(self) -> float:
        """Bytes per parameter of a gradient download."""
        return 2.0 if self.grad_dtype == "half" else 4.0

    def to_json(self) -> dict:
        """The settings by field name, JSON-ready (a set of stages as a sorted list, a tuple as a list)."""
        return {k: sorted(v) if isinstance(v, frozenset) else list(v) if isinstance(v, tuple) else v
                for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict) -> "PipelineOptions":
        """Settings :meth:`to_json` wrote, by field name (other keys in ``data`` ignored; a missing field takes
        its default), each set or tuple of stages restored."""
        kw = {}
        for f in fields(cls):
            if f.name in data:
                kind = type(f.default)
                kw[f.name] = kind(data[f.name]) if kind in (frozenset, tuple) else data[f.name]
        return cls(**kw)


def offloaded_stages(gpu_of: tuple[int, ...], options: PipelineOptions) -> frozenset[int]:
    """The stages whose boundary inputs wait for their backward in host memory: with
    ``offload_inputs``, every stage that leaves its slot between its forward and its backward -- not
    stage 0 (token ids), not a resident stage, not a kept one (its graph holds its input), not a
    worker's last swapped stage (its backward follows its forward without a new upload)."""
    if not options.offload_inputs:
        return frozenset()
    last_swapped = {w: j for j, w in enumerate(gpu_of) if j not in options.resident}
    return frozenset(j for j in range(1, len(gpu_of)) if j not in options.resident | options.kept
                     and last_swapped[gpu_of[j]] != j)


@dataclass(frozen=True)
class Schedule:
    """Per-worker action lists of one training (or evaluation) step, and the facts they assume."""

    num_stages: int
    num_workers: int
    micro_batches: int
    gpu_of: tuple[int, ...]  # stage -> worker
    actions: tuple[tuple[Action, ...], ...]  # worker -> ordered actions
    train: bool
    options: PipelineOptions = field(default_factory=PipelineOptions)
    tied: bool = False  # stage 0 and the last stage hold the two ends of one tied weight
    offloaded: frozenset[int] = frozenset()  # stages with OFFLOAD / RELOAD actions (:func:`offloaded_stages`)
    tie_in: bool = False  # one worker holds both ends: stage 0's backward upload brings the head's end's gradient
    # into the slot's sums, its backward adds onto it, and its download is the sum (no TIE on the host)

    num_slots = property(lambda self: self.options.num_slots)
    barrier = property(lambda self: self.options.barrier and self.train)
    resident = property(lambda self: self.options.resident)
    kept = property(lambda self: self.options.kept if self.train else frozenset())

    @cached_property
    def last_uploads(self) -> dict[int, str]:
        """Stage -> the pass of its last upload in the step: the step's last read of its host copy."""
        return {a.stage: a.phase for acts in self.actions for a in acts if a.kind == Kind.UPLOAD}

    @cached_property
    def upload_order(self) -> dict[tuple[int, str], int]:
        """(stage, pass) -> position in :func:`uploads_in_order` (the root-complex serving order)."""
        return {key: i for i, key in enumerate(uploads_in_order(self))}

    def stages_of(self, worker: int) -> list[int]:
        return [j for j in range(self.num_stages) if self.gpu_of[j] == worker]

    # ---- what the simulator asks of every schedule family (partition.schedule.roundrobin_actions answers the same) ----
    steps = 1  # training steps the lists hold
    rounds = 1  # rounds per step (a round-robin notion: one here)
    compute_copies = 1  # train.update: delayed: host copies per stage of the weights the GPU computes with (and
    # of its gradient buffer)

    def download_work(self, round: int) -> float:
        """Host memory work after a gradient download, in CPU updates of its parameters: none (the sums arrive
        whole and the GPU reads them for the norm)."""
        return 0.0

    def sums_up(self, stage: int, round: int) -> bool:
        """Whether an upload also brings gradient sums up (a round-robin notion: never here)."""
        return False

    tie_ends = property(lambda self: (0, self.num_stages - 1))  # the stages holding the two ends of a tied weight
    tie_readers = tie_ends  # the ends whose updates read both ends' gradients (each updates its own; one worker
    # holding both: the embedding's store updates the head's end, scheduler.stage_store.TiedEnd)
    tie_held = property(lambda self: self.num_stages - 1 if self.tie_in else None)  # the end that takes no AdamW
    # of its own
    tie_copies = False  # (nor a copy: the head's end reads the embedding's weights)

    def worker_for(self, stage: int, micro: int) -> int:
        """The worker that computes ``stage`` on micro-batch ``micro``."""
        return self.gpu_of[stage]

    def round_of(self, micro: int) -> int:
        """The round of micro-batch ``micro`` (a round-robin notion: -1 here, where a stage has one worker)."""
        return -1

    def consumer(self, stage: int, backward: bool) -> int:
        """The stage a compute action of ``stage`` hands its output to (out of range: none)."""
        return stage - 1 if backward else stage + 1

    def producer(self, stage: int, backward: bool) -> int:
        """The stage whose output a compute action of ``stage`` takes in (out of range: none); the last stage's
        FB takes the activations of the stage before."""
        return stage + 1 if backward and stage < self.num_stages - 1 else stage - 1

    def update_deps(self, stage: int) -> tuple[int, ...]:
        """The stages whose updates an upload of ``stage`` waits for (the weights it copies)."""
        return (stage,)

    def upload_rank(self, stage: int, phase: str, round: int) -> int:
        """An upload's place in :func:`uploads_in_order` (the order copies sharing a root complex are served)."""
        return self.upload_order[(stage, phase)]

    def reload_micros(self, stage: int, round: int) -> range:
        """The micro-batches whose offloaded inputs a RELOAD of ``stage`` brings back."""
        return range(self.micro_batches)


def compute_order(num_stages: int, gpu_of: tuple[int, ...], micro_batches: int, worker: int,
                  train: bool = True) -> list[Action]:
    """Forward of each stage on all micro-batches (ascending stages), then backward (descending)."""
    mine = [j for j in range(num_stages) if gpu_of[j] == worker]
    last = num_stages - 1
    out: list[Action] = []
    for j in mine:
        kind = Kind.FB if j == last and train else Kind.FORWARD
        out += [Action(kind, j, m) for m in range(micro_batches)]
    if train:
        for j in reversed(mine):
            if j != last:
                out += [Action(Kind.BACKWARD, j, m) for m in range(micro_batches)]
    return out


def _residencies(compute: list[Action], resident: frozenset[int]) -> list[tuple[int, Phase, int, int]]:
    """(stage, phase, first index, last index) of each run of one swapped stage's compute; the
    compute of resident stages in between does not interrupt a run (it takes no slot)."""
    runs: list[tuple[int, Phase, int, int]] = []
    for i, a in enumerate(compute):
        if a.stage in resident:
            continue
        phase: Phase = "b" if a.kind == Kind.BACKWARD else "f"
        if runs and runs[-1][0] == a.stage:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2], i)
        else:
            runs.append((a.stage, phase, i, i))
    return runs


def add_swaps(compute: list[Action], num_slots: int, resident: frozenset[int] = frozenset(),
              prefetch: bool = False) -> list[Action]:
    """Insert uploads and frees. A stage stays on the device across its forward/backward turn;
    resident stages never move.

    With two slots the next residency's upload is issued just before the current residency
    computes (it lands in the slot the residency before the current one freed); with one slot,
    only after the current residency is freed -- with ``prefetch`` (a prefetch buffer), its
    ``PREFETCH`` is issued where two slots would issue the upload.
    """
    runs = _residencies(compute, resident)
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for r, (stage, phase, first, last) in enumerate(runs):
        continues = r + 1 < len(runs) and runs[r + 1][0] == stage  # forward -> backward of the same stage
        resumed = r > 0 and runs[r - 1][0] == stage
        if not continues:
            after.setdefault(last, []).append(Action(Kind.FREE, stage, phase=phase))
        if resumed:
            continue
        upload = Action(Kind.UPLOAD, stage, phase=phase)
        if r == 0 or num_slots < 2:
            before.setdefault(first, []).insert(0, upload)
            if r > 0 and prefetch:  # the buffer fills while the previous residency computes
                before.setdefault(runs[r - 1][2], []).append(Action(Kind.PREFETCH, stage, phase=phase))
        else:  # issued when the previous residency starts computing (its predecessor is freed by then)
            before.setdefault(runs[r - 1][2], []).append(upload)
    out: list[Action] = []
    for i, a in enumerate(compute):
        out += before.get(i, [])
        out.append(a)
        out += after.get(i, [])
    return out


def add_transfers(actions: list[Action], num_stages: int, gpu_of: tuple[int, ...]) -> list[Action]:
    """Receive each compute action's input before it and send its output after it."""
    last = num_stages - 1
    out: list[Action] = []
    for a in actions:
        j, m = a.stage, a.micro
        if a.kind in (Kind.FORWARD, Kind.FB) and j > 0:
            out.append(Action(Kind.RECV_ACT, j, m, peer=gpu_of[j - 1]))
        if a.kind == Kind.BACKWARD:
            out.append(Action(Kind.RECV_GRAD, j, m, peer=gpu_of[j + 1]))
        out.append(a)
        if a.kind == Kind.FORWARD and j < last:
            out.append(Action(Kind.SEND_ACT, j, m, peer=gpu_of[j + 1]))
        if a.kind in (Kind.BACKWARD, Kind.FB) and j > 0:
            out.append(Action(Kind.SEND_GRAD, j, m, peer=gpu_of[j - 1]))
    return out


def add_offloads(actions: list[Action], offloaded: frozenset[int]) -> list[Action]:
    """After each forward of an offloaded stage, its input to host memory; after the stage's
    backward upload, its inputs back (the backward waits for them as for the upload)."""
    out: list[Action] = []
    for a in actions:
        out.append(a)
        if a.stage not in offloaded:
            continue
        if a.kind == Kind.FORWARD:
            out.append(Action(Kind.OFFLOAD, a.stage, a.micro))
        elif a.kind == Kind.UPLOAD and a.phase == "b":
            out.append(Action(Kind.RELOAD, a.stage, phase="b"))
    return out


def add_updates(actions: list[Action], num_stages: int, barrier: bool, tied: bool,
                resident: frozenset[int] = frozenset(), delayed: bool = False, tie_in: bool = False) -> list[Action]:
    """Download a stage's gradients after its last backward; update it there (or after the step's
    REDUCE when ``barrier``: in ascending order, or ``delayed`` in the order of the downloads); tied ends
    exchange their gradients (TIE) at the end, unless they were summed on the device (``tie_in``), and
    update last. A resident stage downloads nothing and updates on its device."""
    ends = {0, num_stages - 1} if tied and num_stages > 1 else set()
    if ends & resident:
        raise ScheduleError(f"stage(s) {sorted(ends & resident)} hold an end of the tied weight and cannot be "
                            f"resident: the two ends exchange gradients through host memory")
    last_compute = {a.stage: i for i, a in enumerate(actions) if a.kind in (Kind.BACKWARD, Kind.FB)}
    device_after: dict[int, int] = {}  # a device update runs on the compute stream: after the gradient's send
    for j, i in last_compute.items():
        if j in resident and not barrier:
            sends = i + 1 < len(actions) and actions[i + 1].kind == Kind.SEND_GRAD and actions[i + 1].stage == j
            device_after[i + 1 if sends else i] = j
    out: list[Action] = []
    for i, a in enumerate(actions):
        out.append(a)
        if last_compute.get(a.stage) == i and a.kind in (Kind.BACKWARD, Kind.FB):
            if a.stage not in resident:
                out.append(Action(Kind.DOWNLOAD, a.stage))
            if not barrier and a.stage not in ends and a.stage not in resident:
                out.append(_update(a.stage, resident))
        if i in device_after:
            out.append(_update(device_after[i], resident))
    mine = sorted(last_compute)
    if ends & set(mine):
        if not tie_in:
            out.append(Action(Kind.TIE))
        if not barrier:
            out += [_update(j, resident) for j in mine if j in ends]
    out.append(Action(Kind.REDUCE))
    if barrier:  # resident stages first: their device updates run before the next step's first forward
        swapped = [a.stage for a in out if a.kind == Kind.DOWNLOAD] if delayed else [j for j in mine
                                                                                     if j not in resident]
        out += [_update(j, resident) for j in mine if j in resident] + [_update(j, resident) for j in swapped]
    return out


def _update(stage: int, resident: frozenset[int]) -> Action:
    return Action(Kind.DEVICE_UPDATE if stage in resident else Kind.UPDATE, stage)


def build_schedule(num_stages: int, num_workers: int, micro_batches: int, gpu_of: list[int] | None = None,
                   options: PipelineOptions = PipelineOptions(), tied: bool = False) -> Schedule:
    """The per-worker action lists of one training step."""
    g = _gpu_of(num_stages, num_workers, gpu_of)
    offloaded = offloaded_stages(g, options)
    tie_in = tied and num_stages > 1 and g[0] == g[-1]  # stage 0's backward always uploads: the head computes
    # between its forward and its backward, and a tied end is never resident
    lists = []
    for w in range(num_workers):
        acts = compute_order(num_stages, g, micro_batches, w)
        acts = add_swaps(acts, options.num_slots, options.resident, options.prefetch_bytes > 0)
        acts = add_offloads(add_transfers(acts, num_stages, g), offloaded)
        lists.append(tuple(add_updates(acts, num_stages, options.barrier, tied, options.resident, options.delayed,
                                       tie_in)))
    sched = Schedule(num_stages, num_workers, micro_batches, g, tuple(lists), True, options, tied, offloaded, tie_in)
    check(sched)
    return sched


def build_eval_schedule(num_stages: int, num_workers: int, micro_batches: int, gpu_of: list[int] | None = None,
                        options: PipelineOptions = PipelineOptions()) -> Schedule:
    """Forward only: the last stage's forward ends in the loss; the step ends in REDUCE (the loss).
    Of the options only the slots and the resident stages matter."""
    g = _gpu_of(num_stages, num_workers, gpu_of)
    lists = []
    for w in range(num_workers):
        compute = compute_order(num_stages, g, micro_batches, w, train=False)
        acts = add_transfers(add_swaps(compute, options.num_slots, options.resident, options.prefetch_bytes > 0),
                             num_stages, g)
        lists.append(tuple(acts + [Action(Kind.REDUCE)]))
    sched = Schedule(num_stages, num_workers, micro_batches, g, tuple(lists), False, options)
    check(sched)
    return sched


def _gpu_of(num_stages: int, num_workers: int, gpu_of: list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    g = tuple(gpu_of) if gpu_of is not None else tuple(j % num_workers for j in range(num_stages))
    if len(g) != num_stages or set(g) != set(range(num_workers)):
        raise ScheduleError(f"stage placement {list(g)} must give each of {num_stages} stages one of {num_workers} "
                            f"workers and every worker a stage")
    return g


class ScheduleError(MobiusError):
    """A schedule that breaks an invariant the runtime relies on (a bug in a pass, or settings that
    no pass can honour)."""


def check(s: Schedule) -> None:
    """Every compute happens while its stage is on the device, at most ``num_slots`` stages are
    uploaded at once, each stage is downloaded and updated exactly once (training), inputs offloaded
    are reloaded, and every list ends in (or, with a barrier, continues after) one REDUCE."""
    for w, acts in enumerate(s.actions):
        _check_residency(s, w, acts)
        if sum(a.kind == Kind.REDUCE for a in acts) != 1:
            raise ScheduleError(f"worker {w}: {sum(a.kind == Kind.REDUCE for a in acts)} REDUCE actions, not one")
        for j in s.stages_of(w):
            counts = {k: sum(a.kind in k and a.stage == j for a in acts) for k in _ONCE}
            want = {_ONCE[0]: int(s.train and j not in s.resident), _ONCE[1]: int(s.train),
                    _ONCE[2]: int(j in s.offloaded), _ONCE[3]: s.micro_batches * int(j in s.offloaded)}
            for kinds, n in counts.items():
                if n != want[kinds]:
                    raise ScheduleError(f"worker {w}, stage {j}: {n} {'/'.join(k.name for k in kinds)} action(s), "
                                        f"expected {want[kinds]}")
    if s.tie_in:
        _check_tie_in(s)


def _check_tie_in(s: Schedule) -> None:
    """Summed on the device, the tied ends need stage 0's backward upload, the worker's last (its upload thread
    waits there for the head's download, so no upload may queue behind it), and the head's download before stage
    0's first backward."""
    acts, last = s.actions[s.gpu_of[0]], s.num_stages - 1
    at = {(a.kind, a.stage, a.phase): i for i, a in reversed(list(enumerate(acts)))}
    up, down = at.get((Kind.UPLOAD, 0, "b")), at.get((Kind.DOWNLOAD, last, "f"))
    first = next((i for i, a in enumerate(acts) if a.kind == Kind.BACKWARD and a.stage == 0), None)
    later = up is not None and any(a.kind in (Kind.UPLOAD, Kind.PREFETCH) for a in acts[up + 1:])
    if up is None or down is None or first is None or down > first or later or s.gpu_of[last] != s.gpu_of[0]:
        raise ScheduleError(f"the tied ends cannot be summed on worker {s.gpu_of[0]}: stage 0's backward upload "
                            f"{up}, the head's download {down}, stage 0's first backward {first}")


_ONCE = ((Kind.DOWNLOAD,), (Kind.UPDATE, Kind.DEVICE_UPDATE), (Kind.RELOAD,), (Kind.OFFLOAD,))


def _check_residency(s: Schedule, w: int, acts: tuple[Action, ...]) -> None:
    on_device: set[int] = set()  # stages uploaded and not yet freed
    buffered: tuple[int, str] | None = None  # the residency whose first bytes wait in the prefetch buffer
    for a in acts:
        if a.kind == Kind.PREFETCH:
            if buffered is not None or not s.options.prefetch_bytes:
                raise ScheduleError(f"worker {w}: {a} while the prefetch buffer holds {buffered} (or has none)")
            buffered = (a.stage, a.phase)
        elif a.kind == Kind.UPLOAD and buffered is not None:
            if buffered != (a.stage, a.phase):
                raise ScheduleError(f"worker {w}: {a} while the prefetch buffer holds stage {buffered[0]}")
            buffered = None
        if a.kind == Kind.UPLOAD:
            if a.stage in on_device or a.stage in s.resident or len(on_device) >= s.num_slots:
                raise ScheduleError(f"worker {w}: {a} while stages {sorted(on_device)} hold the "
                                    f"{s.num_slots} slot(s)")
            on_device.add(a.stage)
        elif a.kind == Kind.FREE:
            on_device.remove(a.stage)
        elif a.kind in COMPUTE and a.stage not in on_device and a.stage not in s.resident:
            raise ScheduleError(f"worker {w}: {a} computes a stage that is not on the device")
    if on_device or buffered is not None:
        raise ScheduleError(f"worker {w}: stages {sorted(on_device)} are never freed (or {buffered} never uploaded)")


def timeline(s: Schedule, width: int = 6) -> str:
    """The schedule as a grid: one row per worker, one column per issued action (issue order)."""
    rows = []
    for w, acts in enumerate(s.actions):
        rows.append(f"gpu{w} | " + "".join(str(a).ljust(width) for a in acts))
    legend = ("U=upload P=prefetch (the first bytes of the next stage into the prefetch buffer) X=free F=forward "
              "FB=forward+loss+backward B=backward (recomputes the forward unless the "
              "stage is kept) ra/sa=recv/send activation rg/sg=recv/send gradient H=input to host memory L=inputs "
              "back D=download grads O=CPU update Od=device update (resident stage) T=tied-weight exchange (none "
              "where one worker holds both ends: stage 0's backward upload brings the head's end's gradient) "
              "R=step reduce; suffix f/b: pass, then stage[,micro-batch]")
    return "\n".join(rows + [legend])


def uploads_in_order(s: Schedule) -> list[tuple[int, str]]:
    """All uploads of a step in the order their stages start computing (forward ascending, then
    backward descending) -- the order in which copies sharing a root complex are served."""
    fwd = [(j, "f") for j in range(s.num_stages) if j not in s.resident]
    bwd = [(a.stage, "b") for acts in s.actions for a in acts if a.kind == Kind.UPLOAD and a.phase == "b"]
    return fwd + sorted(bwd, key=lambda x: -x[0])
