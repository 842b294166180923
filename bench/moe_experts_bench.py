"""One MoE layer's expert compute on a GPU, forward and forward + backward, bf16: mobius's grouped matmuls
(tokens sorted by expert, one ``torch._grouped_mm`` per projection), mobius's loop over the experts that have
tokens (one matmul each, the CPU's path), and transformers' own experts modules (its default loop, and its
``grouped_mm`` implementation where this version has one), at Qwen3-30B-A3B's, GPT-OSS-20B's and Mixtral-8x7B's
widths, with the tokens routed evenly (a random router) and skewed (an eighth of the experts favoured). Each
implementation's output is compared with mobius's loop (max |difference|, bf16).

    python bench/moe_experts_bench.py --out runs/moe               # on a GPU (about 2-3 min on one H100)
    python bench/moe_experts_bench.py --smoke --out /tmp/moe       # tiny widths on the CPU: checks the script

Nothing here has run on a GPU yet (written in a session without one); ``bench/gpu_suite.py --parts moe`` runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mobius.models import experts as moe  # noqa: E402


@dataclass(frozen=True)
class Layer:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    family: str  # "qwen3_moe" | "gpt_oss" | "mixtral": which transformers module and layout


LAYERS = [Layer("qwen3-30b-a3b", 2048, 768, 128, 8, "qwen3_moe"), Layer("gpt-oss-20b", 2880, 2880, 32, 4, "gpt_oss"),
          Layer("mixtral-8x7b", 4096, 14336, 8, 2, "mixtral")]
SMOKE = [Layer("tiny-qwen", 64, 32, 8, 2, "qwen3_moe"), Layer("tiny-gpt-oss", 64, 32, 4, 2, "gpt_oss")]


def mobius_experts(layer: Layer, device: torch.device, dtype: torch.dtype) -> moe.Experts:
    oss = layer.family == "gpt_oss"
    shape = moe.ExpertShape(layer.experts, layer.hidden, layer.inter, transposed=oss, bias=oss,
                            activation="clamped_swiglu" if oss else "silu")
    module = moe.Experts(shape).to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)
    return module


def transformers_experts(layer: Layer, ours: moe.Experts, implementation: str | None):
    """transformers' experts module of the layer's family, with mobius's weights (None: not in this version)."""
    import transformers

    config = {"qwen3_moe": lambda: transformers.Qwen3MoeConfig(hidden_size=layer.hidden,
                                                                moe_intermediate_size=layer.inter,
                                                                num_experts=layer.experts),
              "mixtral": lambda: transformers.MixtralConfig(hidden_size=layer.hidden, intermediate_size=layer.inter,
                                                            num_local_experts=layer.experts),
              "gpt_oss": lambda: transformers.GptOssConfig(hidden_size=layer.hidden, intermediate_size=layer.inter,
                                                           num_local_experts=layer.experts)}[layer.family]()
    config._experts_implementation = implementation
    module_of = {"qwen3_moe": "qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts",
                 "mixtral": "mixtral.modeling_mixtral.MixtralExperts",
                 "gpt_oss": "gpt_oss.modeling_gpt_oss.GptOssExperts"}[layer.family]
    path, cls = module_of.rsplit(".", 1)
    import importlib

    try:
        module = getattr(importlib.import_module(f"transformers.models.{path}"), cls)(config)
    except (KeyError, ValueError, AttributeError):
        return None
    module = module.to(device=ours.gate_up_proj.device, dtype=ours.gate_up_proj.dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(getattr(ours, name))
    return module


def routing(layer: Layer, tokens: int, skewed: bool, device: torch.device, dtype: torch.dtype) -> moe.Routing:
    """A router's choice: random logits (even), or with an eighth of the experts favoured by 2 (skewed)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(tokens, layer.experts, generator=g)
    if skewed:
        logits[:, :max(1, layer.experts // 8)] += 2.0
    kind = "topk_softmax" if layer.family == "gpt_oss" else "softmax_topk"
    r = moe.route(logits.to(device), layer.top_k, kind, layer.family == "mixtral", False)
    return moe.Routing(r.weights.to(dtype), r.experts, r.probs)


def timed(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of ``fn``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def candidates(layer: Layer, ours: moe.Experts, device: torch.device, smoke: bool) -> dict:
    """name -> (x [N, H], routing) -> [N, H]."""
    def kernel(name: str):
        def run(x, r):
            moe.KERNEL = name
            try:
                return ours(x, r)
            finally:
                moe.KERNEL = "auto"
        return run

    out = {"mobius-loop": kernel("loop")}
    if device.type == "cuda" or smoke:
        out["mobius-grouped"] = kernel("grouped")
    for impl in ("eager", "grouped_mm"):
        theirs = transformers_experts(layer, ours, impl)
        if theirs is not None:
            out[f"transformers-{impl}"] = lambda x, r, m=theirs: m(x, r.experts, r.weights)
    return out


def measure(layer: Layer, tokens: int, skewed: bool, device: torch.device, dtype: torch.dtype, reps: int,
            warmup: int, smoke: bool) -> list[dict]:
    ours = mobius_experts(layer, device, dtype)
    r = routing(layer, tokens, skewed, device, dtype)
    x = torch.randn(tokens, layer.hidden, device=device, dtype=dtype)
    reference = candidates(layer, ours, device, smoke)["mobius-loop"](x, r).float()
    busiest = float(torch.bincount(r.experts.flatten(), minlength=layer.experts).max()) / (tokens * layer.top_k)
    rows = []
    for name, fn in candidates(layer, ours, device, smoke).items():
        row = {"layer": layer.name, "tokens": tokens, "routing": "skewed" if skewed else "even",
               "busiest_share": round(busiest, 4), "impl": name}
        try:
            with torch.no_grad():
                row["max_abs_diff"] = float((fn(x, r).float() - reference).abs().max())
                row["fwd_ms"] = round(timed(lambda: fn(x, r), device, reps, warmup), 3)
            xg = x.detach().requires_grad_()
            backward = name != "mobius-grouped" or device.type == "cuda"  # (the CPU's grouped matmul has no backward)
            if backward:
                row["fwd_bwd_ms"] = round(timed(lambda: fn(xg, r).float().square().mean().backward(), device, reps,
                                                warmup), 3)
        except Exception as e:  # an implementation this torch or transformers cannot run here: said, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out/moe")
    ap.add_argument("--smoke", action="store_true", help="tiny widths on the CPU, fp32")
    ap.add_argument("--tokens", default="2048,8192", help="tokens per layer call (micro-batch x sequence)")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layers, tokens = (SMOKE, [64]) if a.smoke else (LAYERS, [int(t) for t in a.tokens.split(",")])
    reps, warmup = (2, 1) if a.smoke else (a.reps, 3)
    rows = []
    for layer in layers:
        for n in tokens:
            for skewed in (False, True):
                rows += measure(layer, n, skewed, device, dtype, reps, warmup, a.smoke)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    (out / "moe_experts.json").write_text(json.dumps({"device": device_name, "torch": torch.__version__,
                                                      "moe_rows": rows}, indent=1))


if __name__ == "__main__":
    main()
