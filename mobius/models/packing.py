"""Causal attention and positions over rows that hold several documents (packed conversations).

A micro-batch's ``docs`` (:class:`mobius.batch.MicroBatch`) gives each row's document lengths; a
:class:`Documents` made from them on the device of the activations (once per micro-batch and stage,
shared by every layer) gives the positions, which start again at each document, and attends within
each document only. Without documents (plain text), attention is causal over the whole row.

Kernels (``KERNELS``), one chosen per device by :func:`pick_kernel`, every one equal to attending
to each document alone:

* ``varlen``: flash attention over the rows' documents laid end to end (``torch.nn.attention.varlen``;
  CUDA, half precision, no attention dropout): no mask at all, work proportional to the sum of the
  documents' squared lengths;
* ``per_doc``: one causal SDPA call per document (any device): no mask either, a kernel launch per
  document and layer;
* ``dense``: SDPA with a boolean block-diagonal causal mask [B, 1, T, T]: one call, but the mask's
  memory and the full T x T work.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

Kernel = Literal["varlen", "per_doc", "dense"]
KERNELS: tuple[Kernel, ...] = ("varlen", "per_doc", "dense")
GQA_IN_SDPA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scale: float | None, groups: int,
         mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, nh, T, hd] over k, v [B, nkv, T, hd] (each kv head serves ``groups`` q heads):
    causal, or under ``mask`` (bool [B, 1, T, T], True where a query may look)."""
    causal = mask is None
    if groups > 1 and not GQA_IN_SDPA:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, nh, T, hd]
        groups = 1
    extra = {"enable_gqa": True} if groups > 1 else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=scale,
                                          **extra)


@functools.lru_cache(maxsize=None)
def varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def pick_kernel(device: torch.device, dtype: torch.dtype, dropout: float) -> Kernel:
    """The kernel for packed documents on ``device``: varlen flash attention where it runs (CUDA, half
    precision, no dropout), else one SDPA call per document (docs/packing.md has the measurements)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and dropout == 0.0 and varlen_available():
        return "varlen"
    return "per_doc"


class Documents:
    """Each row's documents on one device. ``lengths`` [B, D] (zero after a row's last document; each row
    sums to T)."""

    def __init__(self, lengths: torch.Tensor, device: torch.device | str, kernel: Kernel | None = None):
        """``lengths``: a micro-batch's ``docs`` in host memory (the kernels' loop bounds need no device sync)."""
        self.rows = [[n for n in row if n > 0] for row in lengths.tolist()]
        self.lengths = lengths.to(device=device, dtype=torch.int64)
        self.seq = sum(self.rows[0])
        assert all(sum(r) == self.seq for r in self.rows), self.rows
        self.kernel = kernel  # None: pick_kernel at the first attention

    @functools.cached_property
    def segment(self) -> torch.Tensor:
        """[B, T] int64: the index of the document each position belongs to."""
        B, D = self.lengths.shape
        ids = torch.arange(D, device=self.lengths.device).expand(B, D)
        flat = torch.repeat_interleave(ids.reshape(-1), self.lengths.reshape(-1), output_size=B * self.seq)  # (no
        # device-to-host sync for the output's size on a GPU)
        return flat.view(B, self.seq)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """[B, T] int64: each position's offset in its document (0 at every document's first token)."""
        starts = torch.cumsum(self.lengths, dim=1) - self.lengths  # [B, D]
        pos = torch.arange(self.seq, device=self.lengths.device).expand(self.lengths.shape[0], self.seq)
        return pos - torch.gather(starts, 1, self.segment)

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, T, T] bool: a query sees the keys of its own document up to itself."""
        seg = self.segment
        same = seg[:, :, None] == seg[:, None, :]  # [B, T, T]
        return (same & torch.ones(self.seq, self.seq, dtype=torch.bool, device=seg.device).tril())[:, None]

    @functools.cached_property
    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """Cumulative document starts over the rows laid end to end [N + 1] int32, and the longest document."""
        flat = [n for row in self.rows for n in row]
        cu = torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()], dtype=torch.int32, device=self.lengths.device)
        return cu, max(flat)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scale: float | None,
               groups: int) -> torch.Tensor:
        """Causal attention within each document: q [B, nh, T, hd], k, v [B, nkv, T, hd] -> [B, nh, T, hd]."""
        kernel = self.kernel or pick_kernel(q.device, q.dtype, dropout)
        if kernel == "dense":
            return sdpa(q, k, v, dropout, scale, groups, self.mask)
        if kernel == "varlen":
            return self._varlen(q, k, v, scale, groups)
        rows = []
        for b, row in enumerate(self.rows):
            parts, start = [], 0
            for n in row:
                s = slice(start, start + n)
                parts.append(sdpa(q[b:b + 1, :, s], k[b:b + 1, :, s], v[b:b + 1, :, s], dropout, scale, groups))
                start += n
            rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])  # [1, nh, T, hd]
        return torch.cat(rows, dim=0)

    def _varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                groups: int) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        B, nh, T, hd = q.shape
        flat = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], hd)  # noqa: E731  [B*T, heads, hd]
        cu, longest = self.cu_seqlens
        y = varlen_attn(flat(q), flat(k), flat(v), cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
                        enable_gqa=groups > 1)  # [B*T, nh, hd]
        return y.view(B, T, nh, hd).transpose(1, 2)


def even_documents(seq: int, doc_tokens: int | None) -> list[int]:
    """A row of ``seq`` positions as documents of ``doc_tokens`` each, the last one what is left (``[seq]`` for
    None): the layout a planner profiles packed rows with."""
    if doc_tokens is None or doc_tokens >= seq:
        return [seq]
    full, rest = divmod(seq, doc_tokens)
    return [doc_tokens] * full + ([rest] if rest else [])


def attended_pairs(seq: int, doc_tokens: int | None) -> int:
    """Query-key pairs of causal attention over such a row, both triangles' halves counted whole (sum of the
    documents' squared lengths; seq ** 2 for one document): what attention's FLOPs scale with."""
    return sum(n * n for n in even_documents(seq, doc_tokens))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents | None, dropout: float,
                     scale: float | None = None, groups: int = 1) -> torch.Tensor:
    """Causal attention of q [B, nh, T, hd] over k, v [B, nkv, T, hd]: over the whole row, or within each
    document of ``docs``."""
    if docs is None:
        return sdpa(q, k, v, dropout, scale, groups)
    return docs.attend(q, k, v, dropout, scale, groups)


def positions(docs: Documents | None, seq: int, device: torch.device) -> torch.Tensor:
    """Position ids: [T] 0..T-1 for a plain row, [B, T] restarting at each document."""
    return torch.arange(seq, device=device) if docs is None else docs.positions
