"""AdamW's two moments in the precision ``train.optimizer_states`` names, and the update rule of each.

* ``fp32``: m and v in fp32 (8 bytes per parameter): torch's fused AdamW (:class:`mobius.optim.FlatAdamW`).
* ``bf16``: m and v in bfloat16 (4 bytes). Each step decodes them to fp32, runs AdamW in fp32 (the master and this
  step's update use the fp32 moments) and rounds the new moments back *stochastically*: 16 bits of a hash of the
  element's position in its parameter and the step count are added below bf16's last bit (unbiased; the same
  numbers in every mode and partition). Round to nearest would not do: with ``beta2`` 0.999 a v whose
  gradients shrink 10x stays 2.8x too large (``python bench/optimizer_states_quality.py``, docs/optimizer-states.md).
* ``int8``: m and v as 8-bit float codes with one fp32 scale per block of :data:`BLOCK` elements of a parameter
  (2.125 bytes): the blockwise-scaled float8 states of torchao's ``AdamWFp8`` (m in ``float8_e4m3fn`` with scale
  absmax/448), but v in ``float8_e5m2`` (scale absmax/57344): its 32 octaves keep a block's small second moments
  where e4m3's 18 flush them to zero, which turns their updates into m/eps. Decoded to fp32, updated, re-encoded
  with the block's new absmax, rounded to nearest (torch's conversions).

A block is 64 elements of one parameter counted from its first element: :data:`mobius.layout.ALIGN`, so the blocks of
every flat buffer (stages, units, zero shards) are the parameters' own, and a checkpoint's per-parameter codes and
scales resume under any mode or partition.

Each rule has one implementation, in two forms that agree to the bit: a compiled host kernel
(``mobius/kernels/adamw_states.cpp``: one pass over master, gradient, moments and half copy) and the torch-op
version here (GPUs, and the host when no C++ compiler is at hand). :class:`RuleUpdate` runs either over the pieces
of a flat buffer.
"""

from __future__ import annotations

import ctypes
import logging
import math
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from mobius.layout import ALIGN

log = logging.getLogger(__name__)

States = Literal["fp32", "bf16", "int8"]
STATES: tuple[str, ...] = ("fp32", "bf16", "int8")
BLOCK = 64  # elements per int8 block (one scale per moment)
assert BLOCK == ALIGN, "int8 blocks are the parameters' own only where every offset in a flat buffer is a multiple"
E4M3_MAX, E5M2_MAX = 448.0, 57344.0
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
TASK_NUMEL = 1 << 15  # elements per task of the host kernel (the threads of a step take tasks from one counter)
TORCH_PIECE = 1 << 22  # elements per piece of the torch-op version (bounds its temporaries: ~16 MiB each)


def blocks(n: int) -> int:
    """int8 blocks (scales per moment) of ``n`` elements counted from a parameter's first."""
    return -(-n // BLOCK)


def moment_bytes(rule: str) -> float:
    """Bytes of both moments per element in ``rule``'s storage (int8: the codes and their scales); what
    :data:`partition.costs.MOMENT_BYTES` plans with."""
    return 2 * MOMENT_DTYPES[rule].itemsize + (2 * 4 / BLOCK if rule == "int8" else 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Moments in a rule's storage
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Moments:
    """AdamW's m and v of some elements in one rule's storage: fp32 or bf16 tensors, or (int8) uint8 float8 codes
    (m: e4m3fn, v: e5m2) with an fp32 scale per block (``m_scale``, ``v_scale``: [blocks]). ``m`` and ``v`` are
    flat, or a parameter's shape (a checkpoint's)."""

    rule: str
    m: torch.Tensor
    v: torch.Tensor
    m_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @staticmethod
    def zeros(n: int, rule: str, device: torch.device | str = "cpu") -> "Moments":
        dtype = MOMENT_DTYPES[rule]
        m, v = torch.zeros(n, dtype=dtype, device=device), torch.zeros(n, dtype=dtype, device=device)
        if rule != "int8":
            return Moments(rule, m, v)
        return Moments(rule, m, v, torch.zeros(blocks(n), device=device), torch.zeros(blocks(n), device=device))

    @staticmethod
    def spec(n: int, rule: str) -> dict[str, tuple[int, torch.dtype]]:
        """The buffers of :meth:`zeros` by name: (elements, dtype) (round-robin's shared host memory)."""
        out = {"m": (n, MOMENT_DTYPES[rule]), "v": (n, MOMENT_DTYPES[rule])}
        if rule == "int8":
            out.update(m_scale=(blocks(n), torch.float32), v_scale=(blocks(n), torch.float32))
        return out

    @staticmethod
    def of(buffers: dict[str, torch.Tensor], rule: str, lo: int, n: int) -> "Moments":
        """Elements ``[lo, lo + n)`` of the buffers :meth:`spec` names (``lo``: a multiple of :data:`BLOCK`)."""
        whole = Moments(rule, buffers["m"], buffers["v"], buffers.get("m_scale"), buffers.get("v_scale"))
        return whole.part(lo, n)

    @property
    def numel(self) -> int:
        return self.m.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by the name a checkpoint suffixes them with: ``exp_avg``, ``exp_avg_sq`` (and, int8, their
        ``.scale``)."""
        out = {"exp_avg": self.m, "exp_avg_sq": self.v}
        if self.rule == "int8":
            out.update({"exp_avg.scale": self.m_scale, "exp_avg_sq.scale": self.v_scale})
        return out

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor]) -> "Moments":
        """:meth:`tensors` back: the rule from the moments' dtype."""
        rule = next(r for r, d in MOMENT_DTYPES.items() if d == t["exp_avg"].dtype)
        if rule != "int8":
            return Moments(rule, t["exp_avg"], t["exp_avg_sq"])
        return Moments(rule, t["exp_avg"], t["exp_avg_sq"], t["exp_avg.scale"], t["exp_avg_sq.scale"])

    def part(self, lo: int, n: int) -> "Moments":
        """A view of elements ``[lo, lo + n)`` (int8: ``lo`` a multiple of :data:`BLOCK`)."""
        m, v = self.m.reshape(-1)[lo:lo + n], self.v.reshape(-1)[lo:lo + n]
        if self.rule != "int8":
            return Moments(self.rule, m, v)
        assert lo % BLOCK == 0, f"int8 moments cut at {lo}, inside a block of {BLOCK}"
        b = lo // BLOCK
        return Moments(self.rule, m, v, self.m_scale[b:b + blocks(n)], self.v_scale[b:b + blocks(n)])

    def copy_(self, src: "Moments") -> "Moments":
        """Take ``src``'s values (the same rule and size)."""
        assert src.rule == self.rule and src.numel == self.numel, (src.rule, self.rule, src.numel, self.numel)
        for k, t in self.tensors().items():
            t.reshape(-1).copy_(src.tensors()[k].reshape(-1))
        return self

    def to(self, device: torch.device | str, shape: tuple[int, ...] | None = None) -> "Moments":
        """A copy on ``device``, m and v in ``shape`` (default: as they are)."""
        shaped = (lambda t: t.reshape(shape)) if shape is not None else (lambda t: t)
        return Moments(self.rule, shaped(self.m).to(device, copy=True), shaped(self.v).to(device, copy=True),
                       *(None if s is None else s.to(device, copy=True) for s in (self.m_scale, self.v_scale)))

    @staticmethod
    def cat(parts: list["Moments"]) -> "Moments":
        """Consecutive pieces as one (int8: every piece but the last a whole number of blocks)."""
        rule = parts[0].rule
        if rule == "int8":
            assert all(p.numel % BLOCK == 0 for p in parts[:-1]), "int8 pieces must end on block boundaries"
        cat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
        if rule != "int8":
            return Moments(rule, cat([p.m for p in parts]), cat([p.v for p in parts]))
        return Moments(rule, cat([p.m for p in parts]), cat([p.v for p in parts]), cat([p.m_scale for p in parts]),
                       cat([p.v_scale for p in parts]))

    def fp32(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, v) decoded to fp32, flat."""
        if self.rule != "int8":
            return self.m.reshape(-1).float(), self.v.reshape(-1).float()
        n = self.numel
        return (_blocked(self.m, n, torch.float8_e4m3fn, self.m_scale).reshape(-1)[:n],
                _blocked(self.v, n, torch.float8_e5m2, self.v_scale).reshape(-1)[:n])

    @staticmethod
    def from_fp32(m: torch.Tensor, v: torch.Tensor, rule: str) -> "Moments":
        """fp32 moments (flat) in ``rule``'s storage: bf16 rounded to nearest, int8 encoded block by block."""
        if rule == "fp32":
            return Moments(rule, m.float(), v.float())
        if rule == "bf16":
            return Moments(rule, m.to(torch.bfloat16), v.to(torch.bfloat16))
        n = m.numel()
        cm, sm = encode_blocks(_pad_blocks(m.float()), True)
        cv, sv = encode_blocks(_pad_blocks(v.float()), False)
        return Moments(rule, cm.reshape(-1)[:n].clone(), cv.reshape(-1)[:n].clone(), sm, sv)

    def as_rule(self, rule: str) -> "Moments":
        """These moments in ``rule``'s storage (themselves when they are in it already)."""
        return self if rule == self.rule else Moments.from_fp32(*self.fp32(), rule)


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    """Flat ``x`` as [blocks, BLOCK], zeros past its end."""
    n = x.numel()
    out = x.new_zeros(blocks(n) * BLOCK)
    out[:n] = x.reshape(-1)
    return out.view(-1, BLOCK)


def _blocked(codes: torch.Tensor, n: int, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes of ``n`` elements decoded: [blocks, BLOCK] fp32 (zeros past ``n``)."""
    return _pad_blocks(codes.reshape(-1)).view(dtype).float() * scale[:, None]


# ---------------------------------------------------------------------------------------------------------------
# The arithmetic (torch ops; the host kernel does the same, operation for operation)
# ---------------------------------------------------------------------------------------------------------------
def f32(x: float) -> float:
    """``x`` rounded to float32 (the kernel's constants)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class StepScalars:
    """One step's float32 constants, in the kernel's order: the gradient factor (clipping, loss scale), the betas
    and one minus them, the bias-corrected step size, 1 / sqrt(1 - beta2^t), eps and the weight decay's factor."""

    factor: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    inv_bias2_sqrt: float
    eps: float
    decay: float

    @staticmethod
    def of(beta1: float, beta2: float, eps: float, weight_decay: float, lr: float, t: int,
           factor: float) -> "StepScalars":
        """Step ``t`` (from 1) at learning rate ``lr``, each constant computed in double and rounded once."""
        return StepScalars(*map(f32, (factor, beta1, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** t),
                                      1 / math.sqrt(1 - beta2 ** t), eps, 1 - lr * weight_decay)))

    def array(self) -> torch.Tensor:
        return torch.tensor([self.factor, self.beta1, self.one_minus_beta1, self.beta2, self.one_minus_beta2,
                             self.step_size, self.inv_bias2_sqrt, self.eps, self.decay], dtype=torch.float32)


def adamw(k: StepScalars, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
          decay: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AdamW of fp32 tensors (any shape): the new master, m and v (one rounding per operation, none fused)."""
    g = g * k.factor
    if decay:
        p = p * k.decay
    m = m * k.beta1 + g * k.one_minus_beta1
    v = v * k.beta2 + (g * g) * k.one_minus_beta2
    d = v.double().sqrt().float() * k.inv_bias2_sqrt + k.eps  # correctly rounded (torch's CPU sqrt is not always)
    return p - (m / d) * k.step_size, m, v


M32 = 0xFFFFFFFF


def step_seed(t: int) -> int:
    """The stochastic rounding's seed of step ``t``."""
    return (t * 0x85EBCA77 + 0x165667B1) & M32


def mix(pos: torch.Tensor, seed: int) -> torch.Tensor:
    """lowbias32 of each position (int64 < 2^32) and the seed: 32 random bits per element, as int64."""
    x = ((pos * 0x9E3779B1) & M32) ^ seed  # (int64 products wrap; their low 32 bits are uint32's)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def round_bf16(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bfloat16, rounded stochastically with 16 random bits per element (int64)."""
    top = ((x.view(torch.int32).to(torch.int64) & M32) + random16) >> 16  # [0, 65536)
    return torch.where(top >= 1 << 15, top - (1 << 16), top).to(torch.int16).view(torch.bfloat16)


def encode_blocks(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks [nb, BLOCK] as uint8 float8 codes (m: e4m3fn, v: e5m2) and each block's scale (its absmax over
    the format's largest value)."""
    scale = x.abs().amax(1) / (E4M3_MAX if signed else E5M2_MAX)  # [nb]
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = (x * inv[:, None]).to(torch.float8_e4m3fn if signed else torch.float8_e5m2)
    return codes.view(torch.uint8), scale


def decode_blocks(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes [nb, BLOCK] and scales [nb] back to fp32."""
    return codes.view(torch.float8_e4m3fn if signed else torch.float8_e5m2).float() * scale[:, None]


# ---------------------------------------------------------------------------------------------------------------
# One step over a flat buffer's pieces
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of a flat buffer, all of one parameter's run (``pos``: the position of ``lo`` in its
    parameter), all taking weight decay or none."""

    lo: int
    hi: int
    pos: int
    decay: bool


def pieces(runs: list[tuple[int, int, bool]], origins: list[tuple[int, int]], a: int, b: int) -> list[Piece]:
    """The parts of ``runs`` inside ``[a, b)``, cut where a parameter begins: ``origins`` are (flat index, its
    position in its parameter) where positions restart, sorted (the first at or before every run)."""
    out: list[Piece] = []
    for lo, hi, decay in runs:
        lo, hi = max(lo, a), min(hi, b)
        for k, (start, pos) in enumerate(origins):
            end = origins[k + 1][0] if k + 1 < len(origins) else hi
            x, y = max(lo, start), min(hi, end)
            if x < y:
                out.append(Piece(x, y, pos + x - start, decay))
    return out


def check_blocks(runs: list[tuple[int, int, bool]], origins: list[tuple[int, int]]) -> None:
    """int8: every run begins on a block of its parameter, and no run ends inside a block another one shares."""
    for start, pos in origins:
        if (start - pos) % BLOCK:
            raise ValueError(f"int8 moments need parameters whose blocks of {BLOCK} start on the buffer's blocks; "
                             f"position {pos} of a parameter lies at {start}")
    ends = sorted(runs)
    for (lo, hi, _), nxt in zip(ends, ends[1:] + [None]):
        assert lo % BLOCK == 0, f"a run starts at {lo}, inside a block"
        assert nxt is None or hi % BLOCK == 0 or nxt[0] >= -(-hi // BLOCK) * BLOCK, f"runs share the block at {hi}"


class RuleUpdate:
    """The bf16 or int8 rule over one flat buffer: its pieces per block of the caller's (one kernel call each on
    the host, torch ops on a GPU or where no compiler is at hand)."""

    def __init__(self, rule: str, runs: list[tuple[int, int, bool]], origins: list[tuple[int, int]],
                 bounds: list[tuple[int, int]], device: torch.device):
        assert rule in ("bf16", "int8"), rule
        if rule == "int8":
            check_blocks(runs, origins)
        self.rule, self.device = rule, device
        self.kernel = host_kernel() if device.type == "cpu" else None
        split = [pieces(runs, origins, a, b) for a, b in bounds]
        self.tasks = [_tasks(ps) for ps in split] if self.kernel is not None else None
        self.pieces = split

    def run(self, k: int, scalars: StepScalars, t: int, master: torch.Tensor, grad: torch.Tensor,
            half: torch.Tensor | None, moments: Moments) -> None:
        """Block ``k``'s pieces (of the bounds given) at step ``t``."""
        if self.tasks is not None:
            _run_kernel(self.kernel, self.rule, self.tasks[k], scalars, t, master, grad, half, moments)
            return
        for piece in self.pieces[k]:
            for lo in range(piece.lo, piece.hi, TORCH_PIECE):
                hi = min(piece.hi, lo + TORCH_PIECE)
                cut = Piece(lo, hi, piece.pos + lo - piece.lo, piece.decay)
                (_bf16_piece if self.rule == "bf16" else _int8_piece)(scalars, t, cut, master, grad, half, moments)


def _bf16_piece(k: StepScalars, t: int, pc: Piece, master: torch.Tensor, grad: torch.Tensor,
                half: torch.Tensor | None, mo: Moments) -> None:
    """The bf16 rule over one piece, in torch ops."""
    s = slice(pc.lo, pc.hi)
    p, m, v = adamw(k, master[s], grad[s].float(), mo.m[s].float(), mo.v[s].float(), pc.decay)
    master[s] = p
    if half is not None:
        half[s] = p
    pos = torch.arange(pc.pos, pc.pos + pc.hi - pc.lo, device=master.device) & M32  # [n]
    r = mix(pos, step_seed(t))
    mo.m[s] = round_bf16(m, r >> 16)
    mo.v[s] = round_bf16(v, r & 0xFFFF)


def _int8_piece(k: StepScalars, t: int, pc: Piece, master: torch.Tensor, grad: torch.Tensor,
                half: torch.Tensor | None, mo: Moments) -> None:
    """The int8 rule over one piece (starting on a block), in torch ops: the whole blocks as [nb, BLOCK] views, a
    last short block padded with zeros."""
    full = pc.lo + (pc.hi - pc.lo) // BLOCK * BLOCK
    for lo, hi in ((pc.lo, full), (full, pc.hi)):
        if lo == hi:
            continue
        b0, nb = lo // BLOCK, blocks(hi - lo)
        view = (lambda x: x[lo:hi].view(-1, BLOCK)) if (hi - lo) % BLOCK == 0 else (lambda x: _pad_blocks(x[lo:hi]))
        m = decode_blocks(view(mo.m), mo.m_scale[b0:b0 + nb], True)  # [nb, BLOCK]
        v = decode_blocks(view(mo.v), mo.v_scale[b0:b0 + nb], False)
        p, m, v = adamw(k, view(master), view(grad).float(), m, v, pc.decay)
        cm, sm = encode_blocks(m, True)
        cv, sv = encode_blocks(v, False)
        n = hi - lo
        master[lo:hi] = p.reshape(-1)[:n]
        if half is not None:
            half[lo:hi] = p.reshape(-1)[:n]
        mo.m[lo:hi], mo.v[lo:hi] = cm.reshape(-1)[:n], cv.reshape(-1)[:n]
        mo.m_scale[b0:b0 + nb], mo.v_scale[b0:b0 + nb] = sm, sv


# ---------------------------------------------------------------------------------------------------------------
# The host kernel
# ---------------------------------------------------------------------------------------------------------------
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def host_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (None, said once, when it cannot be built here)."""
    from mobius.kernels import adamw_states

    return adamw_states()


def _tasks(ps: list[Piece]) -> torch.Tensor:
    """Pieces cut into tasks of at most :data:`TASK_NUMEL` elements (a multiple of :data:`BLOCK`): [n, 4] int64 of
    (lo, hi, position of lo, decay)."""
    rows = [(lo, min(p.hi, lo + TASK_NUMEL), p.pos + lo - p.lo, int(p.decay))
            for p in ps for lo in range(p.lo, p.hi, TASK_NUMEL)]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 4)


_pools = threading.local()  # per calling thread (its helpers start from it: they share its CPU affinity)


def _helpers(n: int) -> ThreadPoolExecutor | None:
    """``n`` helper threads of the calling thread (None for none)."""
    if n <= 0:
        return None
    pool, size = getattr(_pools, "pool", None), getattr(_pools, "size", 0)
    if pool is None or size != n:
        if pool is not None:
            pool.shutdown(wait=False)
        pool = _pools.pool = ThreadPoolExecutor(n, thread_name_prefix="adamw-states")
        _pools.size = n
    return pool


def _run_kernel(lib: ctypes.CDLL, rule: str, tasks: torch.Tensor, k: StepScalars, t: int, master: torch.Tensor,
                grad: torch.Tensor, half: torch.Tensor | None, mo: Moments) -> None:
    """The kernel over ``tasks`` on ``torch.get_num_threads()`` threads: the caller and helpers of its own, each
    taking tasks from one counter (no thread waits on another's share)."""
    if tasks.shape[0] == 0:
        return
    assert master.is_contiguous() and grad.is_contiguous() and (half is None or half.is_contiguous())
    scalars, counter = k.array(), torch.zeros(1, dtype=torch.int64)
    ptr = lambda x: None if x is None else x.data_ptr()  # noqa: E731
    args = (1 if rule == "bf16" else 2, DTYPE_CODES[grad.dtype], -1 if half is None else DTYPE_CODES[half.dtype],
            counter.data_ptr(), scalars.data_ptr(), master.data_ptr(), grad.data_ptr(), ptr(half), mo.m.data_ptr(),
            mo.v.data_ptr(), ptr(mo.m_scale), ptr(mo.v_scale), tasks.data_ptr(), tasks.shape[0], step_seed(t))
    threads = max(1, min(torch.get_num_threads(), tasks.shape[0]))
    pool = _helpers(threads - 1)
    helpers = [pool.submit(lib.mobius_adamw_states, *args) for _ in range(threads - 1)] if pool else []
    codes = [lib.mobius_adamw_states(*args)] + [h.result() for h in helpers]
    if any(codes):
        raise RuntimeError(f"the AdamW states kernel refused {rule} with gradients in {grad.dtype} and half copy "
                           f"{None if half is None else half.dtype}")
