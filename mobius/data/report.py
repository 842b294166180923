"""What ``mobius data`` prints: a few records as they train, the targets marked, and the data's totals."""

from __future__ import annotations

import numpy as np

from mobius.data.cache import ChatCache
from mobius.data.pack import ChatBlocks, TextBlocks
from mobius.data.sampler import DataStats, TrainData
from mobius.data.tokenizer import TextTokenizer

MARKS = ("⟦", "⟧")  # around target text when not coloured
COLOUR = ("\033[1;32m", "\033[0m")  # bold green on a terminal
TEXT_SHOWN = 400  # characters of a text block shown


def report(data: TrainData, tokenizer: TextTokenizer, source: str, show: int, colour: bool) -> str:
    """``show`` records (conversations: the first ones read; text: the first training blocks) with their targets
    marked, then the totals."""
    marks = COLOUR if colour else MARKS
    parts = []
    if isinstance(data.train, ChatBlocks):
        cache = data.train.cache
        parts += [_conversation(cache, r, tokenizer, marks) for r in range(min(show, len(cache)))]
    elif isinstance(data.train, TextBlocks):
        for b in range(min(show, len(data.train))):
            ids = np.asarray(data.train.get(np.array([b])).inputs[0])
            text = _decode(tokenizer, ids)
            more = f" ... ({len(text) - TEXT_SHOWN:,} more characters)" if len(text) > TEXT_SHOWN else ""
            parts.append(f"── training block {b}: {len(ids)} tokens, every one a target\n"
                         f"{marks[0]}{text[:TEXT_SHOWN]}{marks[1]}{more}")
    return "\n\n".join(parts + [totals(data.stats, source)])


def _conversation(cache: ChatCache, r: int, tokenizer: TextTokenizer, marks: tuple[str, str]) -> str:
    """Conversation ``r`` decoded run by run (targets between ``marks``) under a line saying where it was read."""
    start, end = int(cache.starts[r]), int(cache.starts[r + 1])
    ids, flags = np.asarray(cache.tokens[start:end]), np.asarray(cache.targets[start:end], dtype=bool)
    cuts = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1  # where a run of targets or non-targets begins
    text = []
    for run in np.split(np.arange(len(ids)), cuts):
        piece = _decode(tokenizer, ids[run])
        text.append(f"{marks[0]}{piece}{marks[1]}" if flags[run[0]] else piece)
    return f"── {cache.where(r)}: {len(ids)} tokens, {int(flags.sum())} targets\n" + "".join(text)


def _decode(tokenizer: TextTokenizer, ids: np.ndarray) -> str:
    return tokenizer.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def totals(stats: DataStats, source: str) -> str:
    """The data's totals, one per line."""
    blocks = f"{stats.train_blocks:,} training + {stats.val_blocks:,} held out, of {stats.seq_len:,} positions"
    share = stats.target_tokens / max(1, stats.tokens)
    lines = [f"data: {source} ({stats.format}" + (f", template {stats.template}, train_on={stats.train_on}"
                                                   if stats.format == "chat" else "") + ")",
             f"  records             {_count(stats.records)}"]
    if stats.format == "chat":
        packing = "packed (best-fit decreasing)" if stats.packing else "one conversation per block, padded"
        lines += [f"  conversations       {stats.conversations:,} in blocks",
                  f"  tokens              {stats.tokens:,}",
                  f"  target tokens       {stats.target_tokens:,} ({100 * share:.1f}%)",
                  f"  blocks              {blocks}, {packing}",
                  f"  packing efficiency  {100 * stats.efficiency:.1f}% (conversation positions / blocks x seq_len; "
                  f"no packing takes fewer than {stats.fewest_blocks:,} blocks)"]
    else:
        lines += [f"  tokens              {stats.tokens:,}",
                  f"  target tokens       {stats.target_tokens:,} (every token of the blocks)",
                  f"  blocks              {blocks}, running across documents"]
    if stats.truncated is not None:
        lines.append(f"  truncated           {stats.truncated[0]:,} conversation(s) to their first data.seq_len + 1 "
                     f"tokens (the first: {stats.truncated[1]})")
    for why, (count, first) in stats.left_out.items():
        lines.append(f"  left out            {count:,} record(s): {why} (the first: {first})")
    if stats.format == "chat" and not stats.left_out:
        lines.append("  left out            none")
    return "\n".join(lines)


def _count(n: int | None) -> str:
    return "unknown (a cache from before records were counted)" if n is None else f"{n:,}"
