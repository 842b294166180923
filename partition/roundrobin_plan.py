"""The round-robin schedule family (RoundPipe's class): its memory model, its simulation and its cuts.

:mod:`partition.schedule.roundrobin_actions` builds the action lists; :func:`simulate_round_robin` runs them
through the pipeline's simulator (:mod:`partition.simulate`, the same engines, links, root complexes
and CPU update model) over several consecutive steps, so that with ``train.update: delayed`` the
next step's rounds fill the GPUs while the last one drains. :func:`search_cuts` chooses the two
partitions: for each split of the units into forward, fused and backward parts and each target op
time, the fewest-ops minimax cuts (exact, by dynamic programming) that fit the GPUs, judged by the
simulator; from the best it climbs to one forward or backward op more or fewer while that is faster.
Pure numbers: no torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import ClassVar

from partition.costs import MOMENT_BYTES, ModelProfile, StageCost, moment_savings, stage_cost, states_advice
from partition.evaluate import GB, stage_exprs
from partition.hardware import Hardware
from partition.request import update_name
from partition.schedule import PipelineOptions
from partition.schedule.pipeline import Kind
from partition.schedule.roundrobin_actions import Cuts, build_round_robin
from partition.sim.event_loop import run_schedule
from partition.sim.flows import Sharing
from partition.sim.result import SimResult
from partition.simulate import with_spread

log = logging.getLogger(__name__)

STEPS = 4  # steps simulated at once: the last one's period is the steady state


def op_costs(profile: ModelProfile, cuts: Cuts) -> list[StageCost]:
    """One :class:`StageCost` per op of a round, in the order the round runs them."""
    return [stage_cost(profile, *cuts.units(k)) for k in range(cuts.num_ops)]


def op_need_gb(sc: StageCost, kind: Kind, workers: int, half: bool) -> tuple[float, float, float]:
    """(what op ``sc`` needs on its GPU while it computes, the weights it holds while it waits in the second
    slot, the gradients it holds while they download after it computed), in GB. A forward holds its
    parameters and passes one micro-batch at a time (the input received and the output sent, both
    double-buffered); the fused op and a backward hold their slot (parameters, gradient sums), the autograd
    state of one micro-batch and its gradients in and out; a backward also holds its round's ``workers``
    reloaded inputs."""
    st = stage_exprs(sc, half)
    if kind == Kind.FORWARD:
        return st.pbytes + 2 * (st.in_b + st.out_b) + st.work, st.pbytes, 0.0
    need = st.slot + st.saved + st.work + 3 * st.in_b
    if kind == Kind.BACKWARD:
        need += workers * st.in_b
    return need, st.pbytes, st.slot - st.pbytes


def round_robin_peaks(profile: ModelProfile, cuts: Cuts, workers: int, num_slots: int) -> float:
    """The largest GPU memory (GB) any worker needs: an op computing beside, in the second slot, the weights
    of the op its worker runs next (``workers`` ops later in the rotation), or beside the gradients of the op
    it ran before while they download."""
    half = profile.precision != "fp32"
    K = cuts.num_ops
    needs = [op_need_gb(c, cuts.kind(k), workers, half) for k, c in enumerate(op_costs(profile, cuts))]
    if num_slots < 2 or K < 2:
        return max(n for n, _, _ in needs)
    return max(n + max(needs[(k + workers) % K][1], needs[(k - workers) % K][2]) for k, (n, _, _) in enumerate(needs))


def simulate_round_robin(profile: ModelProfile, cuts: Cuts, hardware: Hardware, worker_gpus: list[int] | None = None,
                         micro_batches: int = 4, options: PipelineOptions = PipelineOptions(),
                         sharing: Sharing = "priority", record: bool = True, steps: int = STEPS,
                         draw: int = -1) -> SimResult:
    """Simulate ``steps`` consecutive round-robin steps (one program: with a delayed update they overlap);
    report the last one's period, its bytes (every step moves the same) and every GPU's memory peak."""
    worker_gpus = list(range(hardware.num_gpus)) if worker_gpus is None else list(worker_gpus)
    tied = profile.tied_params > 0
    sched = build_round_robin(cuts, len(worker_gpus), micro_batches, steps, options, tied)
    res = run_schedule(profile, op_costs(profile, cuts), hardware, worker_gpus, sched, sharing, record, draw, steps)
    peak = int(round_robin_peaks(profile, cuts, len(worker_gpus), options.num_slots) * GB)
    res.peak_bytes = [peak if g in worker_gpus else 0 for g in range(hardware.num_gpus)]
    return res


def round_robin_host_bytes(profile: ModelProfile, cuts: Cuts, micro_batches: int, delayed: bool,
                           workers: int = 1, states: str = "fp32") -> int:
    """Host memory the round-robin runtime takes: in the shared stores, per trainable parameter the fp32 master
    and AdamW moments (12 with fp32 moments; ``states``: :data:`partition.costs.MOMENT_BYTES`) and one fp32 gradient
    sum per compute copy (4 each); every parameter once per compute
    copy in the training dtype (delayed: two copies of both, alternating by step); and the stash of every
    micro-batch's input of each unit where a backward op starts (delayed: one per step of two, alternating, as a
    step's forwards may overtake the backwards of the step before). With more than two rounds each of the
    ``workers`` also has a staging buffer that a middle round's gradient sums of its largest op come down into
    (fp32)."""
    copies = 2 if delayed else 1
    trainable = sum(u.trainable_count for u in profile.units)
    kept = sum(profile.units[c].in_bytes for c in cuts.backward[1:-1]) * micro_batches
    staging = 0
    if micro_batches > 2 * workers:  # more than two rounds
        staging = workers * 4 * max(stage_cost(profile, *cuts.units(k)).trainable_count for k in range(cuts.num_ops))
    return round(trainable * (12 - moment_savings(states) + 4 * copies) + profile.param_bytes() * copies
                 + kept * copies + staging)


def minimax_cuts(times: list[float], parts: int) -> tuple[int, ...]:
    """Boundaries ``[0, .., len(times)]`` cutting ``times`` into ``parts`` contiguous non-empty parts whose
    largest sum is the smallest possible (exact: dynamic programming over prefix sums)."""
    n = len(times)
    assert 1 <= parts <= n, (parts, n)
    pre = [0.0]
    for t in times:
        pre.append(pre[-1] + t)
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]  # best[p][i]: first i items in p parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for p in range(1, parts + 1):
        for i in range(p, n - parts + p + 1):
            for j in range(p - 1, i):
                v = max(best[p - 1][j], pre[i] - pre[j])
                if v < best[p][i] - 1e-15:
                    best[p][i], cut[p][i] = v, j
    bounds = [n]
    for p in range(parts, 0, -1):
        bounds.append(cut[p][bounds[-1]])
    return tuple(reversed(bounds))


def parts_for(times: list[float], target: float) -> int:
    """The fewest contiguous parts of ``times`` none of which exceeds ``target`` (greedy packing is exact),
    at least one; a single item above ``target`` takes a part of its own."""
    parts, acc = 1, 0.0
    for t in times:
        if acc and acc + t > target:
            parts, acc = parts + 1, 0.0
        acc += t
    return parts


@dataclass
class RoundRobinChoice:
    """The cuts :func:`search_cuts` chose, their simulated step, and what it compared."""

    cuts: Cuts
    result: SimResult
    tried: int
    search_s: float
    rejected: list[str] = field(default_factory=list)  # candidates over the memory budget, why


CutShape = tuple[int, int, int]  # (the fused stage's first unit, forward ops, backward ops)


def _times(profile: ModelProfile, c: int) -> tuple[list[float], list[float]]:
    """Per unit below the fused stage at ``c``: its forward, and its recompute + backward (with the fp32 sums)."""
    return [u.fwd_s for u in profile.units[:c]], [u.bwd_s + u.acc_s for u in profile.units[:c]]


def candidate_shapes(profile: ModelProfile, fused_choices: int = 2) -> list[CutShape]:
    """Shapes to compare: for the fused stage from the head alone up to ``fused_choices`` units, and for target
    op times around the fused op's, the fewest forward and backward ops under the target."""
    U, out = profile.num_units, []
    for c in range(U - 1, max(U - 1 - fused_choices, 0), -1):
        head = stage_cost(profile, c, U)
        fwd, bwd = _times(profile, c)
        fused = head.bwd_s + head.acc_s
        targets = {fused * x / 10 for x in range(5, 21)} | {max(bwd) * k for k in range(1, 7)}
        out += sorted({(c, min(parts_for(fwd, t), c), min(parts_for(bwd, t), c)) for t in targets})
    return list(dict.fromkeys(out))


def shape_cuts(profile: ModelProfile, shape: CutShape) -> Cuts:
    """The minimax cuts of a shape (each part's time as even as it can be)."""
    c, F, B = shape
    fwd, bwd = _times(profile, c)
    return Cuts(minimax_cuts(fwd, F), minimax_cuts(bwd, B), profile.num_units)


def neighbours(shape: CutShape) -> list[CutShape]:
    """One forward or one backward op more or fewer."""
    c, F, B = shape
    return [(c, f, b) for f, b in ((F - 1, B), (F + 1, B), (F, B - 1), (F, B + 1)) if 1 <= f <= c and 1 <= b <= c]


def search_cuts(profile: ModelProfile, hardware: Hardware, worker_gpus: list[int], micro_batches: int,
                options: PipelineOptions, budget_gb: float, sharing: Sharing = "priority",
                climbs: int = 8) -> RoundRobinChoice:
    """The cuts of the candidate shapes (:func:`candidate_shapes`) that fit ``budget_gb`` per GPU, each simulated,
    then up to ``climbs`` moves from the fastest to a faster neighbouring shape (:func:`neighbours`); the fastest
    predicted step wins (ties: fewer ops). Raises ``ValueError`` when none fits."""
    t0 = time.perf_counter()
    seen: dict[CutShape, tuple[float, int] | None] = {}
    results: dict[CutShape, tuple[Cuts, SimResult]] = {}
    rejected: list[str] = []

    def judge(shape: CutShape) -> tuple[float, int] | None:
        if shape not in seen:
            cuts = shape_cuts(profile, shape)
            need = round_robin_peaks(profile, cuts, len(worker_gpus), options.num_slots)
            if need > budget_gb:
                rejected.append(f"{cuts.num_forward}+1+{cuts.num_backward} ops need {need:.1f} GB")
                seen[shape] = None
            else:
                res = simulate_round_robin(profile, cuts, hardware, worker_gpus, micro_batches, options, sharing,
                                           record=False)
                seen[shape], results[shape] = (res.step_s, cuts.num_ops), (cuts, res)
        return seen[shape]

    def fastest(shapes: list[CutShape]) -> CutShape | None:
        judged = [(key, sh) for sh in shapes if (key := judge(sh)) is not None]
        return min(judged)[1] if judged else None

    best = fastest(candidate_shapes(profile))
    if best is None:
        raise ValueError(f"no round-robin cuts fit {budget_gb:.1f} GB per GPU ({'; '.join(rejected[:3])})")
    for _ in range(climbs):
        step = fastest(neighbours(best))
        if step is None or seen[step] >= seen[best]:
            break
        best = step
    log.debug("round-robin cuts: %d simulated in %.1f s", len(results), time.perf_counter() - t0)
    return RoundRobinChoice(*results[best], len(results), time.perf_counter() - t0, rejected)


@dataclass
class RoundRobinPlan:
    """The round-robin family's plan of a run, the one ``scheduler/roundrobin_engine.py`` runs: its cuts on the GPUs
    of the swapped pipeline's plan it was made beside, its runtime settings, and its simulated step under the run's
    update rule and under the other one (the same cuts)."""

    schedule: ClassVar[str] = "round_robin"  # (parallel.schedule's name of it)
    cuts: Cuts
    worker_gpus: list[int]
    micro_batches: int
    options: PipelineOptions  # round_robin_options: the barrier, the update rule (delayed) and the optimizer states
    predicted_step_s: float  # simulated steady-state step under the run's rule
    other_step_s: float  # the same cuts under the other rule
    first_step_s: float  # the first step from empty GPUs (the period before the steady state)
    tokens_per_step: int
    peak_bytes: int
    host_bytes: int  # the shared host stores (round_robin_host_bytes)
    time_split: dict[str, float]  # SimResult.time_split of the predicted step
    traffic_bytes: float
    tried: int
    search_s: float

    def tokens_per_s(self, step_s: float | None = None) -> float:
        return self.tokens_per_step / (step_s if step_s is not None else self.predicted_step_s)

    def replay(self, profile: ModelProfile, hardware: Hardware) -> SimResult:
        """The plan's step simulated again with ``profile``'s unit times on ``hardware`` (the plan's own: its
        prediction), with ``profile``'s spreads drawn (:func:`with_spread`)."""
        def sim(record: bool = True, steps: int = STEPS, draw: int = -1) -> SimResult:
            return simulate_round_robin(profile, self.cuts, hardware, self.worker_gpus, self.micro_batches,
                                        self.options, record=record, steps=steps, draw=draw)
        return with_spread(sim(), profile, lambda steps, draw: sim(False, steps, draw))

    def to_json(self) -> dict:
        """Its cuts and predictions, each rule's under its name (``sync_step_s`` or ``delayed_step_s`` for the
        other one); its GPUs, micro-batches and settings are those of the swapped plan it was made beside."""
        other = update_name(not self.options.delayed)
        return {**self.cuts.to_json(), "update": update_name(self.options.delayed), "step_s": self.predicted_step_s,
                f"{other}_step_s": self.other_step_s, "first_step_s": self.first_step_s,
                "tokens_per_s": self.tokens_per_s(), "host_bytes": self.host_bytes, "time_split": self.time_split,
                f"{other}_tokens_per_s": self.tokens_per_s(self.other_step_s), "peak_bytes": self.peak_bytes,
                "traffic_bytes": self.traffic_bytes, "cuts_simulated": self.tried, "search_s": self.search_s}

    @classmethod
    def from_json(cls, data: dict, worker_gpus: list[int], micro_batches: int, tokens_per_step: int,
                  options: PipelineOptions) -> "RoundRobinPlan":
        """The plan :meth:`to_json` wrote, on the GPUs, micro-batches, tokens and settings of the swapped plan it
        was made beside."""
        other = update_name(not options.delayed)
        cuts = Cuts(tuple(data["forward"]), tuple(data["backward"]), data["fused"][1])
        return cls(cuts, list(worker_gpus), micro_batches, options, data["step_s"], data[f"{other}_step_s"],
                   data["first_step_s"], tokens_per_step, data["peak_bytes"], data["host_bytes"],
                   dict(data["time_split"]), data["traffic_bytes"], data["cuts_simulated"], data["search_s"])

    def lines(self, swapped_step_s: float, runs: bool) -> list[str]:
        """What ``mobius plan`` prints of it, beside the swapped pipeline's ``swapped_step_s`` (``runs``: mobius
        train runs it)."""
        c, rule, other = self.cuts, update_name(self.options.delayed), update_name(not self.options.delayed)
        faster = swapped_step_s / self.predicted_step_s
        what = "runs" if runs else "not run: the swapped pipeline is faster predicted"
        return [f"round-robin schedule (RoundPipe's class; {what}): {c.num_forward} forward + 1 "
                f"fused + {c.num_backward} backward stages per round, forward cuts {list(c.forward)}, fused units "
                f"[{c.fused_from}, {c.num_units}), backward cuts {list(c.backward)}",
                f"  predicted {self.predicted_step_s:.3f} s per step = {self.tokens_per_s():,.0f} tokens/s with update "
                f"{rule} ({faster:.2f}x the swapped pipeline's {swapped_step_s:.3f} s), "
                f"{self.other_step_s:.3f} s = {self.tokens_per_s(self.other_step_s):,.0f} tokens/s with {other}; "
                f"first step from empty GPUs {self.first_step_s:.3f} s; peak {self.peak_bytes / 2**30:.1f} GiB per "
                f"GPU, {self.host_bytes / 2**30:.1f} GiB of host memory (shared by the workers), "
                f"{self.traffic_bytes / 1e9:.1f} GB moved per step; {self.tried} cuts simulated in "
                f"{self.search_s:.1f} s"]


def round_robin_options(options: PipelineOptions) -> PipelineOptions:
    """What of the swapped pipeline's ``options`` the round-robin schedule runs with: the barrier, the update rule
    and the optimizer states (two device slots; the gradient sums come down in fp32, as the runtime keeps them)."""
    return PipelineOptions(barrier=options.barrier, delayed=options.delayed, states=options.states)


def plan_round_robin(profile: ModelProfile, hardware: Hardware, worker_gpus: list[int], micro_batches: int,
                     options: PipelineOptions, budget_bytes: float, sharing: Sharing = "priority") -> RoundRobinPlan:
    """Search the cuts for the run's update rule (``options.delayed``) and simulate them under both rules, with
    :func:`round_robin_options` of the swapped pipeline's ``options``."""
    options = round_robin_options(options)
    choice = search_cuts(profile, hardware, worker_gpus, micro_batches, options, budget_bytes / GB, sharing)
    need = {r: round_robin_host_bytes(profile, choice.cuts, micro_batches, options.delayed, len(worker_gpus), r)
            for r in MOMENT_BYTES}
    host = need[options.states]
    if hardware.host_memory_bytes and host > hardware.host_memory_bytes:
        raise ValueError(f"its shared host stores need {host / 2**30:.1f} GiB of host memory with "
                         f"train.optimizer_states={options.states}, {hardware.host_memory_bytes / 2**30:.1f} GiB is "
                         f"available" + states_advice(need, options.states, hardware.host_memory_bytes))

    recorded = with_spread(  # with the spreads the runs on the machine measured (ModelProfile.worker_spread, ...)
        simulate_round_robin(profile, choice.cuts, hardware, worker_gpus, micro_batches, options, sharing), profile,
        lambda steps, draw: simulate_round_robin(profile, choice.cuts, hardware, worker_gpus, micro_batches, options,
                                                 sharing, record=False, steps=steps, draw=draw))
    flipped = dataclasses.replace(options, delayed=not options.delayed)
    other = simulate_round_robin(profile, choice.cuts, hardware, worker_gpus, micro_batches, flipped, sharing,
                                 record=False)
    res = choice.result
    return RoundRobinPlan(choice.cuts, list(worker_gpus), micro_batches, options, recorded.step_s,
                          other.step_s + recorded.spread_s, res.step_ends[0],
                          micro_batches * profile.micro_batch_size * profile.seq_len, max(res.peak_bytes), host,
                          recorded.time_split(), res.total_bytes(), choice.tried + 1, choice.search_s)
