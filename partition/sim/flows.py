"""Link and root-complex sharing: transfers are fluid flows over each GPU's links (host->GPU, GPU->host,
optionally both together) and each root complex's capacity, which may depend on how many streams share it
(measured by ``mobius topo --bench``). Rates are set by priority classes, highest first, each class sharing what
is left max-min fairly: ``sharing="priority"`` (the runtime's per-root-complex upload arbiter): activations
first, then uploads in the order the stages start, then gradient downloads, then input offloads;
``sharing="fair"``: everything shares equally."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Literal

from partition.hardware import Hardware
from partition.sim.clock import EPS_T, Clock

Sharing = Literal["priority", "fair"]
EPS_BYTES = 1e-3  # a flow this close to its total is done


@dataclass
class Flow:
    """One transfer in flight: its bytes, the links it holds, its priority and what follows its end."""

    label: str
    kind: str  # upload | act | grad | ckpt
    total: float
    resources: tuple
    cap: float
    prio: tuple
    on_done: Callable[[float], None]
    gpu: int
    track: str
    start: float
    done: float = 0.0
    rate: float = 0.0
    base: float = 0.0  # its rate on its links (CPU workers: times the share of the cores it gets, share_host)

    def __post_init__(self) -> None:
        self.distinct = len(set(self.resources)) == len(self.resources)  # each link once (_fill's short way)

    def remaining(self) -> float:
        return self.total - self.done


class Links:
    """The flows in flight over the machine's links and root complexes, and their rates."""

    def __init__(self, hw: Hardware, sharing: Sharing, clock: Clock):
        self.hw, self.sharing, self.clock = hw, sharing, clock
        self.flows: list[Flow] = []
        self.changed = False  # a flow started or ended since the rates were last set
        self.caps = {(d, g): rate for g in range(hw.num_gpus)  # each GPU's links, and the root complexes' with one
                     for d, rate in (("h2d", hw.h2d_Bps[g]), ("d2h", hw.d2h_Bps[g]))  # stream (_capacities)
                     + ((("bidir", hw.bidir_Bps[g]),) if hw.bidir_Bps else ())}
        for k in range(len(hw.groups)):
            self.caps[("rc_h2d", k)] = hw.rc_rate(k, "h2d", 1)
            self.caps[("rc_d2h", k)] = hw.rc_rate(k, "d2h", 1)

    # ---- flows in ------------------------------------------------------------------------------
    def h2d(self, gpu: int, label: str, kind: str, nbytes: float, prio: tuple,
            on_done: Callable[[float], None]) -> None:
        res = [("h2d", gpu), ("rc_h2d", self.hw.group_of(gpu))]
        self._add(label, kind, nbytes, res, math.inf, prio, on_done, gpu, "h2d")

    def d2h(self, gpu: int, label: str, kind: str, nbytes: float, prio: tuple,
            on_done: Callable[[float], None]) -> None:
        res = [("d2h", gpu), ("rc_d2h", self.hw.group_of(gpu))]
        self._add(label, kind, nbytes, res, math.inf, prio, on_done, gpu, "d2h")

    def p2p(self, src: int, dst: int, label: str, nbytes: float, on_done: Callable[[float], None]) -> None:
        res = [("d2h", src), ("h2d", dst)]
        gs, gd = self.hw.group_of(src), self.hw.group_of(dst)
        if gs != gd:
            res += [("rc_d2h", gs), ("rc_h2d", gd)]
        self._add(label, "act", nbytes, res, self.hw.p2p_rate(src, dst), (0,), on_done, src, "p2p")

    def _add(self, label: str, kind: str, nbytes: float, res: list, cap: float, prio: tuple,
             on_done: Callable[[float], None], gpu: int, track: str) -> None:
        if self.hw.bidir_Bps:
            res = res + [("bidir", gpu)]
        if nbytes <= 0:
            on_done(self.clock.t)
            return
        self.changed = True
        self.flows.append(Flow(label, kind, float(nbytes), tuple(res), cap,
                               prio if self.sharing == "priority" else (0,), on_done, gpu, track, self.clock.t))

    # ---- sharing -------------------------------------------------------------------------------
    def _capacities(self) -> dict:
        """Each link's capacity now; a root complex's may depend on how many streams share it."""
        hw = self.hw
        if not (hw.rc_h2d_by_streams or hw.rc_d2h_by_streams):  # then set once (read only: allocate fills a copy)
            return self.caps
        cap = dict(self.caps)
        users: dict = {}
        for f in self.flows:
            for r in f.resources:
                users[r] = users.get(r, 0) + 1
        for k in range(len(hw.groups)):
            cap[("rc_h2d", k)] = hw.rc_rate(k, "h2d", users.get(("rc_h2d", k), 1))
            cap[("rc_d2h", k)] = hw.rc_rate(k, "d2h", users.get(("rc_d2h", k), 1))
        return cap

    def allocate(self) -> None:
        """Strict priority between classes, max-min fair inside a class (progressive filling). The
        rates depend on the flows in flight only: they are set again when one starts or ends."""
        if not self.changed:
            return
        self.changed = False
        capacity = self._capacities()
        remaining = dict(capacity)
        for f in self.flows:
            f.rate = 0.0
        for _, same in itertools.groupby(sorted(self.flows, key=_priority), key=_priority):
            _fill(list(same), remaining, capacity)
        for f in self.flows:
            f.base = f.rate

    # ---- time ----------------------------------------------------------------------------------
    def ends(self) -> list[float]:
        """When each flow that moves ends at its rate."""
        t = self.clock.t
        return [t + f.remaining() / f.rate for f in self.flows if f.rate > 0]

    def advance(self, dt: float, t_next: float) -> None:
        """``dt`` seconds of every flow, to ``t_next``: a flow is done up to a byte's fraction or what moves in a
        time too short to move the clock on from ``t_next`` (a fast link's last bytes)."""
        short = max(EPS_T, 4 * math.ulp(t_next))
        for f in self.flows:
            f.done = min(f.total, f.done + f.rate * dt)
            if f.total - f.done < max(EPS_BYTES, f.rate * short):
                f.done = f.total

    def complete(self, finished: Callable[[Flow], None]) -> None:
        """End the flows that are done: each leaves, ``finished`` counts it, then what follows it starts."""
        for f in [f for f in self.flows if f.done == f.total]:  # (advance marks the flows due now done)
            self.flows.remove(f)
            self.changed = True
            finished(f)
            f.on_done(self.clock.t)


def _priority(f: Flow) -> tuple:
    return f.prio


def _fill(flows: list[Flow], remaining: dict, capacity: dict) -> None:
    """Max-min fair rates for ``flows`` within ``remaining`` capacity (reduced in place)."""
    if len(flows) == 1 and flows[0].distinct:  # one round of the loop below
        f = flows[0]
        step = max(min([remaining[r] for r in f.resources] + [f.cap - f.rate]), 0.0)
        f.rate += step
        for r in f.resources:
            remaining[r] -= step
        return
    free = list(flows)
    while free:
        users: dict = {}
        for f in free:
            for r in f.resources:
                users[r] = users.get(r, 0) + 1
        step = min([remaining[r] / n for r, n in users.items()] + [f.cap - f.rate for f in free])
        step = max(step, 0.0)
        for f in free:
            f.rate += step
            for r in f.resources:
                remaining[r] -= step
        saturated = {r for r in users if remaining[r] <= 1e-9 * capacity[r]}
        free = [f for f in free if (f.cap == math.inf or f.cap - f.rate > 1e-9 * f.cap)
                and not any(r in saturated for r in f.resources)]
