"""FlatAdamW, the one AdamW of every host-side (and resident / zero GPU) update, against torch's
AdamW over many odd sizes, block boundaries and decay runs: master, moments and half copy; the single
engine's AdamW, bit for bit torch's."""

from __future__ import annotations

import pytest
import torch

from mobius.config import TrainSection
from mobius.optim import AdamW, FlatAdamW
from mobius.states import Moments

CFG = TrainSection(weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
SIZES = [1, 2, 3, 63, 64, 65, 127, 1000, 4099]


def _runs(n: int, kind: str) -> list[tuple[int, int, bool]]:
    """Decay runs over [0, n): all decayed, none, a decayed prefix, or alternating with a gap left out."""
    if kind == "all":
        return [(0, n, True)]
    if kind == "none":
        return [(0, n, False)]
    if kind == "prefix":
        return [(0, n // 2, True), (n // 2, n, False)]
    third = max(1, n // 3)
    return [(0, third, False), (third, min(n, 2 * third), True)] + ([(2 * third + 1, n, False)] if n > 2 * third + 1
                                                                    else [])


def _reference(master: torch.Tensor, runs: list[tuple[int, int, bool]]) -> tuple[torch.optim.AdamW, list, list]:
    """torch AdamW with two groups (decayed / not), one Parameter per run, over a copy of ``master``."""
    pieces = [(lo, hi, torch.nn.Parameter(master[lo:hi].clone())) for lo, hi, _ in runs]
    groups = [{"params": [p for (lo, hi, p), (_, _, d) in zip(pieces, runs) if d == decay],
               "weight_decay": CFG.weight_decay if decay else 0.0} for decay in (True, False)]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=1.0, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps)
    return opt, pieces, runs


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["all", "none", "prefix", "alternating"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_flat_adamw_equals_torch_adamw(n: int, kind: str, grad_dtype: torch.dtype) -> None:
    """Four steps with changing lr and gradient factor (clipping / loss scale), blocks of 10 elements so
    that runs cross block boundaries: every updated element within 1e-6 of torch's AdamW (the same
    fused kernel fed block by block, against torch's CPU default: float rounding only), moments within
    1e-5 relative, elements outside every run untouched, the half copy the master rounded to bf16."""
    g = torch.Generator().manual_seed(n)
    runs = _runs(n, kind)
    master = torch.randn(n, generator=g)
    start = master.clone()
    half = torch.empty(n, dtype=torch.bfloat16)
    flat = FlatAdamW(master, half, runs, CFG, block=10)
    ref, pieces, _ = _reference(start, runs)
    for step, (lr, factor) in enumerate([(1e-2, 1.0), (3e-3, 0.5), (2e-2, 0.25), (5e-3, 1.0)]):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        for group in ref.param_groups:
            group["lr"] = lr
        for lo, hi, p in pieces:
            p.grad = grad[lo:hi].float() * factor
        ref.step()
        flat.step(grad.clone(), lr, factor)
    covered = torch.zeros(n, dtype=torch.bool)
    for lo, hi, p in pieces:
        covered[lo:hi] = True
        torch.testing.assert_close(master[lo:hi], p.detach(), rtol=0, atol=1e-6)
        st = ref.state[p]
        torch.testing.assert_close(flat.moments.m[lo:hi], st["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(flat.moments.v[lo:hi], st["exp_avg_sq"], rtol=1e-5, atol=1e-10)
    assert torch.equal(master[~covered], start[~covered])
    assert torch.equal(half, master.to(torch.bfloat16)) and flat.steps == 4


def test_load_resumes_exactly() -> None:
    """Moments and the step count loaded into a fresh FlatAdamW continue as if it had run all along."""
    g = torch.Generator().manual_seed(7)
    runs = [(0, 30, True), (30, 77, False)]
    grads = [torch.randn(77, generator=g) for _ in range(5)]
    straight = FlatAdamW(torch.ones(77), None, runs, CFG, block=16)
    for gr in grads:
        straight.step(gr.clone(), 1e-2)
    first = FlatAdamW(torch.ones(77), None, runs, CFG, block=16)
    for gr in grads[:3]:
        first.step(gr.clone(), 1e-2)
    resumed = FlatAdamW(first.master.clone(), None, runs, CFG, block=16)
    part = lambda lo, n: first.moments.part(lo, n).to("cpu")  # noqa: E731
    resumed.load(part(0, 40), 3)  # in two ranges, as a zero rank loads its chunks
    resumed.load(part(40, 37), 3, offset=40)
    for gr in grads[3:]:
        resumed.step(gr.clone(), 1e-2)
    assert torch.equal(resumed.master, straight.master) and torch.equal(resumed.moments.m, straight.moments.m)


def test_a_step_pauses_before_each_block_where_it_is_asked_to() -> None:
    """``pause`` runs before each block (a round-robin worker's update waits there while its summing thread adds);
    the result is the step's without it."""
    runs = [(0, 30, True), (30, 77, False)]
    grad = torch.randn(77, generator=torch.Generator().manual_seed(3))
    plain, paused = (FlatAdamW(torch.ones(77), None, runs, CFG, block=16) for _ in range(2))
    done: list[int] = []
    paused.pause = lambda: done.append(int(paused.moments.m.ne(0).sum()))  # moments written so far
    plain.step(grad.clone(), 1e-2)
    paused.step(grad.clone(), 1e-2)
    assert done == [0, 16, 32, 48, 64] and torch.equal(paused.master, plain.master)


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((7, 5), (5,), (3, 4), (4,))]


@pytest.mark.parametrize("fused", [False, True])
def test_the_single_engines_adamw_is_torchs_bit_for_bit(fused: bool) -> None:
    """Five steps with a changing lr, a parameter without a gradient in one of them, decayed matrices and
    undecayed vectors: parameters and moments equal to torch.optim.AdamW's exactly, with torch's default
    kernel and with its fused one (a GPU's; here on the CPU); an AdamW given torch's moments and step
    count after the third step (a resume) goes on exactly as torch's."""
    ours, theirs = _params(0), _params(0)
    opt = AdamW([p for p in ours if p.dim() >= 2], [p for p in ours if p.dim() < 2], CFG, fused=fused)
    ref = torch.optim.AdamW([{"params": [p for p in theirs if p.dim() >= 2], "weight_decay": CFG.weight_decay},
                             {"params": [p for p in theirs if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1.0, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps, fused=fused or None)
    g = torch.Generator().manual_seed(1)
    resumed = None
    for step, lr in enumerate([1e-2, 3e-3, 2e-2, 5e-3, 1e-3]):
        grads = [torch.randn(p.shape, generator=g) for p in ours]
        for k, (a, b, gr) in enumerate(zip(ours, theirs, grads)):
            a.grad, b.grad = (None, None) if (step, k) == (1, 3) else (gr.clone(), gr.clone())
        for group in ref.param_groups:
            group["lr"] = lr
        opt.step(lr)
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
            st = ref.state[b]
            assert torch.equal(opt.moments(a).m, st["exp_avg"]) and torch.equal(opt.moments(a).v, st["exp_avg_sq"])
        if step == 2:
            resumed_params = [torch.nn.Parameter(b.detach().clone()) for b in theirs]
            resumed = AdamW([p for p in resumed_params if p.dim() >= 2], [p for p in resumed_params if p.dim() < 2],
                            CFG, fused=fused)
            for p, b in zip(resumed_params, theirs):
                resumed.load(p, Moments("fp32", ref.state[b]["exp_avg"], ref.state[b]["exp_avg_sq"]),
                             int(ref.state[b]["step"]))
        elif resumed is not None:
            for p, gr in zip(resumed_params, grads):
                p.grad = gr.clone()
            resumed.step(lr)
            assert all(torch.equal(p, b) for p, b in zip(resumed_params, theirs))
