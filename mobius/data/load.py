"""A run's data from its ``data`` section: the format (text or conversations, per file under
``data.format: auto``), the chat template, the cache, and the blocks split into training and held-out ones.

Conversations: one of more than ``data.seq_len + 1`` tokens is left out or cut to that length
(``data.truncation``); one with no target token is left out; each is counted and the first named. The
held-out conversations are a fixed draw (the same whatever ``train.seed``), packed apart from the training
ones. The fingerprint a resume checks covers the cache's content (tokens, targets and lengths: the sources,
template and ``data.train_on`` as they came out) and ``data.packing`` / ``data.truncation``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import TYPE_CHECKING, Iterator, Literal

import numpy as np

from mobius.data.cache import ChatCache, chat_cache, text_documents, token_cache
from mobius.data.chat import ChatTemplate, find_template
from mobius.data.pack import ChatBlocks
from mobius.data.records import conversation, form_names, record_form
from mobius.data.sampler import DataStats, TrainData, build_data
from mobius.data.sources import BUILTIN_STDLIB, BUILTIN_STDLIB_CHAT, Where, records, source_files
from mobius.data.tokenizer import TextTokenizer
from mobius.errors import ConfigError, DataError

if TYPE_CHECKING:
    from mobius.config import DataSection

log = logging.getLogger(__name__)

HELD_OUT_SEED = 20240611  # which conversations are held out: fixed, apart from train.seed
Format = Literal["text", "chat"]


def load_data(data: "DataSection", tokenizer: TextTokenizer, seed: int) -> tuple[TextTokenizer, TrainData]:
    """The tokenizer (with the chat template it trains with, written with checkpoints) and the data."""
    if data_format(data.path, data.format, data.text_field) == "text":
        if not data.packing:
            raise ConfigError(f"data.packing=false pads one conversation per row, but data.path {data.path} is text "
                              f"(read as blocks running across documents): set data.packing=true, or data.format=chat "
                              f"for conversations")
        tokens, fingerprint = token_cache(data.path, data.text_field, tokenizer, data.cache_dir)
        records = text_documents(data.path, data.text_field, tokenizer, data.cache_dir)
        return tokenizer, build_data(tokens, data.seq_len, data.val_fraction, seed, fingerprint=fingerprint,
                                     records=records)
    template = find_template(data.chat_template, tokenizer)
    if data.chat_template:
        tokenizer = dataclasses.replace(tokenizer, template_file=template.source)
    cache = chat_cache(data.path, lambda: conversations(data.path, template, data.train_on), template, data.train_on,
                       tokenizer, data.cache_dir)
    train = build_chat_data(cache, data, seed, tokenizer.pad_id)
    train.stats = dataclasses.replace(train.stats, template=template.origin)
    return tokenizer, train


def data_format(path: str, fmt: str, text_field: str) -> Format:
    """Text or conversations: ``fmt`` unless auto, else what every file holds (a .txt file text; another the form
    of its first record: a conversation's fields, else text), refused when files differ."""
    builtin = {BUILTIN_STDLIB: "text", BUILTIN_STDLIB_CHAT: "chat"}.get(path)
    if builtin is not None and fmt not in ("auto", builtin):
        raise ConfigError(f"data.path {path} holds {'conversations' if builtin == 'chat' else 'text'}, but "
                          f"data.format is {fmt}")
    if builtin is not None or fmt != "auto":
        return builtin or fmt  # type: ignore[return-value]
    found: dict[str, str] = {}
    for f in source_files(path):
        first = None if f.suffix == ".txt" else next(records(f), None)
        kind = "text" if f.suffix == ".txt" or first is None else "chat" if record_form(first[1]) else "text"
        if kind == "text" and first is not None and not (isinstance(first[1], dict) and text_field in first[1]):
            raise DataError(f"{first[0]}: record has no {text_field!r} field (data.text_field) nor a conversation "
                            f"({form_names()})")
        found.setdefault(kind, str(f))
    if len(found) > 1:
        raise ConfigError(f"data.path {path} holds text ({found['text']}) and conversations ({found['chat']}); "
                          f"keep one kind, or set data.format to read all of it as one")
    return next(iter(found))  # type: ignore[return-value]


def conversations(path: str, template: ChatTemplate, train_on: str) -> Iterator[tuple[Where, list[dict]]]:
    """Every conversation of a data source as checked messages, with where it was read; a file's form is its
    first record's."""
    final_answer = train_on == "assistant"
    if path == BUILTIN_STDLIB_CHAT:
        from mobius.stdlib_docs import stdlib_conversations

        for i, messages in enumerate(stdlib_conversations()):
            where = Where(path, "record", i)
            yield where, conversation({"messages": messages}, "messages", where, template.takes_tools, final_answer)
        return
    for f in source_files(path):
        if f.suffix == ".txt":
            raise ConfigError(f"data.path {f}: a .txt file is text, not conversations (data.format is chat)")
        form = None
        for where, record in records(f):
            form = form or record_form(record)
            if form is None:
                raise DataError(f"{where}: record has none of the conversation fields ({form_names()})")
            yield where, conversation(record, form, where, template.takes_tools, final_answer)


def build_chat_data(cache: ChatCache, data: "DataSection", seed: int, pad_id: int) -> TrainData:
    """The cached conversations cut or left out to fit ``data.seq_len``, split, and packed into blocks."""
    keep, kept, hits, left_out, truncated = _fit(cache, data)
    index = np.flatnonzero(keep)
    n_val = max(1, int(len(index) * data.val_fraction)) if data.val_fraction > 0 else 0
    if len(index) - n_val < 1:
        why = "".join(f"; {count} left out: {reason}" for reason, (count, _) in left_out.items())
        raise DataError(f"data.path {data.path}: {len(index)} conversation(s) fit data.seq_len={data.seq_len}, too "
                        f"few for training and {n_val} held out{why}; raise data.seq_len or add conversations")
    held = np.zeros(len(index), dtype=bool)
    held[np.random.default_rng(HELD_OUT_SEED).permutation(len(index))[:n_val]] = True
    blocks = [ChatBlocks.build(cache, index[part], kept[index[part]], data.seq_len, pad_id, data.packing)
              for part in (~held, held)]
    positions = sum(b.positions for b in blocks)
    stats = DataStats("chat", cache.records, int(kept[index].sum()), int(hits[index].sum()), data.seq_len,
                      len(blocks[0]), len(blocks[1]), positions / max(1, data.seq_len * sum(map(len, blocks))),
                      len(index), sum(b.fewest for b in blocks), left_out, truncated, train_on=data.train_on,
                      packing=data.packing)
    fingerprint = hashlib.sha256(f"{cache.fingerprint}|packing={data.packing}|truncation={data.truncation}".encode())
    for why, (count, first) in left_out.items():
        log.warning("data: %d record(s) left out: %s (the first: %s)", count, why, first)
    return TrainData(blocks[0], blocks[1], seed, fingerprint=fingerprint.hexdigest()[:32], stats=stats)


def _fit(cache: ChatCache, data: "DataSection") -> tuple[np.ndarray, np.ndarray, np.ndarray, dict, tuple | None]:
    """Which conversations train ([R] bool), the tokens kept of each ([R]) and their target tokens ([R]); why
    records were left out, and the conversations cut (count, the first)."""
    limit = data.seq_len + 1
    lengths, hits = cache.lengths, cache.hits.copy()
    long = np.flatnonzero(lengths > limit)
    keep, kept = np.ones(len(cache), dtype=bool), np.minimum(lengths, limit)
    left_out = {}
    if cache.no_target:
        left_out["no target token"] = (cache.no_target, cache.no_target_at)
    if data.truncation == "drop":
        keep[long] = False
        if len(long):
            left_out[f"longer than data.seq_len + 1 = {limit} tokens (data.truncation=drop; the longest has "
                     f"{lengths[long].max()})"] = (len(long), str(cache.where(long[0])))
        return keep, kept, hits, left_out, None
    for r in long:  # (cut to their first seq_len + 1 tokens: their targets counted again)
        start = cache.starts[r]
        hits[r] = int(np.count_nonzero(cache.targets[start + 1:start + limit]))
    empty = long[hits[long] == 0]
    keep[empty] = False
    if len(empty):
        left_out[f"no target token in their first data.seq_len + 1 = {limit} tokens (data.truncation=truncate)"] = (
            len(empty), str(cache.where(empty[0])))
    return keep, kept, hits, left_out, (len(long), str(cache.where(long[0]))) if len(long) else None
