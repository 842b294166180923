"""Tokenizers through the ``tokenizers`` library: the checkpoint's own ``tokenizer.json`` (or GPT-2 style
``vocab.json`` + ``merges.txt``), or a byte-level tokenizer (256 byte tokens and an end-of-text token) for
from-scratch runs, which is also saved as a ``tokenizer.json``. A text document is tokenized as
``[bos] doc eos`` (bos when the checkpoint's ``tokenizer_config.json`` names one apart from eos, as Llama 3
and Mistral were trained); a conversation as its chat template writes it (:mod:`mobius.data.chat`)."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mobius.errors import ConfigError, MobiusError

if TYPE_CHECKING:
    import tokenizers

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
TEMPLATE_FILE = "chat_template.jinja"  # the chat template beside a tokenizer (transformers' newer form)
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")  # what a chat template may read


@dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the tokens mobius packs documents with: ``[bos] doc eos``."""

    tokenizer: "tokenizers.Tokenizer"
    eos_id: int
    name: str  # identifies the tokenizer (and its bos / eos choice) in cache keys
    bos_id: int | None = None  # begins every document (the checkpoint's tokenizer config names one apart from eos)
    config: dict | None = None  # the tokenizer_config.json it came with, written back with checkpoints
    directory: Path | None = None  # where its files are (the chat template is looked for there)
    template_file: str | None = None  # a chat template written as chat_template.jinja with checkpoints

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def pack(self, ids: list[int]) -> list[int]:
        """One document's ids as training text: ``[bos] ids eos``."""
        return ([self.bos_id] if self.bos_id is not None else []) + ids + [self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def special_tokens(self) -> dict[str, str]:
        """The special tokens by name (``bos_token`` ...) as its ``tokenizer_config.json`` gives them (the minimal
        one :meth:`save` writes when there is none): what transformers passes a chat template."""
        conf = self.config if self.config is not None else self._minimal_config()
        return {name: text for name in SPECIAL_NAMES if (text := _token_text(conf.get(name))) is not None}

    @property
    def pad_id(self) -> int:
        """The id rows are padded with: the tokenizer's pad token, else its end-of-text token."""
        pad = self.special_tokens().get("pad_token")
        pad_id = self.tokenizer.token_to_id(pad) if pad else None
        return self.eos_id if pad_id is None else pad_id

    def _minimal_config(self) -> dict:
        eos = self.tokenizer.id_to_token(self.eos_id)
        return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos, "unk_token": eos}

    def save(self, directory: Path) -> dict[str, Path]:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (the checkpoint's own, or a minimal
        one naming the end-of-text token), and ``chat_template.jinja`` when it has one apart from its config;
        returns name -> path."""
        directory.mkdir(parents=True, exist_ok=True)
        tok = directory / "tokenizer.json"
        self.tokenizer.save(str(tok))
        conf = directory / "tokenizer_config.json"
        written = self.config if self.config is not None else self._minimal_config()
        conf.write_text(json.dumps(written, indent=2, ensure_ascii=False) + "\n")
        out = {"tokenizer.json": tok, "tokenizer_config.json": conf}
        if self.template_file is not None:
            out[TEMPLATE_FILE] = directory / TEMPLATE_FILE
            out[TEMPLATE_FILE].write_text(self.template_file, encoding="utf-8")
        return out


def byte_tokenizer() -> TextTokenizer:
    """256 byte tokens (GPT-2's byte-to-unicode alphabet, no merges) and ``<|endoftext|>`` = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return TextTokenizer(tok, tok.token_to_id(EOT), "bytes-v1")


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256+n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def _eos_of(tok: "tokenizers.Tokenizer", path: Path) -> int:
    for candidate in (EOT, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>"):
        i = tok.token_to_id(candidate)
        if i is not None:
            return i
    raise MobiusError(f"{path}: tokenizer has no end-of-text token (looked for {EOT}, </s>, <eos>, <|end_of_text|>)")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_ids(tok: "tokenizers.Tokenizer", file: Path) -> tuple[int | None, int, dict | None]:
    """(bos, eos, config) from the ``tokenizer_config.json`` beside ``file``: its eos_token ends every
    document; its bos_token begins every one when it differs from eos and ``add_bos_token`` is not
    false (Llama 3, Mistral; Qwen names none). Without a config: no bos, eos found by name."""
    conf_file = file.parent / "tokenizer_config.json"
    if not conf_file.is_file():
        return None, _eos_of(tok, file), None
    try:
        conf = json.loads(conf_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MobiusError(f"{conf_file}: cannot be read as JSON ({e})") from None
    ids = {}
    for role in ("bos", "eos"):
        text = _token_text(conf.get(f"{role}_token"))
        ids[role] = tok.token_to_id(text) if text else None
        if text and ids[role] is None:
            raise MobiusError(f"{conf_file}: {role}_token {text!r} is not in the tokenizer's vocabulary")
    eos = ids["eos"] if ids["eos"] is not None else _eos_of(tok, file)
    bos = ids["bos"] if ids["bos"] != eos and conf.get("add_bos_token", True) is not False else None
    return bos, eos, conf


def load_tokenizer(spec: str | None, checkpoint: str | None) -> TextTokenizer:
    """The tokenizer a run uses: ``spec`` if given, else the checkpoint's own, else byte-level."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    for base in ([Path(spec)] if spec else []) + ([Path(checkpoint)] if checkpoint and not spec else []):
        file = base if base.is_file() else base / "tokenizer.json"
        if file.is_file():
            try:
                tok = Tokenizer.from_file(str(file))
            except Exception as e:  # tokenizers raises its own Exception type
                raise MobiusError(f"{file}: not a valid tokenizer.json ({e})") from e
            bos, eos, conf = _special_ids(tok, file)
            beside = file.parent / TEMPLATE_FILE
            template = beside.read_text(encoding="utf-8") if beside.is_file() else None
            return TextTokenizer(tok, eos, f"{_file_digest(file)}:b{bos}:e{eos}", bos, conf, file.parent, template)
        vocab, merges = base / "vocab.json", base / "merges.txt"
        if vocab.is_file() and merges.is_file():
            tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            return TextTokenizer(tok, _eos_of(tok, vocab), _file_digest(vocab) + _file_digest(merges),
                                 directory=base)
        if spec:
            raise ConfigError(f"data.tokenizer {spec}: no tokenizer.json (or vocab.json + merges.txt) there")
        log.warning("checkpoint %s has no tokenizer files; using byte-level tokens", checkpoint)
    return byte_tokenizer()


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
