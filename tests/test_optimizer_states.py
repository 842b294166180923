"""train.optimizer_states: the bf16 and int8 rules (mobius/states.py) against a textbook reference written here in
numpy (a loop over parameters, float32 arithmetic one operation at a time, the stochastic rounding's hash in uint32),
the host kernel against the torch-op version bit for bit, the flat buffers of the runtimes against the single
engine's per-parameter loop, the moments' storage, conversions and the fallback without a compiler."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from mobius.config import TrainSection
from mobius.optim import FlatAdamW, ParamAdamW, make_adamw
from mobius.states import BLOCK, Moments, RuleUpdate, StepScalars

CFG = dict(weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
F = np.float32


# ---- the textbook reference ----------------------------------------------------------------------------------------
def _hash(pos: np.ndarray, t: int) -> np.ndarray:
    """lowbias32 of (position, step) in uint32 arithmetic (numpy wraps uint32 products)."""
    seed = np.uint32((t * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF)
    x = (pos.astype(np.uint32) * np.uint32(0x9E3779B1)) ^ seed
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _sr_bf16(x: np.ndarray, r16: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 with 16 random bits added below its last bit, back as float32."""
    return (((x.view(np.uint32) + r16) >> np.uint32(16)) << np.uint32(16)).view(np.float32)


def _fp8(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """x (float32) through a float8 format (torch's conversion, round to nearest even) and back."""
    return torch.from_numpy(x).to(dtype).float().numpy()


class Textbook:
    """AdamW with bf16 or int8 moments over separate parameters, as docs/optimizer-states.md states it."""

    def __init__(self, rule: str, sizes: list[int]):
        self.rule, self.t = rule, 0
        self.m = [np.zeros(n, F) for n in sizes]  # the stored moments, as float32 values
        self.v = [np.zeros(n, F) for n in sizes]

    def step(self, params: list[np.ndarray], grads: list[np.ndarray], decays: list[bool], lr: float,
             factor: float) -> None:
        self.t += 1
        t = self.t
        b1, b2 = F(CFG["beta1"]), F(CFG["beta2"])
        ss, ib = F(lr / (1 - CFG["beta1"] ** t)), F(1 / np.sqrt(1 - CFG["beta2"] ** t))
        for i, (p, g, decay) in enumerate(zip(params, grads, decays)):
            g = g * F(factor)
            if decay:
                p *= F(1 - lr * CFG["weight_decay"])
            m = self.m[i] * b1 + g * F(1 - CFG["beta1"])
            v = self.v[i] * b2 + (g * g) * F(1 - CFG["beta2"])
            p -= (m / (np.sqrt(v) * ib + F(CFG["eps"]))) * ss
            self.m[i], self.v[i] = self._store(m, v, t)

    def _store(self, m: np.ndarray, v: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        if self.rule == "bf16":
            r = _hash(np.arange(m.size), t)
            return _sr_bf16(m, r >> np.uint32(16)), _sr_bf16(v, r & np.uint32(0xFFFF))
        return self._blockwise(m, torch.float8_e4m3fn, 448.0), self._blockwise(v, torch.float8_e5m2, 57344.0)

    @staticmethod
    def _blockwise(x: np.ndarray, dtype: torch.dtype, top: float) -> np.ndarray:
        out = np.empty_like(x)
        for lo in range(0, x.size, BLOCK):  # each block of 64 of the parameter, from its first element
            b = x[lo:lo + BLOCK]
            scale = F(np.abs(b).max()) / F(top)
            inv = F(1) / scale if scale > 0 else F(0)
            out[lo:lo + BLOCK] = _fp8(b * inv, dtype) * scale
        return out


# ---- helpers ---------------------------------------------------------------------------------------------------
def _cfg(rule: str) -> TrainSection:
    return TrainSection(optimizer_states=rule, **CFG)


SHAPES = [(7, 33), (130,), (64, 3), (5,), (200, 70)]  # odd sizes, one under a block, several blocks, a long one
STEPS = [(1e-2, 1.0), (3e-3, 0.5), (2e-2, 0.25), (5e-3, 1.0), (1e-2, 0.7)]


def _grads(g: torch.Generator) -> list[torch.Tensor]:
    """Gradients whose magnitudes spread over ~6 decades inside a block (the int8 scales' hard case)."""
    return [torch.randn(s, generator=g) * torch.exp(2 * torch.randn(s, generator=g)) for s in SHAPES]


@pytest.mark.parametrize("rule", ["bf16", "int8"])
def test_the_single_engines_loop_equals_the_textbook_rule(rule: str) -> None:
    """Five steps of ParamAdamW (the single engine's: a FlatAdamW per parameter, the host kernel) on parameters of
    odd sizes, decayed matrices and undecayed vectors, changing lr and gradient factor: the weights and the stored
    moments equal the numpy reference's to the bit."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    ref_p = [p.detach().numpy().copy().reshape(-1) for p in params]
    opt = make_adamw([(str(i), p) for i, p in enumerate(params)], _cfg(rule))
    assert isinstance(opt, ParamAdamW)
    ref = Textbook(rule, [p.numel() for p in params])
    for lr, factor in STEPS:
        grads = _grads(g)
        for p, gr in zip(params, grads):
            p.grad = gr * factor  # (the single engine clips in place, then steps with factor 1)
        opt.step(lr)
        ref.step(ref_p, [(gr * factor).numpy().reshape(-1) for gr in grads], [p.dim() >= 2 for p in params], lr, 1.0)
    for i, p in enumerate(params):
        assert np.array_equal(p.detach().numpy().reshape(-1), ref_p[i]), i
        m, v = opt.moments(p).fp32()
        assert np.array_equal(m.numpy(), ref.m[i]) and np.array_equal(v.numpy(), ref.v[i]), i


def _layout() -> tuple[int, list[tuple[int, int, bool]], list[tuple[int, int]], list[int]]:
    """SHAPES in one flat buffer at multiples of 64 (as mobius.layout places them): its size, decay runs (gaps
    joined to the run before), the origins where each parameter starts, the offsets."""
    offsets, at = [], 0
    for s in SHAPES:
        offsets.append(at)
        at += -(-int(np.prod(s)) // 64) * 64
    runs = [(o, offsets[i + 1] if i + 1 < len(offsets) else o + int(np.prod(s)), len(s) >= 2)
            for i, (o, s) in enumerate(zip(offsets, SHAPES))]
    return at, runs, [(o, 0) for o in offsets], offsets


@pytest.mark.parametrize("rule", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_flat_buffer_equals_the_per_parameter_loop(rule: str, grad_dtype: torch.dtype) -> None:
    """The runtimes' FlatAdamW over every parameter in one buffer, cut into blocks of 1000 elements (the update's
    blocks cut runs anywhere; int8's round up to whole blocks of its moments), writing a bf16 half copy, from fp32
    or bf16 gradients: weights and moments equal to ParamAdamW's per parameter, the half copy the weights rounded,
    the alignment gaps untouched."""
    n, runs, origins, offsets = _layout()
    g = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    master = torch.zeros(n)
    for o, p in zip(offsets, params):
        master[o:o + p.numel()] = p.detach().reshape(-1)
    start, half = master.clone(), torch.zeros(n, dtype=torch.bfloat16)
    flat = FlatAdamW(master, half, runs, _cfg(rule), block=1000, origins=origins)
    loop = ParamAdamW([(str(i), p) for i, p in enumerate(params)], _cfg(rule))
    for lr, factor in STEPS:
        grads = [gr.to(grad_dtype) for gr in _grads(g)]
        flat_grad = torch.zeros(n, dtype=grad_dtype)
        for o, p, gr in zip(offsets, params, grads):
            flat_grad[o:o + p.numel()] = gr.reshape(-1)
            p.grad = gr.float() * factor
        flat.step(flat_grad, lr, factor)
        loop.step(lr)
    for o, p in zip(offsets, params):
        k = p.numel()
        assert torch.equal(master[o:o + k], p.detach().reshape(-1))
        got, want = flat.moments.part(o, k), loop.moments(p)
        assert all(torch.equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(got.tensors().values(),
                                                                              want.tensors().values()))
    gaps = torch.ones(n, dtype=torch.bool)
    for lo, hi, _ in runs:
        gaps[lo:hi] = False
    assert torch.equal(master[gaps], start[gaps]) and torch.equal(half, master.to(torch.bfloat16))


def _special(n: int, g: torch.Generator) -> torch.Tensor:
    """Values that reach every path of the codes: zeros, subnormals of both float8 formats, ties, large and small
    magnitudes within one block."""
    x = (torch.randn(n, generator=g) * torch.exp(4 * torch.randn(n, generator=g))).clamp(-6e4, 6e4)  # (fp16's range)
    x[::7] = 0.0
    x[3::11] = 1e-30
    return x


@pytest.mark.parametrize("rule", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype, half_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, None), (torch.float16, torch.float16),
                                                    (torch.float32, torch.float32)])
def test_the_host_kernel_and_the_torch_ops_agree_to_the_bit(rule: str, grad_dtype: torch.dtype,
                                                          half_dtype: torch.dtype | None) -> None:
    """The same runs (a parameter continued past a cut, a gap, a short last block) through the compiled kernel and
    through the torch-op version (a GPU's, and the host's without a compiler): master, half copy and moments
    bitwise equal after five steps, in every gradient and half-copy dtype (fp32: the round-robin's compute copy in
    fp32 training)."""
    n, runs = 5000, [(0, 1000, True), (1024, 2500, False), (2560, 4999, True)]
    origins = [(0, 0), (1024, 0), (1600, 576), (2560, 0)]
    out = []
    for kernel in (True, False):
        g = torch.Generator().manual_seed(5)
        master, mo = torch.randn(n, generator=g), Moments.zeros(n, rule)
        half = None if half_dtype is None else torch.zeros(n, dtype=half_dtype)
        upd = RuleUpdate(rule, runs, origins, [(0, 2048), (2048, n)], torch.device("cpu"))
        assert upd.tasks is not None
        if not kernel:
            upd.tasks = None
        for t in range(1, 6):
            grad = _special(n, g).to(grad_dtype)
            k = StepScalars.of(0.9, 0.95, 1e-8, 0.1, 1e-2, t, 0.7)
            for b in range(2):
                upd.run(b, k, t, master, grad, half, mo)
        out.append([master, half, *mo.tensors().values()])
    for a, b in zip(*out):
        assert (a is None and b is None) or torch.equal(a, b)


def test_stochastic_rounding_is_unbiased_and_the_same_in_every_layout() -> None:
    """bf16 moments: one value stored at 4096 positions over 64 steps averages to itself (nearest rounding would
    be 0.4% off), and an element's rounding depends on its position in its parameter and the step, not on where
    the parameter sits in a buffer."""
    from mobius.states import mix, round_bf16, step_seed

    x = torch.full((4096,), 1.0 + 2**-9)  # halfway between two bf16 neighbours' quarter: nearest keeps 1.0
    pos = torch.arange(4096)
    mean = torch.stack([round_bf16(x, mix(pos, step_seed(t)) >> 16).float() for t in range(1, 65)]).mean()
    assert abs(mean.item() - x[0].item()) < 2e-5 < abs(x[0].to(torch.bfloat16).item() - x[0].item())
    a = round_bf16(torch.full((10,), 1.3), mix(torch.arange(100, 110), step_seed(3)) & 0xFFFF)
    b = round_bf16(torch.full((10,), 1.3), mix(torch.arange(100, 110), step_seed(3)) & 0xFFFF)
    assert torch.equal(a, b) and not torch.equal(a, round_bf16(torch.full((10,), 1.3),
                                                              mix(torch.arange(100, 110), step_seed(4)) & 0xFFFF))


@pytest.mark.parametrize("rule", ["fp32", "bf16", "int8"])
def test_moments_convert_and_cut_by_parameter(rule: str) -> None:
    """fp32 moments into a rule's storage and back (bf16 within its rounding, int8 within float8's, exactly zero
    where zero), cut at a block boundary and joined again (a zero shard's pieces of one parameter), a checkpoint's
    tensors and back, bytes as the planner counts them."""
    g = torch.Generator().manual_seed(2)
    m, v = torch.randn(300, generator=g), torch.rand(300, generator=g)
    m[:5] = 0.0
    mo = Moments.from_fp32(m, v, rule)
    back_m, back_v = mo.fp32()
    tol = {"fp32": 0.0, "bf16": 2**-8, "int8": 2**-3}[rule]
    assert torch.all((back_m - m).abs() <= tol * m.abs().amax()) and torch.all(back_m[:5] == 0)
    assert torch.all((back_v - v).abs() <= tol * v) or rule == "int8"  # (e5m2: 2 mantissa bits, relative to its block)
    joined = Moments.cat([mo.part(0, 128), mo.part(128, 172)])
    assert all(torch.equal(a, b) for a, b in zip(joined.tensors().values(), mo.tensors().values()))
    again = Moments.from_tensors({k: t.clone() for k, t in mo.to("cpu", (3, 100)).tensors().items()})
    assert again.rule == rule and again.m.shape == (3, 100)
    assert mo.nbytes == {"fp32": 8 * 300, "bf16": 4 * 300, "int8": 2 * 300 + 8 * 5}[rule]
    if rule == "int8":
        with pytest.raises(AssertionError, match="inside a block"):
            mo.part(100, 10)


def test_without_a_compiler_the_rules_run_as_torch_ops(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """No C++ compiler: one warning says so and the update runs as torch ops, with the same numbers."""
    from mobius import kernels

    kernels.adamw_states.cache_clear()
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    try:
        with caplog.at_level(logging.WARNING):
            slow = FlatAdamW(torch.ones(200), None, [(0, 200, True)], _cfg("int8"))
        assert slow._rule.tasks is None
        assert [r.getMessage() for r in caplog.records if "compiler" in r.getMessage()] == [
            "no C++ compiler (no-such-compiler-here): the bf16/int8 optimizer states update on the CPU with torch "
            "ops, several times slower than their kernel"]
    finally:
        kernels.adamw_states.cache_clear()
        monkeypatch.delenv("CXX")
    fast = FlatAdamW(torch.ones(200), None, [(0, 200, True)], _cfg("int8"))
    assert fast._rule.tasks is not None
    grad = torch.randn(200, generator=torch.Generator().manual_seed(0))
    for opt in (slow, fast):
        opt.step(grad, 1e-2, 0.5)
    assert torch.equal(slow.master, fast.master) and torch.equal(slow.moments.m, fast.moments.m)


# ---- checkpoints ---------------------------------------------------------------------------------------------
def _run_cfg(tmp: Path, corpus: Path, out: str, states: str, steps: int = 4, **sections: dict):
    """A 4-step single-mode run of GPT-2 tiny on the CPU (lr changing every step, clipping), with ``states``."""
    from mobius.config import config_from_dict

    raw = {"model": {"preset": "gpt2-tiny", "dropout": 0.0},
           "data": {"path": str(corpus), "seq_len": 32, "cache_dir": str(tmp / "cache")},
           "train": {"max_steps": steps, "micro_batch_size": 2, "micro_batches": 2, "lr": 3e-3, "warmup_steps": steps,
                     "weight_decay": 0.1, "grad_clip": 0.05, "eval_every": 0, "eval_batches": 1, "seed": 7,
                     "optimizer_states": states},
           "parallel": {"mode": "single", "device": "cpu"}, "output": {"dir": str(tmp / out), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def _optimizer_file(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(next(checkpoint.glob("optimizer-*.safetensors"))))


def _resume(tmp: Path, run: str, step: int, into: str) -> None:
    import shutil

    name = f"step-{step:06d}"
    (tmp / into / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp / run / "checkpoints" / name, tmp / into / "checkpoints" / name)


@pytest.mark.parametrize("rule", ["bf16", "int8"])
def test_a_checkpoint_keeps_the_moments_in_their_precision_and_resumes_exactly(tmp_path: Path, corpus: Path,
                                                                              rule: str) -> None:
    """4 steps straight == 2 steps, a checkpoint, --resume, 2 more: bit-identical losses and weights (the moments
    come back as stored, and the stochastic rounding's numbers are the step's); the checkpoint holds them as bf16,
    or as uint8 codes with an fp32 scale per block of 64."""
    from mobius.app.run import train
    from mobius.models.hf import read_state_dict

    straight = train(_run_cfg(tmp_path, corpus, "straight", rule))
    first = train(_run_cfg(tmp_path, corpus, "first", rule, output={"save_every": 2, "keep_last": 1}))
    saved = _optimizer_file(tmp_path / "first" / "checkpoints" / "step-000002")
    a = read_state_dict(straight.final_dir)
    m, shape = saved["embed.wte.weight.exp_avg"], a["transformer.wte.weight"].shape  # (Hugging Face names)
    if rule == "bf16":
        assert m.dtype == torch.bfloat16 and m.shape == shape and "embed.wte.weight.exp_avg.scale" not in saved
    else:
        scale = saved["embed.wte.weight.exp_avg_sq.scale"]
        assert m.dtype == torch.uint8 and m.shape == shape and scale.shape == (m.numel() // BLOCK,)
    _resume(tmp_path, "first", 2, "second")
    resumed = train(_run_cfg(tmp_path, corpus, "second", rule), resume="auto")
    assert first.losses == straight.losses and resumed.losses == straight.losses
    b = read_state_dict(resumed.final_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_with_other_moments_converts_them_and_says_so(tmp_path: Path, corpus: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """An fp32 run's checkpoint resumed with bf16 moments, and that run's resumed with fp32 ones: each says in one
    line that it converts (how: :meth:`Moments.as_rule`, tested above) and writes its checkpoints in its own
    precision."""
    from mobius.app.run import train

    sections = {"output": {"save_every": 2, "keep_last": 2}}
    train(_run_cfg(tmp_path, corpus, "fp32", "fp32", 3, **sections))
    said = {}
    for run, source, states, steps in (("to-bf16", "fp32", "bf16", 5), ("to-fp32", "to-bf16", "fp32", 7)):
        _resume(tmp_path, source, steps - 3, run)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mobius.assemble"):
            train(_run_cfg(tmp_path, corpus, run, states, steps, **sections), resume="auto")
        said[run] = [r.getMessage() for r in caplog.records if "optimizer_states" in r.getMessage()]
    assert said == {"to-bf16": ["train.optimizer_states=bf16: the checkpoint's AdamW moments are fp32; converted as "
                                "they load (rounded once to bf16)"],
                    "to-fp32": ["train.optimizer_states=fp32: the checkpoint's AdamW moments are bf16; converted as "
                                "they load (exactly)"]}
    before = _optimizer_file(tmp_path / "fp32" / "checkpoints" / "step-000002")
    after = _optimizer_file(tmp_path / "to-bf16" / "checkpoints" / "step-000004")
    assert before["blocks.0.attn.qkv.weight.exp_avg"].dtype == torch.float32
    assert after["blocks.0.attn.qkv.weight.exp_avg"].dtype == torch.bfloat16
    assert _optimizer_file(tmp_path / "to-fp32" / "checkpoints" / "step-000006")[
        "blocks.0.attn.qkv.weight.exp_avg"].dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("mode, rule", [("pipeline", "int8"), ("zero", "bf16"), ("round_robin", "int8")])
def test_a_checkpoint_of_any_mode_resumes_in_single_mode(tmp_path: Path, corpus: Path, mode: str, rule: str) -> None:
    """2 steps on 2 CPU workers (the swapped pipeline, zero, the round-robin schedule), a checkpoint, 2 more in
    single mode == 4 in single mode (as the matrices hold modes with these moments to single mode:
    :func:`spawned.assert_weights_close`): each mode writes its moments by parameter name, in the rule's storage,
    from its own flat buffers."""
    from mobius.app.run import train
    from mobius.models.hf import read_state_dict
    from spawned import assert_weights_close

    parallel = {"pipeline": {"mode": "pipeline", "devices": 2, "stages": 4},
                "zero": {"mode": "zero", "devices": 2},
                "round_robin": {"mode": "pipeline", "devices": 2, "schedule": "round_robin"}}[mode]
    part = {"partition": {"cache_dir": str(tmp_path / "plans")}}
    straight = train(_run_cfg(tmp_path, corpus, "straight", rule))
    train(_run_cfg(tmp_path, corpus, "workers", rule, parallel=parallel, output={"save_every": 2}, **part))
    _resume(tmp_path, "workers", 2, "single")
    resumed = train(_run_cfg(tmp_path, corpus, "single", rule, **part), resume="auto")
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)
    assert_weights_close(read_state_dict(resumed.final_dir), read_state_dict(straight.final_dir), 1e-5, mode, rule,
                         3e-3, 4)
