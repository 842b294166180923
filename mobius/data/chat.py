"""Chat templates: found, rendered as transformers renders them, and the assistant's tokens located.

A template comes from ``data.chat_template`` (a file, or ``builtin:NAME`` for one shipped in
``mobius/templates``), else from the tokenizer's directory: ``chat_template.jinja``, then the
``chat_template`` of its ``tokenizer_config.json`` (a string, or transformers' list of named templates, of
which "default" is taken). It renders in a sandboxed Jinja2 environment set up as transformers sets up its
own (trim_blocks, lstrip_blocks, loop controls; ``raise_exception``, ``strftime_now``, a ``tojson`` that
leaves HTML characters alone, the tokenizer's special tokens, ``add_generation_prompt``);
``{% generation %}`` blocks render as their content. The text is tokenized without adding special tokens.

Targets: an assistant message's target characters are what rendering the conversation through that
message adds to rendering it up to that message with the generation prompt, so the header the prompt ends
with is not a target, while the answer and the end-of-turn text the template writes after it are. A token
is a target when its characters (the tokenizer's offsets) overlap a target span: the rule transformers'
``return_assistant_tokens_mask`` applies to ``{% generation %}`` spans, with no tags needed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np

from mobius.data.sources import Where
from mobius.data.tokenizer import TEMPLATE_FILE, TextTokenizer
from mobius.errors import ConfigError, DataError

if TYPE_CHECKING:
    import jinja2

BUILTIN = "builtin:"  # data.chat_template: builtin:NAME is mobius/templates/NAME.jinja
TrainOn = Literal["assistant", "all"]


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja source, where it came from (for messages) and the special tokens it is given."""

    source: str
    origin: str
    tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as the tokenizer names them

    @cached_property
    def compiled(self) -> "jinja2.Template":
        import jinja2

        try:
            return _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{self.origin}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") \
                from None

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()[:16]

    @property
    def takes_tools(self) -> bool:
        """Whether the template mentions the ``tool`` role at all (else a tool turn is refused)."""
        return "tool" in self.source

    def render(self, messages: Sequence[dict], where: Where, add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it; a template error (its ``raise_exception`` included) is a
        :class:`DataError` naming the record."""
        compiled = self.compiled  # (not valid Jinja: a ConfigError)
        try:
            return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, tools=None,
                                   documents=None, **self.tokens)
        except Exception as e:  # noqa: BLE001 -- a template is a program: any of its errors is the record's
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{where}: messages: the chat template ({self.origin}) failed: {text}") from None


def _environment() -> "jinja2.Environment":
    """A sandboxed environment like transformers' (its globals and filters written here)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: rendered as its content."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# ---------------------------------------------------------------------------------------------
# Finding the template
# ---------------------------------------------------------------------------------------------
def builtin_templates() -> list[str]:
    """The names of the templates shipped in ``mobius/templates``."""
    return sorted(p.name.removesuffix(".jinja") for p in resources.files("mobius").joinpath("templates").iterdir()
                  if p.name.endswith(".jinja"))


def find_template(spec: str | None, tokenizer: TextTokenizer) -> ChatTemplate:
    """The chat template a run renders conversations with (see the module's docstring for where it is looked
    for); none found is a :class:`ConfigError` naming ``data.chat_template``."""
    tokens = tokenizer.special_tokens()
    if spec and spec.startswith(BUILTIN):
        name = spec.removeprefix(BUILTIN)
        if name not in builtin_templates():
            raise ConfigError(f"data.chat_template {spec}: no such built-in template (there are: "
                              f"{', '.join(BUILTIN + n for n in builtin_templates())})")
        text = resources.files("mobius").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")
        return ChatTemplate(text, f"data.chat_template {spec}", tokens)
    if spec:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"data.chat_template {spec}: no such file (a Jinja chat template, or builtin:NAME)")
        return ChatTemplate(path.read_text(encoding="utf-8"), f"data.chat_template {spec}", tokens)
    where = tokenizer.directory
    if tokenizer.template_file is not None:
        return ChatTemplate(tokenizer.template_file, f"{where / TEMPLATE_FILE}", tokens)
    found = (tokenizer.config or {}).get("chat_template")
    origin = f"{where / 'tokenizer_config.json'}" if where else "the tokenizer's config"
    if isinstance(found, list):  # transformers' named templates: [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise ConfigError(f"{origin}: its chat templates ({', '.join(map(str, named))}) have none named "
                              f"'default'; set data.chat_template to a Jinja template file")
        return ChatTemplate(named["default"], f"{origin} (template 'default')", tokens)
    if isinstance(found, str) and found:
        return ChatTemplate(found, origin, tokens)
    what = f"the tokenizer in {where}" if where else "the byte-level tokenizer"
    raise ConfigError(f"conversation data needs a chat template, and {what} has none ({TEMPLATE_FILE}, or "
                      f"chat_template in tokenizer_config.json); set data.chat_template to a Jinja template file "
                      f"(or {BUILTIN}NAME: {', '.join(builtin_templates())})")


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------
def render_with_targets(template: ChatTemplate, messages: list[dict], where: Where,
                        train_on: TrainOn) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its target character spans, in order (``train_on=all``: all of it)."""
    full = template.render(messages, where)
    if train_on == "all":
        return full, [(0, len(full))]
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], where, add_generation_prompt=True)
        through = full if i == len(messages) - 1 else template.render(messages[:i + 1], where)
        if not through.startswith(before):
            _not_prefix(template, where, f"up to message {i} with the generation prompt", f"through message {i}")
        if not full.startswith(through):
            _not_prefix(template, where, f"through message {i}", f"through its last message ({len(messages) - 1})")
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return full, spans


def _not_prefix(template: ChatTemplate, where: Where, shorter: str, longer: str) -> None:
    raise ConfigError(f"{where}: the chat template ({template.origin}) renders the conversation {shorter} as text "
                      f"that does not begin its rendering {longer}, so the assistant's tokens cannot be located; use "
                      f"a template that writes earlier turns the same whatever follows them (data.chat_template), or "
                      f"data.train_on=all")


@dataclass
class Encoded:
    """A batch of conversations as tokens: all of them end to end, with their target flags and lengths."""

    ids: np.ndarray  # [N] int64
    targets: np.ndarray  # [N] bool: the token is a target
    lengths: np.ndarray  # [R] int64: tokens of each conversation, in order


def encode(tokenizer: TextTokenizer, texts: list[str], spans: list[list[tuple[int, int]]]) -> Encoded:
    """Tokenize rendered conversations (no special tokens added) and flag the tokens that overlap their target
    spans, for the whole batch at once: offsets and spans of every conversation shifted into one text."""
    encodings = tokenizer.tokenizer.encode_batch(texts, add_special_tokens=False)
    lengths = np.fromiter((len(e) for e in encodings), np.int64, len(encodings))
    n = int(lengths.sum())
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), np.int64, n)
    offsets = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(e.offsets for e in encodings)),
                          np.int64, 2 * n).reshape(n, 2)  # [N, 2] characters (start, end) in its text
    base = np.concatenate([[0], np.cumsum([len(t) for t in texts])[:-1]]).astype(np.int64)  # [R] text starts
    offsets += np.repeat(base, lengths)[:, None]
    counts = [len(s) for s in spans]
    flat = np.array([s for conv in spans for s in conv], dtype=np.int64).reshape(-1, 2)  # [S, 2] sorted, disjoint
    flat += np.repeat(base, counts)[:, None]
    return Encoded(ids, overlapping(offsets, flat), lengths)


def overlapping(offsets: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """[N] bool: token ``i`` (characters ``offsets[i]``, [N, 2]) overlaps one of ``spans`` ([S, 2], sorted and
    disjoint): the first span ending after the token's start begins before the token's end."""
    if len(spans) == 0:
        return np.zeros(len(offsets), dtype=bool)
    first = np.searchsorted(spans[:, 1], offsets[:, 0], side="right")  # [N] first span with end > token start
    inside = first < len(spans)
    hit = np.zeros(len(offsets), dtype=bool)
    hit[inside] = offsets[inside, 1] > spans[first[inside], 0]
    return hit
