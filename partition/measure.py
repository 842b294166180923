"""Unit costs measured on this machine, one unit at a time.

:func:`profile_units` builds each *distinct* unit once (units with equal ``signature`` are identical:
the paper's layer similarity) where it is timed (weights drawn on the device, not built on the CPU), runs
its forward and its recompute+backward on one micro-batch in turn,
as the runtimes run them (weights in the training dtype, under its autocast: normalisations in fp32), and
takes the median of each over several timed rounds (CUDA events on a GPU; ``perf_counter`` on the CPU,
with more rounds: a 2-core VM's forward-to-backward ratio varied by 13% from one profile to the next when
each was timed in a block of its own, 3% in turn).
Saved activations are counted with autograd's saved-tensor hooks; peak working memory is measured
with ``torch.cuda.max_memory_allocated`` on a GPU and estimated on the CPU (twice the output plus the
largest saved tensor). A 13B-shaped model has three distinct units, so it profiles in seconds without
ever being built whole. torch is imported inside the functions only (the solver side stays torch-free).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Sequence

from mobius.errors import NotAvailableError
from partition.costs import ModelProfile, UnitCost
from partition.estimate import precision_bytes

log = logging.getLogger(__name__)

CPU_REPS = 15  # timed repetitions of each unit on the CPU, whose speed varies more from moment to moment than a GPU's


def profile_units(specs: Sequence[Any], micro_batch_size: int, seq_len: int, precision: str,
                  device: str = "auto", reps: int = 5, warmup: int = 2, doc_tokens: int | None = None) -> ModelProfile:
    """Measure every distinct unit once (one at a time) and expand to all units; ``doc_tokens``: on rows
    packed with documents of that many tokens (attention within each, as training runs it)."""
    import torch

    from mobius.engine import DTYPES

    dev = _resolve_device(device)
    dtype = DTYPES[precision]
    reps = reps if dev.type == "cuda" else max(reps, CPU_REPS)
    t0 = time.perf_counter()
    by_sig: dict[str, UnitCost] = {}
    distinct = list({s.signature: s for s in specs}.values())
    for k, spec in enumerate(distinct, 1):
        log.info("profiling unit %d/%d: %s (%s, %.0fM parameters) on %s", k, len(distinct), spec.name, spec.kind,
                 spec.param_count / 1e6, dev)
        by_sig[spec.signature] = _measure(spec, micro_batch_size, seq_len, precision, dtype, dev, reps, warmup,
                                          doc_tokens)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    units = [_rename(by_sig[s.signature], s) for s in specs]
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    notes = {"reps": reps, "warmup": warmup, "distinct_units": len(distinct)}
    return ModelProfile(units, micro_batch_size, seq_len, precision, name, "measured", time.perf_counter() - t0, notes,
                        doc_tokens=doc_tokens)


def _resolve_device(device: str):
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise NotAvailableError("profiling on cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


def _rename(cost: UnitCost, spec: Any) -> UnitCost:
    from dataclasses import replace

    return replace(cost, name=spec.name, param_count=spec.param_count, frozen_count=spec.frozen_count)


def _measure(spec: Any, mbs: int, seq: int, precision: str, dtype, dev, reps: int, warmup: int,
             doc_tokens: int | None = None) -> UnitCost:
    """Time forward and recompute+backward of one unit; count its saved and working memory."""
    import torch

    from mobius.engine import autocast
    from mobius.models.packing import Documents

    elem = precision_bytes(precision)
    module = _built_on(spec, dev, dtype)
    x = spec.make_input(mbs, seq, dev, dtype)
    lengths = spec.make_docs(mbs, seq, doc_tokens)
    docs = None if lengths is None else Documents(lengths, dev)  # made once, as for a stage's every unit
    targets = torch.randint(0, spec.vocab_size, (mbs, seq), device=dev) if spec.kind == "head" else None
    step = _unit_step(spec.kind, module, x, targets, lambda: autocast(dev, precision), docs)
    fwd, bwd = _time_interleaved([lambda: step(False), lambda: step(True)], dev, reps, warmup)
    saved, largest = _saved_bytes(module, x, step)
    trainable = spec.param_count - spec.frozen_count  # frozen weights (LoRA's) get no gradients
    work = _peak_work(step, dev, saved, trainable * elem) if dev.type == "cuda" else None
    out_bytes = int(spec.out_numel(mbs, seq)) * elem
    # at least the output and its gradient; on the CPU also the largest saved tensor (its gradient)
    work = max(work or 0, 2 * out_bytes + (largest if dev.type != "cuda" else 0))
    del module
    acc = _accumulate_s(trainable, dtype, dev, reps, warmup) if elem < 4 and trainable else 0.0
    return UnitCost(name=spec.name, kind=spec.kind, signature=spec.signature, param_count=spec.param_count,
                    fwd_s=fwd, bwd_s=bwd, param_bytes=spec.param_count * elem, grad_bytes=trainable * elem,
                    frozen_count=spec.frozen_count,
                    in_bytes=x.numel() * x.element_size(), act_bytes=out_bytes, saved_bytes=saved, work_bytes=work,
                    acc_s=acc)


def _built_on(spec: Any, dev, dtype):
    """The unit in ``dtype`` on ``dev``, in training mode, its weights set there as the families initialise them
    (matrices normal with std 0.02, biases 0, norm weights 1: on the CPU a unit's time depends on its values,
    and with every weight drawn at std 0.02 a GPT-2 block ran 11% slower). Built on the meta device: nothing is
    drawn on the CPU first for a GPU and no fp32 copy is made there (Llama-3.1-8B's embedding, a block and its
    head take 8.4 s of CPU on 2 cores to initialise)."""
    import torch

    from mobius.models import materialise, on_meta

    with on_meta():
        module = spec.build().to(dtype=dtype)
    materialise(module, dev)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return module.train()


def _accumulate_s(numel: int, dtype, dev, reps: int, warmup: int) -> float:
    """Seconds to add one micro-batch's half-precision gradients into fp32 sums (what the pipelines do
    after every backward in bf16/fp16: ``scheduler.stages.add_gradients``)."""
    import torch

    grads = torch.zeros(numel, dtype=dtype, device=dev)
    acc = torch.zeros(numel, dtype=torch.float32, device=dev)
    return _time(lambda: acc.add_(grads), dev, reps, warmup)


def _unit_step(kind: str, module, x, targets, autocast, docs=None):
    """A closure running the unit's forward (no grad) or its forward with grad plus backward, each forward
    under ``autocast()`` (the runtimes' context for the training precision), over ``docs`` (packed rows)."""
    import torch

    from mobius.models.base import lm_loss

    def step(backward: bool) -> None:
        if not backward:
            with torch.no_grad(), autocast():
                out = module(x, docs)
                if targets is not None:
                    lm_loss(out, targets)
            return
        inp = x if kind == "embed" else x.detach().requires_grad_(True)
        with autocast():
            out = module(inp, docs)
            loss = lm_loss(out, targets) if targets is not None else None
        if loss is not None:
            loss.backward()
        elif out.requires_grad:  # (a frozen embedding over token ids, LoRA's, has no backward: neither has the run)
            out.backward(torch.ones_like(out))
        module.zero_grad(set_to_none=True)

    return step


def _time(fn, dev, reps: int, warmup: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after ``warmup`` runs."""
    return _time_interleaved([fn], dev, reps, warmup)[0]


def _time_interleaved(fns: list, dev, reps: int, warmup: int) -> list[float]:
    """Median seconds of each of ``fns`` over ``reps`` rounds that run them in turn, after ``warmup`` rounds:
    a slow spell of the machine falls on all of them alike, not on one (their ratios are what the plan
    weighs)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            out.append(_once(fn, dev))
    return [statistics.median(t) for t in times]


def _once(fn, dev) -> float:
    """Seconds of one run of ``fn`` (CUDA events on a GPU, ``perf_counter`` on the CPU)."""
    import torch

    if dev.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _saved_bytes(module, x, step) -> tuple[int, int]:
    """Bytes autograd saves during the unit's forward (parameters and the input excluded), and
    the largest single saved tensor."""
    import torch

    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(True)
    return sum(seen.values()), max(seen.values(), default=0)


def _peak_work(step, dev, saved: int, grad_bytes: int) -> int:
    """Peak CUDA memory of forward+backward beyond what was allocated, the saved activations and
    the parameter gradients."""
    import torch

    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step(True)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    return max(0, peak - base - saved - grad_bytes)
