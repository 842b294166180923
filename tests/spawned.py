"""Test cases run on ``world`` gloo worker processes in one spawn: process start-up and the process
group are paid once for a whole list of cases (the pipeline and zero exactness matrices); and what
those matrices share: a case's model and its token batches."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest
import torch

SPAWN_TIMEOUT_S = 600  # a hung worker fails the test instead of the suite
# AdamW's epsilon in the exactness matrices. AdamW moves each element by about lr * g / (|g| + eps), so an element
# whose gradient is near eps moves by lr * delta / 4 for a relative error delta of its gradient. A gradient that
# comes out of a cancellation carries a large one: with packed documents and masked targets one element's gradient
# was -3.4e-9 in float64 and -2.8e-9 in fp32 (20%); two exact engines summing in another order then end 7e-5 apart
# after one step at lr 1e-2. At 1e-6 the same noise moves weights by well under the matrices' 1e-5.
EXACT_EPS = 1e-6

# A bf16 or int8 rule (train.optimizer_states) stores each moment rounded: stochastically, or to the nearest 8-bit
# code. Where two exact engines' gradients differ in their last bits (summation order), an element whose moment lies
# within that difference of the rounding's threshold rounds the other way: in the matrices about 1 element in 5,000
# over 4 steps (a pipeline case: bf16 27 of 148,352, at most 6.3e-5 apart; int8 4, at most 1.4e-4). Such an element
# then moves by up to lr x one step of the moment's precision (bf16 2^-8, int8's float8 codes 2^-3) in each later
# step. A rule applied wrongly (another element's random bits, a block cut elsewhere) moves most elements instead.
# So with those rules every weight is within the matrices' tolerance but at most FLIP_SHARE of them, and those
# within FLIP_STEP[rule] x lr per step.
FLIP_SHARE = 1e-3
FLIP_STEP = {"bf16": 2**-7, "int8": 2**-3}

RunCase = Callable[[dict, int], dict]  # (case, world) -> this rank's result, in a worker


def _worker(rank: int, world: int, port: int, run_case: RunCase, cases: list[dict], results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for k, case in enumerate(cases):
            results.put((k, rank, run_case(case, world)))
    finally:
        dist.destroy_process_group()


def spawn_cases(run_case: RunCase, cases: list[dict], world: int) -> list[list[dict]]:
    """Run every case on ``world`` workers (in order, all ranks together); per case, the ranks'
    results in rank order. ``run_case`` must be a module-level function (the workers import it)."""
    import torch.multiprocessing as mp

    from mobius.app.launch import free_port
    from mobius.app.supervise import PRELOAD

    ctx = mp.get_context("forkserver")  # one server imports torch once; each worker is a fork of it (~2 s saved)
    # the server is this process's one, shared with mobius's own workers: whoever starts it decides what it
    # preloads, so each names what both use
    ctx.set_forkserver_preload([*PRELOAD, "spawned", run_case.__module__])
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_worker, args=(world, free_port(), run_case, cases, results), nprocs=world,
                               join=False, start_method="forkserver")
    got: list[list[dict | None]] = [[None] * world for _ in cases]
    deadline, done = time.monotonic() + SPAWN_TIMEOUT_S, False
    while not done:  # read while the workers run (a full pipe would block them); join raises a worker's error
        if time.monotonic() > deadline:
            for proc in procs.processes:
                proc.kill()
            pytest.fail(f"{world} workers did not finish {len(cases)} cases in {SPAWN_TIMEOUT_S} s")
        done = procs.join(timeout=0.2)
        while not results.empty():
            k, rank, out = results.get()
            got[k][rank] = out
    assert all(r is not None for ranks in got for r in ranks), "a worker ended without its results"
    return got  # type: ignore[return-value]


def case_model(ck: Any, dropout: float | None):
    """The checkpoint's architecture, with the case's dropout when it sets one."""
    from mobius.models.hf import read_config

    mc = read_config(ck)
    if dropout is not None:
        mc.set_dropout(dropout)
    return mc


def exact_config(case: dict, name: str, steps: int, micro: int, train: dict, parallel: dict, out: Any,
                 model: dict | None = None, partition: dict | None = None) -> Any:
    """The exactness matrices' run: ``steps`` steps of ``micro`` micro-batches of 2 x 16 tokens, lr 1e-2 after a
    one-step warm-up, weight decay 0.1, seed 3, the case's checkpoint (``case["ck"]``) and, with
    ``case["lora"]``, rank-4 adapters that train the norms too; ``train`` and ``parallel`` laid over that."""
    from mobius.config import config_from_dict

    raw = {"model": {"checkpoint": str(case["ck"]), **(model or {})},
           "data": {"seq_len": 16},
           "train": {"max_steps": steps, "micro_batch_size": 2, "micro_batches": micro, "lr": 1e-2, "warmup_steps": 1,
                     "weight_decay": 0.1, "seed": 3, "eps": EXACT_EPS, **train},
           "parallel": parallel, "output": {"dir": str(out)}}
    if partition is not None:
        raw["partition"] = partition
    if case["lora"]:
        raw["lora"] = {"rank": 4, "alpha": 8.0, "train": ["norms"]}
    return config_from_dict(raw, name)


def adapted_model(case: dict, cfg: Any) -> Any:
    """The case checkpoint's architecture with the run's adapters."""
    from mobius.assemble import with_adapters

    return with_adapters(case_model(case["ck"], None), cfg)


def token_batches(step: int, count: int, vocab: int) -> list:
    """``count`` micro-batches of 2 x 16 tokens, the same for every engine at ``step``: the even ones packed
    conversations (2-4 documents a row, each with a prompt that is no target: :func:`packed_batch`), the odd
    ones plain text (every token a target). So every case checks documents, masks and that the loss is the mean
    over the step's target tokens (the micro-batches hold different numbers of them)."""
    from mobius.batch import MicroBatch

    g = torch.Generator().manual_seed(1000 + step)
    tokens = [torch.randint(0, vocab, (2, 17), generator=g) for _ in range(count)]
    return [packed_batch(t, g) if m % 2 == 0 else MicroBatch(t[:, :-1], t[:, 1:]) for m, t in enumerate(tokens)]


def packed_batch(tokens: torch.Tensor, g: torch.Generator) -> Any:
    """``tokens`` [B, T + 1] as rows of random documents: lengths [B, D] summing to T, each document's first
    tokens (its prompt, 1 to half of it) and its last position (whose target is the next document's) no target."""
    from mobius.batch import IGNORE, MicroBatch

    B, T = tokens.shape[0], tokens.shape[1] - 1
    targets, rows = tokens[:, 1:].clone(), []
    for b in range(B):
        cuts = sorted(torch.randperm(T - 1, generator=g)[:int(torch.randint(1, 4, (1,), generator=g))] + 1)
        lengths = [e - s for s, e in zip([0, *cuts], [*cuts, T])]
        start = 0
        for n in lengths:
            prompt = int(torch.randint(1, max(2, n // 2 + 1), (1,), generator=g))
            targets[b, start:start + prompt] = IGNORE
            targets[b, start + n - 1] = IGNORE
            start += n
        targets[b, T - 1] = tokens[b, T]  # at least one target per row
        rows.append(lengths)
    docs = torch.zeros(B, max(map(len, rows)), dtype=torch.int32)
    for b, lengths in enumerate(rows):
        docs[b, :len(lengths)] = torch.tensor(lengths, dtype=torch.int32)
    return MicroBatch(tokens[:, :-1], targets, docs)


def train_delayed_case(engine: Any, cfg: Any, steps: int, batches: Any, state_of: Any, overflow_step: int = -1) -> dict:
    """``steps`` training steps of ``engine`` (any mode's) with an evaluation after the second (the compute weights
    set aside and put back) and at the end; at ``overflow_step`` the loss scale overflows, and ``state_of(engine)``
    is kept before and after that step. ``batches(step)`` gives a step's micro-batches, ``batches(step, 2)`` two.
    Each step is handed the next (``upcoming``, as the trainer does: an engine that looks ahead may run it before it
    returns) but before an evaluation, the overflow and the end. Returns the losses, skip flags, evaluations, the
    newest and compute weights, the optimizer step, and the names of the weights a state without the frozen ones
    holds (a LoRA checkpoint's; its tensors, moments and compute weights checked here to equal the whole state's)."""
    from mobius.optim import lr_at

    def upcoming(s: int) -> tuple | None:
        if s + 1 >= steps or s == 1 or overflow_step in (s, s + 1):
            return None
        return batches(s + 1), lr_at(s + 1, cfg.train)

    out: dict = {"losses": [], "skipped": [], "evals": []}
    for s in range(steps):
        if s == overflow_step:
            engine.rule.scaler.scale = 2.0**127
            engine.sync()  # the updates of the step before are done
            out["before"] = state_of(engine)
        stats = engine.train_step(s, batches(s), lr_at(s, cfg.train), upcoming(s))
        if s == overflow_step:
            engine.sync()
            out["after"] = state_of(engine)
            engine.rule.scaler.scale = 2.0**10
        out["losses"].append(stats.loss)
        out["skipped"].append(stats.skipped)
        if s == 1 or s == steps - 1:
            out["evals"].append(engine.evaluate(batches(99, 2)))
    state, trained = engine.rank_state(True), engine.rank_state(True, frozen=False)
    for k, w in trained.weights.items():
        assert torch.equal(w, state.weights[k]), k
    assert trained.moments.keys() == state.moments.keys()
    assert (trained.compute or {}).keys() == (state.compute or {}).keys()
    out.update(weights=state.weights, compute=state.compute or {}, optimizer_step=state.optimizer_step,
               trained=sorted(trained.weights))
    return out


def joined(ranks: list[dict], key: str, where: str, each_once: bool = False) -> dict[str, torch.Tensor]:
    """The ranks' numpy tensors of ``key`` by name, as torch tensors: a name several ranks report (a tied weight's
    two ends) must agree, or (``each_once``) must not happen."""
    got: dict = {}
    for part in ranks:
        for name, w in part[key].items():
            assert name not in got or (not each_once and (got[name] == w).all()), \
                f"{where}: {name} {'on two ranks' if each_once else 'differs between ranks'}"
            got[name] = w
    return {k: torch.from_numpy(v) for k, v in got.items()}


def assert_weights_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float, where: str,
                         states: str = "fp32", lr: float = 1e-2, steps: int = 1) -> None:
    """Every tensor of ``ref`` in ``got`` within ``atol``; with bf16 or int8 moments (``states``) all but a share of
    FLIP_SHARE of their elements, which are within FLIP_STEP x ``lr`` x ``steps`` (see FLIP_SHARE)."""
    if states == "fp32":
        for name, w in ref.items():
            torch.testing.assert_close(got[name], w, rtol=0, atol=atol, msg=f"{where}: {name}")
        return
    apart = {name: (got[name] - w).abs() for name, w in ref.items()}
    beyond = sum(int((d > atol).sum()) for d in apart.values())
    total, worst = sum(w.numel() for w in ref.values()), max(float(d.max()) for d in apart.values())
    assert beyond <= FLIP_SHARE * total, f"{where}: {beyond} of {total} elements beyond {atol} ({states} moments)"
    assert worst <= FLIP_STEP[states] * lr * steps, f"{where}: an element {worst:.3g} apart ({states} moments)"


def check_against_reference(ranks: list[dict], ref: dict, where: str, steps: int, atol: float, update: str,
                            model_cfg: Any, weights: bool = True, each_once: bool = False, behind: bool = True,
                            states: str = "fp32", lr: float = 1e-2) -> None:
    """A case's ranks (:func:`train_delayed_case`'s results) against the reference's on the same batches: the
    optimizer steps, the losses and evaluations within ``atol``; with ``weights`` every weight, and (delayed) the
    compute weights a checkpoint keeps, by canonical name (``behind``: one update behind the newest), as
    :func:`assert_weights_close` holds them with ``states``' moments; and that a state without the frozen weights
    holds exactly the weights that train."""
    from mobius.checkpoint import canonical_name
    from mobius.models.lora import trains

    assert all(r["optimizer_step"] == ref["optimizer_step"] == steps for r in ranks), where
    for key in ("losses", "evals"):
        torch.testing.assert_close(torch.tensor(ranks[0][key]), torch.tensor(ref[key]), rtol=0, atol=atol,
                                   msg=lambda m, key=key: f"{where}: {key}: {m}")
    if not weights:
        return
    got = joined(ranks, "weights", where, each_once)
    assert set(got) == set(ref["weights"]), where
    assert {n for r in ranks for n in r["trained"]} == {n for n in got if trains(model_cfg, n)}, where
    assert_weights_close(got, ref["weights"], atol, where, states, lr, steps)
    compute = {canonical_name(k, model_cfg): v for k, v in joined(ranks, "compute", where, each_once).items()}
    if update == "sync":
        assert not compute and not ref["compute"], where
        return
    assert set(compute) == set(ref["compute"]) and compute, where
    assert_weights_close(compute, ref["compute"], atol, f"{where}: compute", states, lr, steps)
    if behind:
        assert any((compute[n] - got[n]).abs().max() > 1e-4 for n in compute), where  # one update behind


def to_numpy(out: dict) -> dict:
    """:func:`train_delayed_case`'s result with its tensors as numpy arrays (what goes back from a worker): the
    weights, the compute weights, and the per-store (master, compute copy) pairs before and after an overflow."""
    numpy = lambda d: {k: v.numpy().copy() for k, v in d.items()}  # noqa: E731
    out["weights"], out["compute"] = numpy(out["weights"]), numpy(out["compute"])
    for key in ("before", "after"):
        if key in out:
            out[key] = {j: (m.numpy().copy(), c.float().numpy().copy()) for j, (m, c) in out[key].items()}
    return out


def pipeline_plan(cfg: Any, model_cfg: Any) -> tuple[Any, Any]:
    """The swapped pipeline's plan ``mobius train`` makes for a pipeline run on this machine, and the run's parallel
    settings."""
    from mobius.app.planning import plan_pipeline
    from mobius.app.settings import Machine, resolve

    machine = Machine.detect(cfg)
    settings = resolve(cfg, machine)
    return plan_pipeline(cfg, model_cfg, settings, machine)[0].swapped, settings


def round_robin_plan(swapped: Any, forward: tuple[int, ...], backward: tuple[int, ...], units: int) -> Any:
    """A round-robin plan of the given cuts on the GPUs and settings of ``swapped`` (a swapped pipeline's plan), as
    the planner makes one beside it (its predictions left at 0: a runtime test runs it)."""
    from partition.roundrobin_plan import RoundRobinPlan, round_robin_options
    from partition.schedule.roundrobin_actions import Cuts

    return RoundRobinPlan(Cuts(tuple(forward), tuple(backward), units), list(swapped.worker_gpus),
                          swapped.micro_batches, round_robin_options(swapped.options), 0.0, 0.0, 0.0,
                          swapped.tokens_per_step, 0, 0, {}, 0.0, 0, 0.0)


def delayed_run_config(tmp: Any, ck: Any, corpus: Any, out: str, micro_batches: int, mode: dict,
                       **sections: dict) -> Any:
    """A 4-step ``train.update: delayed`` run of ``mobius train`` on CPU workers (evaluations every 2 steps):
    ``mode``'s sections (parallel, zero, ...), then ``sections``, each laid key by key over what is there."""
    from mobius.config import config_from_dict

    raw = {"model": {"checkpoint": str(ck)},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp / "cache")},
           "train": {"max_steps": 4, "micro_batch_size": 2, "micro_batches": micro_batches, "lr": 1e-2,
                     "warmup_steps": 4, "weight_decay": 0.1, "eval_every": 2, "eval_batches": 2, "seed": 3,
                     "update": "delayed"},
           "partition": {"cache_dir": str(tmp / "cache")}, "output": {"dir": str(tmp / out), "plot": False}}
    for layer in (mode, sections):
        for name, values in layer.items():
            raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def resume_from(tmp: Any, run: str, step: int, into: str) -> Any:
    """Copy run ``run``'s checkpoint of ``step`` into the (new) run directory ``into``; returns its path."""
    import shutil
    from pathlib import Path

    name = f"step-{step:06d}"
    (tmp / into / "checkpoints").mkdir(parents=True)
    return Path(shutil.copytree(tmp / run / "checkpoints" / name, tmp / into / "checkpoints" / name))


def resumed_equals_straight(tmp: Any, run_cfg: Callable[..., Any], compute_file: bool = True) -> Any:
    """Run ``first`` (4 delayed steps, a checkpoint every 2), then ``second`` resumed from its step-2 checkpoint:
    the same losses, metrics lines and final weights. ``compute_file``: the checkpoint holds the compute weights
    (every trainable weight once, the tied head under the embedding's name, fp32, one update behind the
    newest). ``run_cfg(tmp, out, **sections)`` makes a run's config; returns ``first``'s result."""
    from safetensors.torch import load_file

    from mobius.app.run import train
    from mobius.checkpoint import COMPUTE_FILE
    from mobius.models.hf import load_checkpoint, read_state_dict

    first = train(run_cfg(tmp, "first", output={"save_every": 2, "keep_last": 1}))
    step2 = resume_from(tmp, "first", 2, "second")
    if compute_file:
        compute, newest = load_file(str(step2 / COMPUTE_FILE)), load_checkpoint(step2).state_dict()
        assert set(compute) == set(newest) - {"head.lm_head.weight"}  # the tied head under the embedding's name
        assert all(v.dtype == torch.float32 for v in compute.values())
        assert any(not torch.equal(v, newest[k]) for k, v in compute.items())  # one update behind
    second = train(run_cfg(tmp, "second"), resume="auto")
    assert second.losses == first.losses
    assert metric_rows(tmp / "second") == metric_rows(tmp / "first", after=2)
    a, b = read_state_dict(first.final_dir), read_state_dict(second.final_dir)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    return first


def metric_rows(run: Any, after: int = 0) -> list[tuple]:
    """The metrics lines of steps after ``after``: step, loss, evaluation loss, update rule (no timings)."""
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("eval_loss"), r["update"]) for r in rows if r["step"] > after]
