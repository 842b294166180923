"""The zero-mode search engine (Elixir §4-5, Appendix A): the chunk size -- the candidate that
replaces the fewest bytes in rCache per step (Belady, simulated, with the rCache the memory allows
when every chunk is offloaded), ties broken by predicted time -- then rCache blocks and GPU chunks
(:mod:`partition.zero.choice`), the prediction (:mod:`partition.zero.step_sim`) and the
alternatives the plan reports (:class:`~partition.zero.plan.ZeroPlan`)."""

from __future__ import annotations

from mobius.errors import ConfigError, size_text
from mobius.layout import ALIGN, ChunkLayout, ParamInfo, build_layout
from partition.costs import ModelProfile
from partition.schedule.zero import chunk_trace, train_program
from partition.zero.replacement import simulate_cache
from partition.zero.choice import choose_setting, gpu_benefit, rcache_benefit
from partition.zero.memory import (F_FRAG, GiB, Setting, Workload, ZeroHardware, activation_bytes, host_bytes,
                                   model_state_bytes, usable_bytes)
from partition.zero.plan import ZeroPlan
from partition.zero.step_sim import Prediction, predict, with_spread

MIN_CHUNK_BYTES = 32 * 2**20  # chunks of at least this many half-precision bytes keep transfers efficient
CHUNK_FACTORS = (0.25, 1 / 3, 0.5, 2 / 3, 1.0, 1.5, 2.0, 3.0, 4.0)  # candidates: x the largest unit
TIE = 0.01  # replaced bytes within 1% count as equal
MAX_CHUNKS = 4096  # a zero.chunk_size cutting the model finer is refused: the search's cost grows with the square
                   # of the chunk count (4096: about 12 s on 2 busy cores)


def chunk_candidates(params: list[ParamInfo], num_units: int, elem: int, align: int = ALIGN) -> list[int]:
    """Chunk sizes to simulate: multiples of the largest unit's parameters, and the largest parameter,
    no smaller than ``MIN_CHUNK_BYTES`` (or an eighth of a small model)."""
    per_unit = [0] * num_units
    for p in params:
        per_unit[p.units[0]] += p.numel
    total, largest = sum(per_unit), max(per_unit)
    floor = min(MIN_CHUNK_BYTES // elem, max(1, total // 8))
    raw = {int(largest * f) for f in CHUNK_FACTORS} | {max(p.numel for p in params)}
    return sorted({-(-c // align) * align for c in raw if floor <= c <= total} or {-(-max(floor, 1) // align) * align})


def _evaluate(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, w: Workload, s: Setting,
              act: int, spread: bool = False) -> dict:
    pred = predict(layout, prof, hw, s, w)
    if spread:
        pred = with_spread(pred, layout, prof, hw, s, w)
    peak = sum(model_state_bytes(layout, s, w.elem, w.delayed, w.states).values()) + act
    return {"cache_blocks": s.cache_blocks, "gpu_chunks": s.gpu_chunks, "step_s": pred.step_s, "peak_bytes": peak,
            "replaced_bytes": pred.traffic["replaced_bytes"], "prediction": pred}


def alternatives(layout: ChunkLayout, prof: ModelProfile, hw: ZeroHardware, w: Workload, allowed: int,
                 act: int) -> dict[str, dict | None]:
    """rCache-min, rCache-max and all-offload, each filling the memory left the paper's way (each step with the
    spreads drawn, as the plan's)."""
    out: dict[str, dict | None] = {}
    block = layout.padded * w.elem
    fixed = sum(model_state_bytes(layout, Setting(0, 0), w.elem, w.delayed, w.states).values())
    fill = {"rcache-min": layout.min_blocks, "rcache-max": layout.num_chunks}
    for name, n in fill.items():
        s = choose_setting(layout, hw, allowed, w, cache_blocks=n) if fixed + n * block <= allowed else None
        out[name] = _public(_evaluate(layout, prof, hw, w, s, act, spread=True)) if s else None
    n = min(layout.num_chunks, (allowed - fixed) // block) if allowed > fixed else 0
    ok = n >= layout.min_blocks
    out["all-offload"] = _public(_evaluate(layout, prof, hw, w, Setting(n, 0), act, spread=True)) if ok else None
    return out


def _public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "prediction"}


def search(params: list[ParamInfo], num_units: int, prof: ModelProfile, hw: ZeroHardware, w: Workload, *,
           chunk_size: int = 0, cache_blocks: int = 0, gpu_chunks: int = -1,
           align: int = ALIGN) -> tuple[ChunkLayout, Setting, dict, list[dict]]:
    """The chosen layout and setting, its evaluation, and the chunk-size table (module docstring)."""
    act = activation_bytes(prof, w)
    allowed = usable_bytes(hw.memory_bytes, act)
    if chunk_size:
        check_chunk_size(chunk_size, params, align)
    sizes = [chunk_size] if chunk_size else chunk_candidates(params, num_units, w.elem, align)
    layouts = [build_layout(params, num_units, size, hw.ranks, align) for size in sizes]
    if cache_blocks and not chunk_size:  # only the chunk sizes that this many blocks can run
        allowed_sizes = [lay for lay in layouts if lay.min_blocks <= cache_blocks <= lay.num_chunks]
        if not allowed_sizes:
            raise ConfigError(f"zero.cache_blocks={cache_blocks} suits none of the chunk sizes searched (they need "
                              f"{min(lay.min_blocks for lay in layouts)} to {max(lay.num_chunks for lay in layouts)} "
                              f"blocks); set zero.chunk_size too, or zero.cache_blocks=0")
        layouts = allowed_sizes
    rows = []
    for layout in layouts:
        size = layout.chunk_size
        setting = choose_setting(layout, hw, allowed, w, cache_blocks, gpu_chunks)
        if setting is None:
            rows.append({"chunk_size": size, "fits": False, "layout": layout})
            continue
        ev = _evaluate(layout, prof, hw, w, setting, act)
        all_off = choose_setting(layout, hw, allowed, w, cache_blocks, gpu_chunks=0) or setting
        ranking = simulate_cache(chunk_trace(train_program(num_units), layout), all_off.cache_blocks, w.prefetch)
        rows.append({"chunk_size": size, "fits": True, "layout": layout, "setting": setting, "eval": ev,
                     "replaced_bytes": ranking.gathers * layout.padded * w.elem})
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        if chunk_size:  # a chunk size given: run it as configured and say it may not fit
            r = rows[0]
            s = Setting(cache_blocks or r["layout"].min_blocks, max(gpu_chunks, 0))
            return r["layout"], s, _evaluate(r["layout"], prof, hw, w, s, act), _table(rows)
        raise ConfigError(_too_small(rows, hw, act, allowed, w))
    least = min(r["replaced_bytes"] for r in fitting)
    near = [r for r in fitting if r["replaced_bytes"] <= least * (1 + TIE)]
    best = min(near, key=lambda r: (r["eval"]["step_s"], -r["chunk_size"]))
    return best["layout"], best["setting"], best["eval"], _table(rows)


def replay(zplan: ZeroPlan, params: list[ParamInfo], num_units: int, prof: ModelProfile,
           hw: ZeroHardware) -> Prediction:
    """``zplan``'s step simulated again with the unit times of ``prof`` (its chunk layout, rCache blocks and GPU
    chunks as planned; ``prof``'s spreads drawn, as the plan's step): what :mod:`partition.calibrate` fits a zero
    run's compute with."""
    layout = build_layout(params, num_units, zplan.chunk_size, hw.ranks, zplan.align)
    w = Workload(zplan.micro_batches // hw.ranks, zplan.precision, zplan.checkpointing, zplan.barrier, zplan.prefetch,
                 zplan.delayed, zplan.states)
    s = Setting(zplan.cache_blocks, zplan.gpu_chunks)
    return with_spread(predict(layout, prof, hw, s, w), layout, prof, hw, s, w)


def check_chunk_size(chunk_size: int, params: list[ParamInfo], align: int = ALIGN) -> None:
    """A configured chunk size within what the search handles: at most the model's parameter count (one
    chunk holding them all), and no finer than :data:`MAX_CHUNKS` chunks."""
    total = sum(p.numel for p in params)
    most = -(-total // align) * align
    least = -(-total // MAX_CHUNKS)
    if chunk_size > most:
        raise ConfigError(f"zero.chunk_size={chunk_size:,} is above the model's {total:,} parameters (one chunk of "
                          f"{most:,} holds them all); set zero.chunk_size between {least:,} and {most:,}, or 0 to "
                          f"let the search choose")
    if chunk_size < least:
        raise ConfigError(f"zero.chunk_size={chunk_size:,} cuts the model's {total:,} parameters into more than "
                          f"{MAX_CHUNKS} chunks, more than the search simulates in seconds; set zero.chunk_size "
                          f"between {least:,} and {most:,}, or 0 to let the search choose")


def _table(rows: list[dict]) -> list[dict]:
    return [{"chunk_size": r["chunk_size"], "fits": r["fits"], "num_chunks": r["layout"].num_chunks,
             "replaced_bytes": r.get("replaced_bytes", 0), "step_s": r["eval"]["step_s"] if r["fits"] else None}
            for r in rows]


def _too_small(rows: list[dict], hw: ZeroHardware, act: int, allowed: int, w: Workload) -> str:
    need = min(sum(model_state_bytes(r["layout"], Setting(r["layout"].min_blocks, 0), w.elem, w.delayed,
                                     w.states).values())
               for r in rows)
    return (f"zero mode does not fit in {size_text(hw.memory_bytes)} per rank (partition.gpu_memory_gib, or the "
            f"device's memory): activations take {size_text(act)} (x{F_FRAG} for fragmentation), leaving "
            f"{size_text(max(allowed, 0))} for chunks, but the smallest rCache needs {size_text(need)}; raise "
            f"partition.gpu_memory_gib, use a smaller train.micro_batch_size, turn on "
            f"model.activation_checkpointing, or use more devices")


def plan(params: list[ParamInfo], num_units: int, prof: ModelProfile, hw: ZeroHardware, *, micro_batches: int,
         checkpointing: bool, barrier: bool, prefetch: bool = True, chunk_size: int = 0, cache_blocks: int = 0,
         gpu_chunks: int = -1, align: int = ALIGN, delayed: bool = False, states: str = "fp32") -> ZeroPlan:
    """The zero plan: search (or take the configured values), predict, and compare the alternatives;
    ``delayed`` (train.update=delayed): the memory of the compute copies counted; ``states``: the moments'
    precision (train.optimizer_states)."""
    if micro_batches % hw.ranks:
        raise ConfigError(f"train.micro_batches={micro_batches} must be a multiple of the {hw.ranks} zero ranks")
    if states == "int8" and chunk_size % ALIGN:
        raise ConfigError(f"zero.chunk_size={chunk_size:,} must be a multiple of {ALIGN} with "
                          f"train.optimizer_states=int8 (a parameter larger than a chunk continues in the next one, "
                          f"and its blocks of {ALIGN} must not be cut); set zero.chunk_size="
                          f"{-(-chunk_size // ALIGN) * ALIGN:,}")
    w = Workload(micro_batches // hw.ranks, prof.precision, checkpointing, barrier, prefetch, delayed, states)
    layout, s, ev, table = search(params, num_units, prof, hw, w, chunk_size=chunk_size, cache_blocks=cache_blocks,
                                  gpu_chunks=gpu_chunks, align=align)  # (compared at the means)
    act = activation_bytes(prof, w)
    allowed = usable_bytes(hw.memory_bytes, act)
    pred = with_spread(ev["prediction"], layout, prof, hw, s, w)
    held = model_state_bytes(layout, s, w.elem, delayed, states)
    memory = {**held, "activations": act, "usable": allowed, "capacity": hw.memory_bytes,
              "host": host_bytes(layout, s, w.precision, delayed, states)}
    decided = {"chunk_size": "config" if chunk_size else "search",
               "cache_blocks": "config" if cache_blocks else "search",
               "gpu_chunks": "config" if gpu_chunks >= 0 else "search"}
    return ZeroPlan(
        chunk_size=layout.chunk_size, padded_chunk=layout.padded, align=align, world=hw.ranks,
        num_chunks=layout.num_chunks, cache_blocks=s.cache_blocks, min_blocks=layout.min_blocks,
        gpu_chunks=s.gpu_chunks, micro_batches=micro_batches, micro_batch_size=prof.micro_batch_size,
        seq_len=prof.seq_len, precision=prof.precision, checkpointing=checkpointing, prefetch=prefetch,
        barrier=barrier, delayed=delayed, states=states, predicted_step_s=pred.step_s, spread_s=pred.spread_s,
        compute_s=pred.compute_s,
        stall_s=pred.stall_s, cpu_adam_s=pred.cpu_adam_s, fits=sum(held.values()) <= allowed, memory=memory,
        traffic=pred.traffic,
        benefits={"I_s_per_GiB": rcache_benefit(hw, w.elem) * GiB,
                  "J_s_per_GiB": gpu_benefit(hw, w.elem, w.state_bytes) * GiB},
        alternatives=alternatives(layout, prof, hw, w, allowed, act), candidates=table, decided=decided,
        param_count=layout.param_numel, waste=layout.waste, hardware=hw.describe(), profile_source=prof.source,
        device_name=prof.device_name, time_split=pred.time_split(),
        compute_scale={k: v for k, v in prof.notes.get("in_run", {}).items() if k != "key"})
