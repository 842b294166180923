"""Training data from local files: tokenizers, text and conversations, caches, packing and the sampler.

* :mod:`~mobius.data.tokenizer`: the checkpoint's tokenizer, or byte-level tokens.
* :mod:`~mobius.data.sources`: the files (.txt, .jsonl, .json, .parquet) and the records in them.
* :mod:`~mobius.data.records`: conversation records (messages, ShareGPT, Alpaca, prompt / completion).
* :mod:`~mobius.data.chat`: chat templates, rendered as transformers renders them, and the target tokens.
* :mod:`~mobius.data.cache`: memory-mapped token caches with their fingerprints.
* :mod:`~mobius.data.pack`: blocks of ``data.seq_len`` positions as micro-batches (conversations packed whole).
* :mod:`~mobius.data.sampler`: the seeded, resumable order of the blocks; the held-out blocks.
* :mod:`~mobius.data.load`: all of it from a config's ``data`` section.
"""

from mobius.data.cache import ChatCache, chat_cache, token_cache, tokenize_to_cache
from mobius.data.chat import ChatTemplate, find_template
from mobius.data.load import conversations, data_format, load_data
from mobius.data.pack import ChatBlocks, PackedBlocks, TextBlocks, best_fit_decreasing
from mobius.data.sampler import DataStats, TrainData, build_data
from mobius.data.sources import (BUILTIN_STDLIB, BUILTIN_STDLIB_CHAT, BUILTINS, documents, read_text, source_files,
                                 text_lines)
from mobius.data.tokenizer import EOT, TextTokenizer, byte_tokenizer, load_tokenizer

__all__ = ["BUILTINS", "BUILTIN_STDLIB", "BUILTIN_STDLIB_CHAT", "EOT", "ChatBlocks", "ChatCache", "ChatTemplate",
           "DataStats", "PackedBlocks", "TextBlocks", "TextTokenizer", "TrainData", "best_fit_decreasing",
           "build_data", "byte_tokenizer", "chat_cache", "conversations", "data_format", "documents", "find_template",
           "load_data", "load_tokenizer", "read_text", "source_files", "text_lines", "token_cache", "tokenize_to_cache"]
