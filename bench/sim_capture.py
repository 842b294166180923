"""Every simulation a broad set of plans and cases runs, captured, so that a change to the pipeline's simulator
can be checked to give the same results to the bit.

``record DIR`` runs the cases below with a hook on the simulator's entry and keeps, per distinct simulation, its
inputs (the profile, the op costs, the machine, the workers' GPUs, the schedule, the sharing, ``record``, the draw
and the steps; pickled, each part once) and its outcome: the :class:`~partition.simulate.SimResult` as given, and
again with ``record=True`` (every action's span and bytes), as exact JSON. ``check DIR`` runs the kept inputs
through the simulator as it is now and says which outcomes differ (floats compared exactly).

The cases: the swapped pipeline and the round-robin schedule, sync and delayed, with and without a barrier, one
slot (with and without a partial prefetch) or two, resident, kept and offloaded stages, half-precision downloads,
priority and fair sharing, tied weights, drawn speeds, CPU workers; on synthetic boxes and on the topology
fixtures (with their bandwidth files); then every plan ``mobius plan configs/*.yaml --topology
tests/fixtures/topology/topo2x2_sys.txt --json`` makes (sync and delayed, the schedule ``auto``), and
``bench/roundrobin_bench.py``'s 8 x RTX 4090 plans.

    python bench/sim_capture.py record /tmp/simcap          # before the change (about 10 min on 2 cores)
    python bench/sim_capture.py check /tmp/simcap           # after it
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

log = logging.getLogger("sim_capture")
GiB = 1 << 30
TOPOLOGY = ROOT / "tests/fixtures/topology"


# ---- the simulator's entry ------------------------------------------------------------------------------------------
def run_inputs(inputs: tuple) -> Any:
    """One simulation of ``inputs`` (profile, costs, hardware, worker_gpus, sched, sharing, record, draw, steps)."""
    from partition.sim.event_loop import run_schedule

    return run_schedule(*inputs)


@contextlib.contextmanager
def hooked(seen: Callable[[tuple, Any], None]) -> Iterator[None]:
    """While open, every simulation's inputs and result go to ``seen`` (the inputs pickled before it runs)."""
    import partition.roundrobin_plan
    import partition.simulate

    modules = (partition.simulate, partition.roundrobin_plan)
    real = partition.simulate.run_schedule

    def run(profile, costs, hw, gpus, sched, sharing, record, draw, steps):
        inputs = pickle.loads(pickle.dumps((profile, costs, hw, list(gpus), sched, sharing, record, draw, steps)))
        res = real(profile, costs, hw, gpus, sched, sharing, record, draw, steps)
        seen(inputs, res)
        return res

    for m in modules:
        m.run_schedule = run
    try:
        yield
    finally:
        for m in modules:
            m.run_schedule = real


def outcome(res: Any) -> str:
    """A result as exact JSON (floats by repr, which round-trips)."""
    return json.dumps(dataclasses.asdict(res), sort_keys=True)


# ---- the store ------------------------------------------------------------------------------------------------------
class Store:
    """Distinct simulations: inputs as keys of pickled parts (each part kept once), outcomes beside them."""

    def __init__(self) -> None:
        self.parts: dict[str, bytes] = {}
        self.cases: list[dict] = []
        self.keys: set[str] = set()
        self.runs = 0

    def add(self, inputs: tuple, res: Any) -> None:
        self.runs += 1
        refs = []
        for part in inputs:
            blob = pickle.dumps(part)
            key = hashlib.sha1(blob).hexdigest()
            self.parts.setdefault(key, blob)
            refs.append(key)
        key = hashlib.sha1("".join(refs).encode()).hexdigest()
        if key in self.keys:
            return
        self.keys.add(key)
        self.cases.append({"key": key, "parts": refs, "given": outcome(res)})

    def inputs(self, case: dict) -> tuple:
        return tuple(pickle.loads(self.parts[k]) for k in case["parts"])

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "parts.pkl", "wb") as f:
            pickle.dump(self.parts, f)
        with open(out / "cases.json", "w") as f:
            json.dump(self.cases, f)

    @classmethod
    def load(cls, out: Path) -> "Store":
        s = cls()
        s.parts = pickle.loads((out / "parts.pkl").read_bytes())
        s.cases = json.loads((out / "cases.json").read_text())
        return s


def recorded(inputs: tuple) -> str:
    """The simulation again with every span recorded."""
    return outcome(run_inputs((*inputs[:6], True, *inputs[7:])))


# ---- the cases ------------------------------------------------------------------------------------------------------
def _machines() -> list[tuple[str, Any]]:
    import topology
    from partition import Hardware

    out: list[tuple[str, Any]] = [
        ("separate2", Hardware.uniform(2, 8 * GiB, 10e9, groups=[[0], [1]])),
        ("separate4", Hardware.uniform(4, 8 * GiB, 10e9, groups=[[0], [1], [2], [3]], cpu_adam_params_per_s=2e9)),
        ("shared4", Hardware.uniform(4, 8 * GiB, 10e9, groups=[[0, 1, 2, 3]], uplink_Bps=14e9,
                                     host_adam_params_per_s=3e9)),
        ("p2p2", Hardware.uniform(2, 8 * GiB, 10e9, p2p_Bps=20e9)),
        ("paper", Hardware.paper_3090ti()),
    ]
    falling = Hardware.uniform(4, 8 * GiB, 10e9, groups=[[0, 1], [2, 3]])
    falling.rc_h2d_by_streams = [[10e9, 8e9, 7e9, 6e9]] * 2
    falling.rc_d2h_by_streams = [[10e9, 8e9, 7e9, 6e9]] * 2
    out.append(("falling", falling))
    bidir = Hardware.uniform(2, 8 * GiB, 10e9)
    bidir.bidir_Bps = [15e9, 15e9]
    out.append(("bidir", bidir))
    asym = Hardware.uniform(2, 8 * GiB, 10e9, cpu_adam_params_per_s=1e9)
    asym.d2h_Bps, asym.rc_d2h_Bps = [4e9, 4e9], [4e9, 4e9]
    asym.cpu_adam_half_grads_params_per_s = 1.5e9
    out.append(("asymmetric", asym))
    for cores, threads in ((1, 1), (2, 2), (64, 2)):
        cpu = dataclasses.replace(Hardware.uniform(2, 8 * GiB, 8e9, host_adam_params_per_s=1.5e9),
                                  host_cores=cores, worker_threads=threads, message_s=1e-4)
        out.append((f"cpu{cores}x{threads}", cpu))
    bench = {"topo2x2_sys.txt": "bench_4gpu_2x2.json"}
    for path in sorted(TOPOLOGY.glob("*.txt")):
        try:
            topo = topology.load_topology(str(path))
            out.append((path.stem, Hardware.from_topology(topo, gpu="rtx3090")))
            if path.name in bench:
                bw = topology.load_bandwidth(str(TOPOLOGY / bench[path.name])) \
                    if hasattr(topology, "load_bandwidth") else json.loads((TOPOLOGY / bench[path.name]).read_text())
                out.append((path.stem + "+bench", Hardware.from_topology(topo, bw, gpu="rtx3090")))
        except Exception as e:  # a fixture that is not a topology of GPUs (a malformed one, on purpose)
            log.info("topology %s left out: %s", path.name, e)
    return out


def _profiles() -> list[tuple[str, Any]]:
    from fixtures.partition.profiles import hand_profile, random_profile, toy_profile

    out = [("toy14", toy_profile(blocks=14)), ("toy6act", toy_profile(blocks=6, act_bytes=20e6))]
    tied = toy_profile(blocks=8)
    tied.tied_params = tied.units[-1].param_count
    out.append(("toy8tied", tied))
    for seed in range(4):
        p = random_profile(random.Random(seed), 10, identical=seed % 2 == 0)
        if seed == 1:
            p.tied_params = p.units[-1].param_count
        if seed == 2:
            p.worker_spread, p.compute_spread, p.action_s = 0.05, 0.08, 2e-4
        out.append((f"random{seed}", p))
    out.append(("hand", hand_profile()))
    return out


def _options(stage_count: int, rng: random.Random) -> list[Any]:
    from partition import PipelineOptions

    S = stage_count
    last = frozenset({S - 1, S - 2}) if S > 3 else frozenset()
    mid = frozenset({1}) if S > 2 else frozenset()
    return [PipelineOptions(), PipelineOptions(barrier=True), PipelineOptions(delayed=True),
            PipelineOptions(barrier=True, delayed=True), PipelineOptions(num_slots=1),
            PipelineOptions(num_slots=1, prefetch_bytes=int(rng.uniform(20e6, 120e6))),
            PipelineOptions(num_slots=1, prefetch_bytes=int(rng.uniform(20e6, 120e6)), delayed=True),
            PipelineOptions(offload_inputs=True), PipelineOptions(offload_inputs=True, barrier=True),
            PipelineOptions(resident=last), PipelineOptions(resident=last, delayed=True, barrier=True),
            PipelineOptions(kept=mid), PipelineOptions(kept=mid, num_slots=1, delayed=True),
            PipelineOptions(grad_dtype="half"), PipelineOptions(grad_dtype="half", delayed=True, resident=last)]


def _bounds(units: int, S: int) -> list[int]:
    """``S`` contiguous stages over ``units`` units, as even as they go."""
    return [round(i * units / S) for i in range(S + 1)]


def _tried(run: Callable[[], Any]) -> int:
    """1 when ``run()`` simulated, 0 when its settings are refused (a tied end made resident, ...)."""
    from mobius.errors import MobiusError

    try:
        run()
        return 1
    except MobiusError as e:
        log.info("left out: %s", e)
        return 0


def direct_cases(limit: int) -> None:
    """The swapped pipeline and the round-robin over the profiles, machines and options above (a seeded sample)."""
    from partition import simulate
    from partition.plan import with_spread
    from partition.roundrobin_plan import simulate_round_robin
    from partition.schedule.roundrobin_actions import Cuts

    rng = random.Random(66)
    machines, profiles = _machines(), _profiles()
    done = 0
    for pname, prof in profiles:
        for mname, hw in machines:
            N = hw.num_gpus
            if pname == "hand" and N > 2:
                continue
            U = prof.num_units
            stage_counts = sorted({min(U, N), min(U, 2 * N), min(U, N + 1)} - {0})
            for S in stage_counts:
                bounds = _bounds(U, S)
                opts = _options(S, rng)
                for options in rng.sample(opts, min(len(opts), 4)) + [opts[0]]:
                    sharing = rng.choice(["priority", "priority", "fair"])
                    steps = rng.choice([3, 3, 4])
                    done += _tried(lambda: simulate(prof, bounds, hw, None, rng.choice([2, 4]), options, sharing,
                                                    steps=steps))
                if prof.worker_spread or prof.compute_spread:
                    nominal = simulate(prof, bounds, hw, None, 4, opts[0], record=False)
                    with_spread(nominal, prof, lambda steps, draw: simulate(prof, bounds, hw, None, 4, opts[0],
                                                                            record=False, steps=steps, draw=draw))
            gpus = list(range(N))
            for M in sorted({N, 2 * N, 4 * N if N < 4 else 3 * N}):
                fwd = tuple(_bounds(U - 1, min(3, U - 1)))  # both end where the fused op (the head) begins
                bwd = tuple(_bounds(U - 1, min(4, U - 1)))
                try:
                    cuts = Cuts(fwd, bwd, U)
                except Exception as e:
                    log.info("cuts %s %s left out: %s", fwd, bwd, e)
                    continue
                from partition import PipelineOptions
                for options in (PipelineOptions(), PipelineOptions(barrier=True), PipelineOptions(delayed=True),
                                PipelineOptions(barrier=True, delayed=True), PipelineOptions(grad_dtype="half")):
                    if rng.random() < 0.5:
                        continue
                    done += _tried(lambda: simulate_round_robin(prof, cuts, hw, gpus, M, options,
                                                                rng.choice(["priority", "fair"])))
                if prof.worker_spread:
                    simulate_round_robin(prof, cuts, hw, gpus, M, PipelineOptions(), record=False, steps=10, draw=0)
            if done >= limit:
                return


def plan_cases(configs: list[Path], variants: list[list[str]]) -> None:
    """Every plan ``mobius plan CONFIG --topology topo2x2_sys.txt --json`` makes, under each variant's overrides."""
    from mobius.cli import main

    with tempfile.TemporaryDirectory() as cache:
        for cfg in configs:
            for extra in variants:
                argv = ["plan", str(cfg), "--topology", str(TOPOLOGY / "topo2x2_sys.txt"), "--json",
                        "--partition.reuse_plan=false", f"--partition.cache_dir={cache}", *extra]
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    rc = main(argv)
                    if rc == 2:  # a config that names no GPU model the topology's names do not give either
                        rc = main([*argv, "--partition.gpu=rtx3090"])
                log.info("%s %s: rc %s, %.1f s", cfg.name, " ".join(extra), rc, time.perf_counter() - t0)


def roundrobin_bench_cases(models: list[str], clips: list[float], deep: bool) -> None:
    """``bench/roundrobin_bench.py``'s plans of 8 x RTX 4090 (``deep``: its ablations and like-for-like cuts too)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import roundrobin_bench as rb

    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            path = rb.write_profile(model, Path(tmp))
            for clip in clips:
                t0 = time.perf_counter()
                rb.EXTRA[:] = [f"--partition.cache_dir={tmp}", "--partition.reuse_plan=false"]
                plan, prof, hw = rb._plan(model, clip, path)
                if deep and clip == 0 and plan.round_robin is not None:
                    rb._ablations(prof, hw, plan)
                    rb._like_for_like(model, prof, hw, plan)
                log.info("roundrobin_bench %s clip %s: %.1f s", model, clip, time.perf_counter() - t0)


# ---- the commands ---------------------------------------------------------------------------------------------------
def record(out: Path, quick: bool) -> None:
    store = Store()
    t0 = time.perf_counter()
    with hooked(store.add):
        direct_cases(60 if quick else 10**9)
        log.info("direct: %d simulations (%d distinct), %.0f s", store.runs, len(store.cases), time.perf_counter() - t0)
        configs = sorted((ROOT / "configs").glob("*.yaml"))
        variants = [[]] if quick else [[], ["--train.update=delayed"], ["--parallel.schedule=auto"],
                                       ["--parallel.schedule=auto", "--train.update=delayed", "--train.grad_clip=1.0"]]
        plan_cases(configs[:2] if quick else configs, variants)
        log.info("plans: %d simulations (%d distinct), %.0f s", store.runs, len(store.cases), time.perf_counter() - t0)
        if not quick:
            roundrobin_bench_cases(["llama-3.1-8b", "qwen3-1.7b", "qwen3-32b"], [0.0, 1.0], deep=False)
            roundrobin_bench_cases(["qwen3-1.7b"], [0.0], deep=True)
        log.info("all: %d simulations (%d distinct), %.0f s", store.runs, len(store.cases), time.perf_counter() - t0)
    for i, case in enumerate(store.cases):  # replayed here too: the capture itself must be deterministic
        inputs = store.inputs(case)
        again = outcome(run_inputs(inputs))
        assert again == case["given"], f"case {i} does not replay the same in one process: not deterministic"
        case["recorded"] = recorded(inputs)
    store.save(out)
    print(f"{len(store.cases)} distinct simulations kept in {out} (of {store.runs} run), "
          f"{time.perf_counter() - t0:.0f} s")


def check(out: Path) -> int:
    store = Store.load(out)
    t0, bad = time.perf_counter(), []
    for i, case in enumerate(store.cases):
        inputs = store.inputs(case)
        if outcome(run_inputs(inputs)) != case["given"] or recorded(inputs) != case["recorded"]:
            bad.append(i)
    print(f"{len(store.cases) - len(bad)} of {len(store.cases)} simulations identical "
          f"({time.perf_counter() - t0:.0f} s)" + (f"; differ: {bad[:20]}" if bad else ""))
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["record", "check"])
    p.add_argument("dir", type=Path)
    p.add_argument("--quick", action="store_true", help="record a small sample (checks the script)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("mobius").setLevel(logging.WARNING)
    logging.getLogger("partition").setLevel(logging.WARNING)
    if args.command == "record":
        record(args.dir, args.quick)
        return 0
    return check(args.dir)


if __name__ == "__main__":
    sys.exit(main())
