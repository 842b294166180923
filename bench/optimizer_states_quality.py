"""How the optimizer states' rules (train.optimizer_states: fp32, bf16, int8) train, measured.

1. Tracking: AdamW's second moment kept by each candidate storage against fp32, for gradients whose scale spreads
   over ~4 decades inside a block and drops 10x halfway, at beta2 0.95 and 0.999 -- the measurement that chose
   stochastic rounding for bf16 (round to nearest leaves v too large once gradients shrink) and float8 e5m2 for
   int8's v (e4m3's range, torchao's AdamWFp8, and bitsandbytes' dynamic map flush small v to zero, and their
   updates become m / eps). Fast (a few seconds).
2. Loss curves of the three rules on the same runs: the CPU demo (``configs/demo.yaml``, GPT-2 tiny from scratch)
   and a LoRA run of a small Llama (``llama-tiny`` trained from scratch first, fp32, then rank-8 adapters on every
   linear layer trained with each rule); bf16 with round-to-nearest beside them (the measurement, not a rule).
   Each run's evaluation losses and its final evaluation against fp32's.

    python bench/optimizer_states_quality.py                  # both (about an hour on a busy 2-core VM)
    python bench/optimizer_states_quality.py --tracking-only
    python bench/optimizer_states_quality.py --demo-steps 600 --lora-steps 300 --out bench_out

Writes ``<out>/optimizer_states_quality.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import OUT  # noqa: E402
from mobius import states  # noqa: E402
from mobius.config import load_config  # noqa: E402

RULES = ("fp32", "bf16", "int8", "bf16-nearest")


# ---- 1. tracking ---------------------------------------------------------------------------------------------
def _blockwise(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x (a multiple of 64 elements) through a blockwise 8-bit storage and back: float8 formats scaled by the
    block's absmax, or bitsandbytes' dynamic (tree) map of nearest codes (Dettmers et al. 2022)."""
    b = x.view(-1, states.BLOCK)
    amax = b.abs().amax(1, keepdim=True)
    if fmt == "dynamic":
        inv = torch.where(amax > 0, 1.0 / amax, torch.zeros_like(amax))
        return (DYNAMIC[torch.searchsorted(DYNAMIC_MIDS, (b * inv).contiguous())] * amax).view(-1)
    dtype, top = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}[fmt]
    scale = amax / top
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return ((b * inv).to(dtype).float() * scale).view(-1)


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' unsigned dynamic map: 2^(i+1) linear steps in each decade 10^(i-6) (i < 7), 0 and 1."""
    vals = [0.0, 1.0]
    for i in range(7):
        n, s = 2 ** (i + 1), 10.0 ** (i - 6)
        vals += [s * (0.1 + (j + 0.5) * 0.9 / n) for j in range(n)]
    return torch.tensor(sorted(vals))


DYNAMIC = _dynamic_map()
DYNAMIC_MIDS = (DYNAMIC[1:] + DYNAMIC[:-1]) / 2


def _sr(x: torch.Tensor, t: int) -> torch.Tensor:
    return states.round_bf16(x, states.mix(torch.arange(x.numel()), states.step_seed(t)) & 0xFFFF).float()


STORES: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "bf16, round to nearest": lambda x, t: x.to(torch.bfloat16).float(),
    "bf16, stochastic (the rule)": _sr,
    "8-bit e4m3 (torchao AdamWFp8)": lambda x, t: _blockwise(x, "e4m3"),
    "8-bit dynamic map (bitsandbytes)": lambda x, t: _blockwise(x, "dynamic"),
    "8-bit e5m2 (the int8 rule's v)": lambda x, t: _blockwise(x, "e5m2"),
}


def tracking(n: int = 64 * 1024, steps: int = 2000) -> list[dict]:
    """v stored by each storage against fp32's after ``steps`` steps (gradients 10x smaller in the second half):
    its mean ratio, mean relative error, the share of v flushed to zero where fp32's is not, and the relative error
    of the last 200 steps' updates m / sqrt(v) (m in fp32 here: v's part alone)."""
    rows = []
    for beta2 in (0.95, 0.999):
        g0 = torch.Generator().manual_seed(0)
        spread = torch.exp(torch.randn(n, generator=g0) * 1.5)  # per-element scale: ~4 decades within a block
        for name, store in STORES.items():
            g = torch.Generator().manual_seed(1)
            m = v32 = vq = torch.zeros(n)
            err = []
            for t in range(1, steps + 1):
                grad = (torch.randn(n, generator=g) * 0.5 + 0.3) * spread * (1.0 if t <= steps // 2 else 0.1)
                m = 0.9 * m + 0.1 * grad
                v32 = beta2 * v32 + (1 - beta2) * grad * grad
                vq = beta2 * vq + (1 - beta2) * grad * grad
                if t > steps - 200:
                    u32, uq = m / (v32.sqrt() + 1e-8), m / (vq.sqrt() + 1e-8)
                    err.append(((uq - u32).abs().mean() / u32.abs().mean()).item())
                vq = store(vq, t)
            rows.append({"beta2": beta2, "storage": name, "v_ratio": (vq / v32).mean().item(),
                         "v_rel_err": ((vq / v32) - 1).abs().mean().item(),
                         "v_zero_share": (vq == 0).float().mean().item(),
                         "update_rel_err": sum(err) / len(err)})
    return rows


def print_tracking(rows: list[dict]) -> None:
    print("v kept by each storage against fp32 (gradients spread over ~4 decades in a block, 10x smaller halfway; "
          "2000 steps, beta1 0.9)")
    print(f"{'beta2':>6}  {'storage':<34} {'mean v/v32':>10} {'mean |err|':>10} {'v flushed':>10} {'update err':>10}")
    for r in rows:
        print(f"{r['beta2']:>6}  {r['storage']:<34} {r['v_ratio']:>10.3f} {r['v_rel_err']:>10.3f} "
              f"{100 * r['v_zero_share']:>9.2f}% {100 * r['update_rel_err']:>9.2f}%")


# ---- 2. loss curves ------------------------------------------------------------------------------------------
def _nearest(x: torch.Tensor, random16: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


@contextlib.contextmanager
def rule(name: str) -> Iterator[list[str]]:
    """The overrides of one rule; "bf16-nearest": the bf16 rule with its stochastic rounding replaced by round to
    nearest (torch ops, the measurement that chose it)."""
    if name != "bf16-nearest":
        yield [f"--train.optimizer_states={name}"]
        return
    kernel, rounding = states.host_kernel, states.round_bf16
    states.host_kernel, states.round_bf16 = (lambda: None), _nearest
    try:
        yield ["--train.optimizer_states=bf16"]
    finally:
        states.host_kernel, states.round_bf16 = kernel, rounding


def train_run(config: str, overrides: list[str], out: Path) -> dict:
    """One single-mode run on the CPU; its per-step losses and evaluations (from metrics.jsonl)."""
    from mobius.app.run import train

    cfg = load_config(config, [*overrides, f"--output.dir={out}", "--output.plot=false", "--parallel.mode=single",
                               "--parallel.device=cpu"])
    t0 = time.perf_counter()
    train(cfg, overwrite=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"losses": [r["loss"] for r in rows], "evals": {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r},
            "seconds": time.perf_counter() - t0}


def curves(name: str, config: str, overrides: list[str], out: Path) -> dict:
    """Each rule's run of one setting."""
    got = {}
    for r in RULES:
        with rule(r) as extra:
            got[r] = train_run(config, [*overrides, *extra], out / name / r)
        print(f"  {name} {r}: final eval loss {list(got[r]['evals'].values())[-1]:.4f} ({got[r]['seconds']:.0f} s)",
              flush=True)
    return got


def print_curves(name: str, got: dict) -> None:
    steps = list(got["fp32"]["evals"])
    print(f"\n{name}: evaluation loss by step (held-out blocks), and the last 50 steps' mean training loss")
    print(f"{'rule':<14}" + "".join(f"{s:>9}" for s in steps) + f"{'last 50':>9}{'vs fp32':>9}")
    base = got["fp32"]["evals"][steps[-1]]
    for r, run in got.items():
        tail = sum(run["losses"][-50:]) / len(run["losses"][-50:])
        final = run["evals"][steps[-1]]
        print(f"{r:<14}" + "".join(f"{run['evals'][s]:>9.4f}" for s in steps) + f"{tail:>9.4f}"
              f"{100 * (final / base - 1):>8.2f}%")


def lora_setting(out: Path, base_steps: int, lora_steps: int, cache: str) -> tuple[str, list[str]]:
    """A small Llama to adapt: llama-tiny trained from scratch on the stdlib docs (fp32 states), its final
    checkpoint; and the LoRA run's overrides over the demo config."""
    base = out / "lora" / "base"
    common = [f"--data.cache_dir={cache}", "--model.preset=null", "--train.eval_every=50", "--train.warmup_steps=20"]
    if not (base / "final" / "config.json").is_file():
        train_run(str(ROOT / "configs/demo.yaml"), [*common, "--model.preset=llama-tiny",
                                                    f"--train.max_steps={base_steps}"], base)
    return str(ROOT / "configs/demo.yaml"), [*common, f"--model.checkpoint={base / 'final'}",
                                             f"--train.max_steps={lora_steps}", "--train.lr=1e-3",
                                             "--lora.rank=8", "--lora.alpha=16"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tracking-only", action="store_true")
    p.add_argument("--demo-steps", type=int, default=600)
    p.add_argument("--base-steps", type=int, default=400, help="llama-tiny's training before the LoRA runs")
    p.add_argument("--lora-steps", type=int, default=300)
    p.add_argument("--out", default=OUT)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out) / "optimizer_states_quality"
    out.mkdir(parents=True, exist_ok=True)
    result = {"tracking": tracking()}
    print_tracking(result["tracking"])
    if not args.tracking_only:
        cache = str(out / "cache")
        demo = [f"--data.cache_dir={cache}", f"--train.max_steps={args.demo_steps}"]
        result["demo"] = curves("demo", str(ROOT / "configs/demo.yaml"), demo, out)
        print_curves("CPU demo (configs/demo.yaml, GPT-2 tiny from scratch)", result["demo"])
        config, lora = lora_setting(out, args.base_steps, args.lora_steps, cache)
        result["lora"] = curves("lora", config, lora, out)
        print_curves("LoRA rank 8 on every linear layer of llama-tiny (trained from scratch first)", result["lora"])
    (Path(args.out) / "optimizer_states_quality.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
