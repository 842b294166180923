"""A simulated step's timeline: its spans (:class:`SimEvent`) on the tracks the runtime's measured trace uses too
(:data:`TRACKS`), drawn as a text grid or written in Chrome trace format."""

from __future__ import annotations

from dataclasses import dataclass

TRACKS = ("compute", "h2d", "d2h", "p2p", "cpu")  # a step's tracks, in the order (and as the thread ids) of its
# Chrome trace: a GPU's compute and its transfers by link, then the host's CPU updates; the runtime's measured
# trace (scheduler/trace.py) uses the same


@dataclass
class SimEvent:
    """One span on the timeline. ``gpu`` is the physical GPU, or -1 for the CPU."""

    gpu: int
    track: str  # compute | h2d | d2h | p2p | cpu
    name: str
    start: float
    end: float
    cat: str  # fwd | bwd | upload | act | grad | ckpt | adam | dadam | sum (a summing thread's host work) | dispatch
    nbytes: float = 0.0  # what a transfer moved


def ascii_grid(events: list[SimEvent], step_s: float, width: int) -> str:
    """Text grid: compute cells show the stage (forward lower case a-z, backward upper case)."""
    end = step_s or 1.0
    cell = end / width
    gpus = sorted({e.gpu for e in events if e.gpu >= 0})
    rows = []
    for g in gpus:
        for track in TRACKS[:-1]:  # the GPU's; the CPU's row follows
            evs = [e for e in events if e.gpu == g and e.track == track]
            if not evs and track != "compute":
                continue
            label = f"GPU{g} {track}" if track == "compute" else f"     {track}"
            rows.append(f"{label:<12}|{_row(evs, cell, width)}|")
    cpu = [e for e in events if e.gpu < 0]
    rows.append(f"{'CPU adam':<12}|{_row(cpu, cell, width)}|")
    legend = (f"step {step_s * 1e3:.1f} ms, {cell * 1e3:.2f} ms per column; compute: stage j forward = "
              f"chr('a'+j%26), backward = upper case; links: > upload, a activation, g gradient, < grad download, "
              f"c checkpoint, . messages posted; CPU: stage (mod 10) being updated, + a download's sums added")
    return "\n".join(rows + [legend])


def _row(evs: list[SimEvent], cell: float, width: int) -> str:
    chars = [" "] * width
    cover = [0.0] * width
    for e in evs:
        c0, c1 = int(e.start / cell), min(width - 1, int(max(e.start, e.end - 1e-15) / cell))
        for c in range(max(0, c0), c1 + 1):
            lo, hi = max(e.start, c * cell), min(e.end, (c + 1) * cell)
            if hi - lo > cover[c] or (hi - lo == cover[c] == 0):
                cover[c] = hi - lo
                chars[c] = _glyph(e)
    return "".join(chars)


def _glyph(e: SimEvent) -> str:
    if e.cat in ("fwd", "bwd"):
        stage = int(e.name.lstrip("FBXC").split(".")[0])
        ch = chr(ord("a") + stage % 26)
        return ch.upper() if e.cat == "bwd" else ch
    if e.cat == "adam":
        return str(int(e.name[4:]) % 10)
    if e.cat == "dadam":
        return "*"
    if e.cat == "sum":
        return "+"
    if e.cat == "dispatch":
        return "."
    return {"upload": ">", "grad": "<", "ckpt": "c"}.get(e.cat, "g" if e.name.startswith("g") else "a")


def chrome_trace(events: list[SimEvent], gpu_names: list[str], step_s: float) -> dict:
    """The spans in Chrome trace format: a process per GPU (and the CPU), a thread per track."""
    out: list[dict] = []
    pids = sorted({e.gpu for e in events})
    for pid in pids:
        name = "CPU" if pid < 0 else f"GPU {pid}" + (f" ({gpu_names[pid]})" if pid < len(gpu_names) else "")
        out.append({"name": "process_name", "ph": "M", "pid": pid + 1, "args": {"name": name}})
        for tid, track in enumerate(TRACKS):
            out.append({"name": "thread_name", "ph": "M", "pid": pid + 1, "tid": tid, "args": {"name": track}})
    tids = {t: i for i, t in enumerate(TRACKS)}
    for e in events:
        out.append({"name": e.name, "cat": e.cat, "ph": "X", "ts": e.start * 1e6,
                    "dur": max(0.0, (e.end - e.start) * 1e6), "pid": e.gpu + 1, "tid": tids[e.track]})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"step_s": step_s, "generator": "mobius partition simulator"}}
