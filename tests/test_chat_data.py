"""Conversations: formats, chat templates against transformers, assistant-only targets, packing whole
conversations, one-line errors, the cache, ``mobius data`` and the built-in chat source."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mobius.batch import IGNORE
from mobius.config import DataSection
from mobius.data import best_fit_decreasing, byte_tokenizer, conversations, find_template, load_data, load_tokenizer
from mobius.data.chat import ChatTemplate, encode, overlapping, render_with_targets
from mobius.data.sources import Where
from mobius.errors import ConfigError, DataError

# ---- templates written for these tests, in the styles of three families ----------------------------------------
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' }}{% GEN %}{{ message['content'] | trim + '<|eot_id|>' }}{% END %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATML = ("{% if messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
          "{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% GEN %}"
          "{{ message['content'] + '<|im_end|>\\n' }}{% END %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{% GEN %}{{ ' ' + message['content'] + eos_token }}{% END %}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
STYLES = {  # template, special tokens, bos, eos, how an answer's target text reads
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", lambda a: a.strip() + "<|eot_id|>"),
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
               lambda a: a + "<|im_end|>\n"),
    "mistral": (MISTRAL, ["<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", lambda a: " " + a + "</s>"),
}
CONVERSATIONS = [
    [{"role": "user", "content": "What is a pipeline stage?"},
     {"role": "assistant", "content": "A contiguous run of layers placed on one GPU."}],
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": " Hi! How can I help? "},
     {"role": "user", "content": "Explain swapping, héllo ✓"},
     {"role": "assistant", "content": "Stages move between host and GPU memory while others compute."}],
]
SYSTEM = [{"role": "system", "content": "You answer briefly."}] + CONVERSATIONS[0]
CORPUS = ["the quick brown fox jumps over the lazy dog", "pipelines move activations between stages",
          "a contiguous run of layers placed on one GPU", "hello there how can I help you today",
          "stages move between host and GPU memory while others compute", "explain swapping héllo ✓"] * 4


def plain(template: str) -> str:
    return template.replace("{% GEN %}", "").replace("{% END %}", "")


def tagged(template: str) -> str:
    """The template with its assistant turns' answers in generation blocks (for transformers' mask)."""
    import re

    return re.sub(r"\{% GEN %\}(\{\{.*?\}\})\{% END %\}",
                  lambda m: f"{{% if message['role'] == 'assistant' %}}{{% generation %}}{m[1]}{{% endgeneration %}}"
                            f"{{% else %}}{m[1]}{{% endif %}}", template)


def make_tokenizer(directory: Path, style: str, split: bool = True, config: dict | None = None) -> Path:
    """A small byte-level BPE trained here with the style's special tokens; ``split``: GPT-2's pre-tokenizing
    regex (else merges may cross a header into its answer); a tokenizer_config.json with the plain template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    template, specials, bos, eos, _ = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split)
    tok.decoder = decoders.ByteLevel()
    corpus = CORPUS + ([f"assistant\n{c['content']}" for conv in CONVERSATIONS for c in conv] * 8 if not split else [])
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "chat_template": plain(template), **(config or {})}
    (directory / "tokenizer_config.json").write_text(json.dumps(conf))
    return directory


def transformers_tokens(directory: Path, style: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids for the plain template, and its assistant mask for the tagged one."""
    import transformers

    template, _, bos, eos, _ = STYLES[style]
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), bos_token=bos,
                                               eos_token=eos)
    ids = tok.apply_chat_template(messages, chat_template=plain(template), tokenize=True, return_dict=True)
    masked = tok.apply_chat_template(messages, chat_template=tagged(template), tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert masked["input_ids"] == ids["input_ids"]
    return ids["input_ids"], masked["assistant_masks"]


def ours(directory: Path, messages: list[dict], train_on: str = "assistant") -> tuple[list[int], list[bool]]:
    tok = load_tokenizer(str(directory), None)
    text, spans = render_with_targets(find_template(None, tok), messages, Where("t", "record", 0), train_on)
    enc = encode(tok, [text], [spans])
    return enc.ids.tolist(), enc.targets.tolist()


def target_runs(tok_dir: Path, ids: list[int], flags: list[bool]) -> list[str]:
    """The text of each run of target tokens."""
    tok = load_tokenizer(str(tok_dir), None).tokenizer
    runs, run = [], []
    for i, f in zip(ids + [None], flags + [False]):
        if f:
            run.append(i)
        elif run:
            runs.append(tok.decode(run, skip_special_tokens=False))
            run = []
    return runs


# ---- rendering and targets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", list(STYLES))
def test_ids_and_targets_equal_transformers(tmp_path: Path, style: str) -> None:
    """Token ids equal transformers' apply_chat_template; the targets are the tokens transformers' assistant mask
    marks for the same template with generation tags: each answer and its end-of-turn text, not the prompts,
    system turns or headers (checked as text too)."""
    d = make_tokenizer(tmp_path / style, style)
    answer_text = STYLES[style][4]
    for messages in CONVERSATIONS + ([SYSTEM] if style != "mistral" else []):
        ids, flags = ours(d, messages)
        want_ids, want_mask = transformers_tokens(d, style, messages)
        assert ids == want_ids
        assert [int(f) for f in flags] == want_mask
        answers = [answer_text(m["content"]) for m in messages if m["role"] == "assistant"]
        assert target_runs(d, ids, flags) == answers
    ids, flags = ours(d, CONVERSATIONS[1], train_on="all")
    assert all(flags) and ids == transformers_tokens(d, style, CONVERSATIONS[1])[0]


def test_a_token_across_the_header_and_the_answer_is_a_target_as_transformers_marks_it(tmp_path: Path) -> None:
    """Merges that cross from the header into the answer (no pre-tokenizing split): the token holding both is a
    target, as transformers' mask marks it; the rule is the overlap of characters."""
    d = make_tokenizer(tmp_path / "merged", "chatml", split=False)
    crossed = 0
    for messages in CONVERSATIONS:
        ids, flags = ours(d, messages)
        want_ids, want_mask = transformers_tokens(d, "chatml", messages)
        assert ids == want_ids and [int(f) for f in flags] == want_mask
        tok = load_tokenizer(str(d), None).tokenizer
        crossed += sum(f and tok.id_to_token(i).startswith("assistant") for i, f in zip(ids, flags))
    assert crossed > 0  # (the case this test is for happened)


def test_overlap_rule() -> None:
    offsets = np.array([[0, 3], [3, 5], [5, 9], [9, 9], [9, 12], [12, 14]])  # [N, 2]; token 3 is zero-width
    spans = np.array([[4, 9], [13, 20]])
    assert overlapping(offsets, spans).tolist() == [False, True, True, False, False, True]
    assert not overlapping(offsets, np.zeros((0, 2), dtype=np.int64)).any()


def test_the_environment_renders_as_transformers_does() -> None:
    """tojson (no HTML escaping), loop controls, trim/lstrip of blocks, generation blocks, raise_exception."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}\n  {% if loop.index0 > 1 %}{% break %}{% endif %}\n{{ m | tojson }}|"
                "{% generation %}{{ m['content'] }}{% endgeneration %}\n{% endfor %}{{ bos_token }}")
    messages = [{"role": "user", "content": "<b>&é</b>"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "never"}]
    mine = ChatTemplate(template, "t", {"bos_token": "<s>"}).render(messages, Where("t", "record", 0))
    assert mine == render_jinja_template([messages], chat_template=template, bos_token="<s>")[0][0]
    assert "<b>&é</b>" in mine and "never" not in mine
    failing = ChatTemplate("{{ raise_exception('no system turns here') }}", "t")
    with pytest.raises(DataError, match=r"^f:3: messages: the chat template \(t\) failed: no system turns here$"):
        failing.render(messages, Where("f", "line", 3))
    with pytest.raises(ConfigError, match=r"^t: the chat template is not valid Jinja \(line 1: "):
        ChatTemplate("{% for %}", "t").render(messages, Where("f", "line", 3))


# ---- formats -----------------------------------------------------------------------------------------------------
def _write_forms(d: Path) -> None:
    """The two conversations of CONVERSATIONS[0]'s shape in every form and file type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    q, a = CONVERSATIONS[0][0]["content"], CONVERSATIONS[0][1]["content"]
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n\n")
    (d / "b.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": q},
                                                             {"from": "gpt", "value": a}]}]))
    pq.write_table(pa.Table.from_pylist([{"instruction": q, "input": None, "output": a}]), d / "c.parquet")
    (d / "d.jsonl").write_text(json.dumps({"prompt": q, "completion": a}) + "\n")
    (d / "e.jsonl").write_text(json.dumps({"prompt": CONVERSATIONS[0][:1], "completion": CONVERSATIONS[0][1:]}) + "\n")


def test_every_form_and_file_type_reads_as_the_same_conversation(tmp_path: Path) -> None:
    _write_forms(tmp_path / "data")
    template = find_template("builtin:demo-chat", byte_tokenizer())
    read = list(conversations(str(tmp_path / "data"), template, "assistant"))
    d = tmp_path / "data"
    assert [str(w) for w, _ in read] == [f"{d / 'a.jsonl'}:1", f"{d / 'b.json'}: item 0", f"{d / 'c.parquet'}: row 0",
                                         f"{d / 'd.jsonl'}:1", f"{d / 'e.jsonl'}:1"]
    assert all(messages == CONVERSATIONS[0] for _, messages in read)


def test_alpaca_input_and_system() -> None:
    from mobius.data.records import conversation

    got = conversation({"instruction": "Sum", "input": "1 2", "output": "3", "system": "Be terse."}, "alpaca",
                       Where("f", "line", 1), tools=False, final_answer=True)
    assert got == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Sum\n\n1 2"},
                   {"role": "assistant", "content": "3"}]


# ---- the data a run trains on -----------------------------------------------------------------------------------
def section(path: Path | str, cache: Path, **kw) -> DataSection:
    return DataSection(path=str(path), cache_dir=str(cache), **kw)


def _many(tmp_path: Path, count: int = 40) -> Path:
    """``count`` conversations of varied lengths (one to three exchanges, answers of 1 to 24 words)."""
    rng = np.random.default_rng(0)
    words = "stage swap host memory pipeline gradient chunk block layer answer".split()
    f = tmp_path / "many.jsonl"
    with f.open("w") as fh:
        for i in range(count):
            messages = []
            for _ in range(int(rng.integers(1, 4))):
                messages += [{"role": "user", "content": f"q{i} " + " ".join(rng.choice(words, rng.integers(1, 8)))},
                             {"role": "assistant", "content": " ".join(rng.choice(words, rng.integers(1, 25)))}]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return f


def _expected(tok_dir: Path, f: Path) -> list[tuple[list[int], list[int]]]:
    """Each conversation's ids and assistant mask from transformers (the tagged ChatML template)."""
    return [transformers_tokens(tok_dir, "chatml", json.loads(line)["messages"]) for line in f.read_text().splitlines()]


def _rows(blocks, T: int) -> list[tuple[list[int], list[int]]]:
    """Every document of every block as (inputs, targets), checking that a row's documents fill it exactly and its
    padding document trains nothing."""
    out = []
    batch = blocks.get(np.arange(len(blocks)))
    for b in range(len(blocks)):
        lengths = [int(n) for n in batch.docs[b] if n > 0]
        assert sum(lengths) == T and all(n == 0 for n in batch.docs[b][len(lengths):])
        at = 0
        for n in lengths:
            out.append((batch.inputs[b, at:at + n].tolist(), batch.targets[b, at:at + n].tolist()))
            at += n
    return out


@pytest.mark.parametrize("seq_len", [128, 256])
def test_packed_blocks_hold_whole_conversations_with_transformers_targets(tmp_path: Path, seq_len: int,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every conversation that fits is in exactly one block, whole: its inputs ids[:-1], its targets ids[1:] where
    transformers' mask marks them, else IGNORE; documents sum to T; the tail is one padding document that trains
    nothing; longer conversations are counted as dropped; the packing efficiency is what the rows hold. (Batches
    of 7 conversations: several are rendered while others are tokenized.)"""
    monkeypatch.setattr("mobius.data.cache.BATCH", 7)
    d = make_tokenizer(tmp_path / "tok", "chatml")
    f = _many(tmp_path)
    tok = load_tokenizer(str(d), None)
    _, data = load_data(section(f, tmp_path / "cache", seq_len=seq_len, val_fraction=0.1), tok, seed=0)
    want = []
    for ids, mask in _expected(d, f):
        if len(ids) - 1 <= seq_len:
            want.append((ids[:-1], [i if m else IGNORE for i, m in zip(ids[1:], mask[1:])]))
    docs = _rows(data.train, seq_len) + _rows(data.val, seq_len)
    real = [doc for doc in docs if any(t != IGNORE for t in doc[1])]
    padding = [doc for doc in docs if all(t == IGNORE for t in doc[1])]
    assert sorted(map(str, real)) == sorted(map(str, want))  # whole, each once, targets exactly transformers'
    assert all(set(inputs) == {tok.pad_id} for inputs, _ in padding)
    stats = data.stats
    dropped = sum(len(ids) - 1 > seq_len for ids, _ in _expected(d, f))
    assert stats.conversations == len(want) and stats.records == 40
    assert (dropped == 0) == (not stats.left_out)
    if dropped:
        assert list(stats.left_out.values())[0][0] == dropped
    used = sum(len(doc[0]) for doc in real)
    assert stats.efficiency == pytest.approx(used / ((len(data.train) + len(data.val)) * seq_len))
    assert stats.target_tokens == sum(sum(t != IGNORE for t in doc[1]) for doc in real)
    assert len(data.val) >= 1 and stats.train_blocks == len(data.train)
    assert 0 < stats.fewest_blocks <= len(data.train) + len(data.val)


def test_unpacked_rows_and_truncation(tmp_path: Path) -> None:
    """packing=false: one conversation per row, padded after it, docs None. truncation=truncate: a long
    conversation keeps its first seq_len + 1 tokens."""
    d = make_tokenizer(tmp_path / "tok", "chatml")
    f = _many(tmp_path)
    tok = load_tokenizer(str(d), None)
    expected = _expected(d, f)
    T = 128
    _, data = load_data(section(f, tmp_path / "cache", seq_len=T, packing=False, truncation="truncate",
                                val_fraction=0.0), tok, seed=0)
    batch = data.train.get(np.arange(len(data.train)))
    assert batch.docs is None and len(data.train) == 40 == batch.inputs.shape[0]
    want = []
    for ids, mask in expected:  # the first T + 1 tokens; padding after, never a target
        ids, mask = ids[:T + 1], mask[:T + 1]
        pad = T - (len(ids) - 1)
        want.append((ids[:-1] + [tok.pad_id] * pad, [i if m else IGNORE for i, m in zip(ids[1:], mask[1:])] +
                     [IGNORE] * pad))
    assert sorted(zip(batch.inputs.tolist(), batch.targets.tolist())) == sorted(want)
    long = sum(len(ids) > T + 1 for ids, _ in expected)
    assert 0 < long < 40 and data.stats.truncated[0] == long and not data.stats.left_out


def test_best_fit_decreasing_packs_every_item_once_and_tightly() -> None:
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 100, 500).tolist()
    bins = best_fit_decreasing(sizes, 100)
    assert sorted(i for b in bins for i in b) == list(range(500))
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert max(loads) <= 100
    assert all(loads[a] + loads[b] > 100 for a in range(len(loads)) for b in range(a + 1, len(loads)))  # any-fit
    assert bins == best_fit_decreasing(sizes, 100)
    assert len(bins) <= np.ceil(sum(sizes) / 100) * 1.05 + 1


# ---- errors: one line, naming the file, the record and the field; nothing written ------------------------------
BAD = [  # file name, content, the message (a regex after the file's path)
    ("a.jsonl", [{"messages": CONVERSATIONS[0]}, {"conversation": []}], r":2: record has no 'messages' field"),
    ("a.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}],
     r":1: messages\[0\]\.role: unknown role 'bot'; expected one of system, user, assistant$"),
    ("a.json", [{"messages": CONVERSATIONS[0]}, {"messages": [{"role": "user", "content": ["x"]}]}],
     r": item 1: messages\[0\]\.content: not a string \(a list\)$"),
    ("a.jsonl", [{"messages": CONVERSATIONS[0][:1]}], r":1: messages: the conversation ends with a 'user' turn"),
    ("a.jsonl", [{"messages": [{"role": "tool", "content": "42"}]}], r"unknown role 'tool' \(the chat template never"),
    ("a.parquet", [{"instruction": "x", "output": "y"}, {"instruction": "x", "output": None}],
     r": row 1: output: not a string \(a NoneType\)$"),
    ("a.jsonl", [{"conversations": [{"from": "gpt", "value": 3}]}], r":1: conversations\[0\]\.value: not a string"),
]


@pytest.mark.parametrize("name,records,message", BAD, ids=[m.split(":")[-1][:30] for _, _, m in BAD])
def test_bad_records_are_one_line_naming_the_record_and_field(tmp_path: Path, name: str, records: list,
                                                              message: str) -> None:
    f = tmp_path / name
    if name.endswith(".jsonl"):
        f.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif name.endswith(".json"):
        f.write_text(json.dumps(records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), f)
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as e:
        load_data(section(f, cache, format="chat", chat_template="builtin:demo-chat"), byte_tokenizer(), 0)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(f))
    assert __import__("re").search(message, str(e.value)), str(e.value)
    assert not list(cache.glob("*"))  # nothing written


def test_template_problems_are_one_line(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"messages": [CONVERSATIONS[0][0]] * 2 + [CONVERSATIONS[0][1]]}) + "\n")
    d = make_tokenizer(tmp_path / "mistral", "mistral")
    with pytest.raises(DataError, match=r"c\.jsonl:1: messages: the chat template \(.*tokenizer_config\.json\) failed: "
                                        r"Conversation roles must alternate"):
        load_data(section(f, tmp_path / "cache"), load_tokenizer(str(d), None), 0)
    f.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    ends = tmp_path / "ends.jinja"  # ends the last turn unlike the same turn followed by others
    ends.write_text("{% for m in messages %}{{ m['role'] + ':' + m['content'] }}{% if loop.last %}.{% endif %}"
                    "{% endfor %}")
    with pytest.raises(ConfigError, match=r"c\.jsonl:1: the chat template \(data.chat_template .*ends.jinja\) renders "
                                          r"the conversation up to message 1 with the generation prompt as text that "
                                          r"does not begin its rendering through message 1, so"):
        load_data(section(f, tmp_path / "cache", chat_template=str(ends)), byte_tokenizer(), 0)
    drops = tmp_path / "drops.jinja"  # drops earlier answers (as templates that strip earlier reasoning do)
    drops.write_text("{% for m in messages %}{{ m['role'] }}:{% if m['role'] == 'assistant' and not loop.last %}-"
                     "{% else %}{{ m['content'] }}{% endif %};{% endfor %}")
    with pytest.raises(ConfigError, match=r"renders the conversation through message 1 as text that does not begin "
                                          r"its rendering through its last message \(3\)"):
        load_data(section(f, tmp_path / "cache", chat_template=str(drops)), byte_tokenizer(), 0)
    with pytest.raises(ConfigError, match=r"the byte-level tokenizer has none .* set data.chat_template"):
        load_data(section(f, tmp_path / "cache"), byte_tokenizer(), 0)
    silent = tmp_path / "silent.jinja"  # drops the assistant's turns: nothing to train on
    silent.write_text("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                      "{% endfor %}")
    with pytest.raises(DataError, match=r"none of its 1 records has a target token"):
        load_data(section(f, tmp_path / "cache", chat_template=str(silent)), byte_tokenizer(), 0)
    assert not list((tmp_path / "cache").glob("chat-*.json"))


def test_mixed_text_and_conversations_under_auto(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("some text")
    (tmp_path / "d" / "b.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n")
    with pytest.raises(ConfigError, match=r"holds text \(.*a\.txt\) and conversations \(.*b\.jsonl\)"):
        load_data(section(tmp_path / "d", tmp_path / "cache"), byte_tokenizer(), 0)


# ---- templates found, cache and fingerprint ---------------------------------------------------------------------
def test_where_the_template_is_found(tmp_path: Path) -> None:
    d = make_tokenizer(tmp_path / "tok", "chatml")
    tok = load_tokenizer(str(d), None)
    assert find_template(None, tok).source == plain(CHATML)
    conf = json.loads((d / "tokenizer_config.json").read_text())
    conf["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "D"}]
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    assert find_template(None, load_tokenizer(str(d), None)).source == "D"
    (d / "chat_template.jinja").write_text("J")
    assert find_template(None, load_tokenizer(str(d), None)).source == "J"  # (transformers' order)
    with pytest.raises(ConfigError, match="no such built-in template"):
        find_template("builtin:nothing", tok)


def test_cache_is_reused_and_keyed_by_template_and_train_on(tmp_path: Path) -> None:
    f = _many(tmp_path, 12)
    cache = tmp_path / "cache"
    base = dict(chat_template="builtin:demo-chat", seq_len=256, val_fraction=0.0)
    tok, one = load_data(section(f, cache, **base), byte_tokenizer(), 0)
    files = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    _, again = load_data(section(f, cache, **base), byte_tokenizer(), 0)
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == files and again.fingerprint == one.fingerprint
    assert np.array_equal(again.next_batch(3).targets, one.next_batch(3).targets)
    _, all_tokens = load_data(section(f, cache, **base, train_on="all"), byte_tokenizer(), 0)
    other = tmp_path / "other.jinja"
    other.write_text(tok.template_file.replace("<|", "<<"))
    _, templated = load_data(section(f, cache, **{**base, "chat_template": str(other)}), byte_tokenizer(), 0)
    _, unpacked = load_data(section(f, cache, **base, packing=False), byte_tokenizer(), 0)
    assert len({d.fingerprint for d in (one, all_tokens, templated, unpacked)}) == 4
    assert len(list(cache.glob("chat-*.json"))) == 3  # (packing is not in the cache's key)
    assert all_tokens.stats.target_tokens > one.stats.target_tokens
    assert tok.save(tmp_path / "saved")["chat_template.jinja"].read_text() == tok.template_file  # trained with it
    from mobius.assemble import _check_same_data
    from mobius.config import config_from_dict
    from mobius.errors import CheckpointError

    cfg = config_from_dict({"model": {"preset": "gpt2-tiny"}, "data": {"path": str(f)}})
    _check_same_data(cfg, one.state_dict(), again, tmp_path)  # (a resume on the same data goes on)
    with pytest.raises(CheckpointError, match=r"differs from what it trained on \(or, for conversations, the chat "):
        _check_same_data(cfg, one.state_dict(), templated, tmp_path)


# ---- mobius data and the built-in source ------------------------------------------------------------------------
def test_mobius_data_prints_records_with_targets_and_the_totals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mobius.cli import main

    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 3))
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  preset: gpt2-tiny\ndata:\n  path: {f}\n  chat_template: builtin:demo-chat\n"
                   f"  seq_len: 200\n  cache_dir: {tmp_path / 'cache'}\n")
    assert main(["data", str(cfg), "--show", "2", "--color", "never"]) == 0
    out = capsys.readouterr().out
    assert f"── {f}:1: " in out and f"── {f}:2: " in out and f"{f}:3" not in out
    assert ("<|user|>\nWhat is a pipeline stage?<|endoftext|><|assistant|>\n⟦A contiguous run of layers placed on "
            "one GPU.<|endoftext|>⟧") in out
    for line in ("records             6", "conversations       6 in blocks", "packing efficiency", "left out"):
        assert line in out
    assert main(["data", str(cfg), "--data.train_on=all", "--data.seq_len=150", "--show=0"]) == 0
    out = capsys.readouterr().out
    assert "left out            3 record(s): longer than data.seq_len + 1 = 151 tokens" in out and "⟦" not in out
    assert "train_on=all" in out
    f.write_text(json.dumps({"messages": [{"role": "user", "content": 1}]}) + "\n")
    assert main(["data", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mobius: error: {f}:1: messages[0].content: not a string (a int)"]


def test_mobius_data_on_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mobius.cli import main

    (tmp_path / "t.txt").write_text("plain text, every token a target. " * 20)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model:\n  preset: gpt2-tiny\ndata:\n  path: {tmp_path / 't.txt'}\n  seq_len: 64\n"
                   f"  val_fraction: 0.2\n  cache_dir: {tmp_path / 'cache'}\n")
    assert main(["data", str(cfg), "--show=1", "--color=never"]) == 0
    out = capsys.readouterr().out
    assert "── training block 0: 64 tokens, every one a target\n⟦" in out
    assert "records             1\n" in out and "tokens              681\n" in out  # 680 bytes and the end of text
    assert "blocks              8 training + 2 held out, of 64 positions, running across documents" in out
    assert main(["data", str(cfg), "--data.packing=false"]) == 2
    assert "data.packing=false pads one conversation per row" in capsys.readouterr().err


def test_stdlib_conversations_ask_what_a_definition_does() -> None:
    import sysconfig

    from mobius.stdlib_docs import QUESTIONS, _parsed, file_definitions

    root = Path(sysconfig.get_paths()["stdlib"])
    found = list(_parsed([root / "textwrap.py", root / "json" / "__init__.py", root / "_pydecimal.py"],
                         file_definitions, workers=1))
    names = [n for n, _, _ in found]
    assert "textwrap.dedent" in names and "json.dumps" in names and "textwrap.TextWrapper.wrap" in names
    assert not any(n.startswith("_pydecimal") or "._" in n for n in names)
    kinds = dict((n, k) for n, k, _ in found)
    assert (kinds["textwrap.TextWrapper"], kinds["textwrap.TextWrapper.wrap"], kinds["json.dumps"]) == \
        ("class", "method", "function")
    assert len(QUESTIONS) > 1


def test_the_chat_demo_config_names_the_shipped_template() -> None:
    from mobius.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "chat-demo.yaml")
    assert cfg.data.path == "builtin:stdlib-chat" and cfg.data.format == "chat"
    template = find_template(cfg.data.chat_template, byte_tokenizer())
    text, spans = render_with_targets(template, CONVERSATIONS[0], Where("t", "record", 0), "assistant")
    assert text[slice(*spans[0])] == CONVERSATIONS[0][1]["content"] + "<|endoftext|>"
    assert text[:spans[0][0]].endswith("<|assistant|>\n")
