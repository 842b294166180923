"""Attention over packed documents: which kernel, at what time and memory.

Rows of ``--seqs`` positions hold documents of about ``--doc-tokens`` each (lengths drawn between half and
one and a half of it, seeded); each kernel runs forward and backward of one attention call and is checked
against attending to each document alone (one causal SDPA call per document: ``per_doc``)::

    python bench/packed_attention_bench.py                       # this machine's device (CPU: fp32, 8 x 64 heads)
    python bench/packed_attention_bench.py --device cuda --out bench_out/packing

Peak memory: CUDA's allocator on a GPU, the process's resident peak on the CPU (Linux). Kernels: ``causal`` (SDPA over the whole row: the cost without documents, and *not* equal: it attends across
them), ``per_doc``, ``dense`` (SDPA with a [B, 1, T, T] boolean block-diagonal mask), ``varlen`` (flash
attention over cumulative document lengths: CUDA, half precision) and ``flex`` (``torch.compile``'d flex
attention with a document block mask: CUDA; on the CPU it has no backward). The last three are what
:mod:`mobius.models.packing` can pick. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mobius.models.packing import Documents, sdpa  # noqa: E402

KERNELS = ("causal", "per_doc", "dense", "varlen", "flex")


def document_lengths(seq: int, doc: int, rows: int, seed: int = 0) -> torch.Tensor:
    """[rows, D] lengths summing to ``seq`` per row, each between doc/2 and 3doc/2 (the last what is left)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        row, left = [], seq
        while left > 0:
            n = min(left, int(torch.randint(max(1, doc // 2), doc + doc // 2 + 1, (1,), generator=g)))
            row.append(n)
            left -= n
        out.append(row)
    width = max(map(len, out))
    return torch.tensor([r + [0] * (width - len(r)) for r in out], dtype=torch.int32)


def attend(kernel: str, q, k, v, lengths: torch.Tensor, groups: int):
    """One attention call of ``kernel`` over the packed rows (the documents' masks made inside, as per micro-batch)."""
    if kernel == "causal":
        return sdpa(q, k, v, 0.0, None, groups)
    if kernel == "flex":
        return _flex(q, k, v, Documents(lengths, q.device), groups)
    return Documents(lengths, q.device, kernel).attend(q, k, v, 0.0, None, groups)


_COMPILED = {}


def _flex(q, k, v, docs: Documents, groups: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "flex" not in _COMPILED:
        _COMPILED["flex"] = torch.compile(flex_attention)
    seg = docs.segment  # [B, T]

    def same_document(b, h, qi, ki):
        return (seg[b, qi] == seg[b, ki]) & (qi >= ki)

    B, _, T, _ = q.shape
    mask = create_block_mask(same_document, B, None, T, T, device=q.device)
    return _COMPILED["flex"](q, k, v, block_mask=mask, enable_gqa=groups > 1)


def measure(kernel: str, seq: int, args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> dict:
    """Median seconds of forward + backward, peak memory above the inputs, and the largest difference from
    ``per_doc``."""
    g = torch.Generator(device="cpu").manual_seed(1)
    B, nh, nkv, hd = args.rows, args.heads, args.kv_heads, args.head_dim
    make = lambda h: torch.randn(B, h, seq, hd, generator=g).to(dev, dtype).requires_grad_()  # noqa: E731
    q, k, v = make(nh), make(nkv), make(nkv)
    lengths = document_lengths(seq, args.doc_tokens, B)
    groups = nh // nkv
    ref = attend("per_doc", q, k, v, lengths, groups).detach().float()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step():
        out = attend(kernel, q, k, v, lengths, groups)
        out.sum().backward()
        return out

    out = step()  # warm-up (compiles flex)
    diff = float((out.detach().float() - ref).abs().max())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else _host_peak(reset=True)
    times = []
    for _ in range(args.reps):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _host_peak()) - base
    return {"kernel": kernel, "seq": seq, "documents": int((lengths > 0).sum()) / B, "ms": 1e3 * statistics.median(times),
            "peak_mib": peak / 2**20, "max_diff_vs_per_doc": diff}


def _host_peak(reset: bool = False) -> int:
    """This process's peak resident bytes since the last reset (Linux: ``/proc/self/clear_refs``); with
    ``reset``, what it holds now."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    key = "VmRSS" if reset else "VmHWM"
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024


def available(kernel: str, dev: torch.device, dtype: torch.dtype) -> str:
    """Why ``kernel`` cannot run here ("" when it can)."""
    if kernel == "varlen" and (dev.type != "cuda" or dtype == torch.float32):
        return "CUDA and half precision only"
    if kernel == "flex" and dev.type != "cuda":
        return "no backward on the CPU"
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto")
    p.add_argument("--seqs", default="512,2048,4096,8192")
    p.add_argument("--doc-tokens", type=int, default=400, help="about this many tokens per document")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="query heads (default: 32 on CUDA, 8 on the CPU)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads / 4)")
    p.add_argument("--head-dim", type=int, default=None, help="(default: 128 on CUDA, 64 on the CPU)")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out/packed_attention"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes (checks the script)")
    args = p.parse_args()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cuda = dev.type == "cuda"
    args.heads = args.heads or (32 if cuda else 8)
    args.kv_heads = args.kv_heads or args.heads // 4
    args.head_dim = args.head_dim or (128 if cuda else 64)
    seqs = [256] if args.smoke else [int(s) for s in args.seqs.split(",")]
    if args.smoke:
        args.reps, args.doc_tokens = 1, 64
    rows = []
    for seq in seqs:
        for kernel in args.kernels.split(","):
            why = available(kernel, dev, dtype)
            rows.append({"kernel": kernel, "seq": seq, "skipped": why} if why else measure(kernel, seq, args, dev,
                                                                                          dtype))
    print(f"packed attention, {dev} {str(dtype).split('.')[-1]}, {args.rows} row(s), {args.heads} query / "
          f"{args.kv_heads} kv heads of {args.head_dim}, documents of about {args.doc_tokens} tokens")
    print("| T | kernel | documents | fwd+bwd ms | peak MiB | max diff vs per_doc |\n|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['seq']} | {r['kernel']} | | {r['skipped']} | | |")
            continue
        print(f"| {r['seq']} | {r['kernel']} | {r['documents']:.1f} | {r['ms']:.2f} | {r['peak_mib']:.1f} | "
              f"{r['max_diff_vs_per_doc']:.2e} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "dtype": str(dtype), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    (out / "packed_attention.json").write_text(json.dumps({**meta, "kernels": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
