"""Preparing conversations for training: mobius's data path beside transformers' ``apply_chat_template`` on the
same records, in the same run, on this machine.

The records: ``--records`` seeded synthetic conversations (one to three exchanges, a system turn in a quarter of
them, answers of 10 to 160 words) in a .jsonl file; the tokenizer: a byte-level BPE of 8,000 tokens trained here
on them, with ChatML's special tokens and a ChatML (Qwen-style) template. Timed:

* mobius: ``load_data`` from the .jsonl file to packed blocks (read and check the records, render each
  conversation and its target spans, tokenize in batches with offsets, flag the targets, write the
  memory-mapped cache, pack best-fit decreasing into blocks of ``--seq-len``); then packing alone at other
  sequence lengths, from the cache;
* transformers, one record at a time: ``apply_chat_template(messages, tokenize=True)``, and with
  ``return_assistant_tokens_mask=True`` on the template with ``{% generation %}`` tags;
* transformers, batched: the same calls on lists of ``--batch`` conversations.

1,000 conversations spread over all of them are checked equal to transformers' ids and assistant mask before any
figure is printed.

    python bench/data_bench.py                       # 100,000 conversations
    python bench/data_bench.py --records 2000        # a quick look

Prints the table and writes ``<out>/data_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

from mobius.config import DataSection  # noqa: E402
from mobius.data import load_data, load_tokenizer  # noqa: E402
from mobius.data.load import build_chat_data  # noqa: E402

OUT = os.environ.get("OUT", "bench_out")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% GEN %}"
          "{{ message['content'] + '<|im_end|>\\n' }}{% END %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the a of to in is that for it as with was on be by this are from or at an not which have but all "
         "pipeline stage swap host memory gradient chunk block layer model train token batch answer question "
         "python function returns value list string file error data number time system user result example "
         "because however therefore first second then finally each every some many other new used using").split()


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` seeded synthetic conversations."""
    rng = np.random.default_rng(seed)
    words = np.array(WORDS)

    def text(lo: int, hi: int) -> str:
        return " ".join(words[rng.integers(0, len(words), rng.integers(lo, hi))]).capitalize() + "."

    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": text(5, 20)}] if rng.random() < 0.25 else []
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": text(5, 40)}, {"role": "assistant", "content": text(10, 160)}]
        out.append(messages)
    return out


def tokenizer_dir(where: Path, sample: list[list[dict]]) -> Path:
    """A byte-level BPE (8,000 tokens) trained on ``sample``, with ChatML's specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((m["content"] for conv in sample for m in conv),
                            trainers.BpeTrainer(vocab_size=8000, special_tokens=SPECIALS, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    where.mkdir(parents=True, exist_ok=True)
    tok.save(str(where / "tokenizer.json"))
    (where / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML.replace("{% GEN %}", "").replace("{% END %}", "")}))
    return where


def tagged() -> str:
    """The template with the assistant's answers in ``{% generation %}`` blocks (for transformers' mask)."""
    answer = "{{ message['content'] + '<|im_end|>\\n' }}"
    return CHATML.replace(f"{{% GEN %}}{answer}{{% END %}}",
                          f"{{% if message['role'] == 'assistant' %}}{{% generation %}}{answer}{{% endgeneration %}}"
                          f"{{% else %}}{answer}{{% endif %}}")


def hf_tokenizer(d: Path):
    import transformers

    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")


def time_transformers(tok, convs: list[list[dict]], batch: int) -> dict[str, float]:
    """Seconds for each way of calling transformers on every conversation."""
    plain, out = CHATML.replace("{% GEN %}", "").replace("{% END %}", ""), {}
    for name, kw in (("ids", {"chat_template": plain}),
                     ("ids+mask", {"chat_template": tagged(), "return_assistant_tokens_mask": True})):
        start = time.perf_counter()
        for c in convs:
            tok.apply_chat_template(c, tokenize=True, return_dict=True, **kw)
        out[f"transformers apply_chat_template {name}, one at a time"] = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(0, len(convs), batch):
            tok.apply_chat_template(convs[i:i + batch], tokenize=True, return_dict=True, **kw)
        out[f"transformers apply_chat_template {name}, batches of {batch}"] = time.perf_counter() - start
    return out


def time_stages(tok, convs: list[list[dict]]) -> dict[str, float]:
    """Seconds of mobius's two stages alone, one after the other: rendering with the target spans, then tokenizing
    with the target flags (batches of 512)."""
    from mobius.data.chat import encode, find_template, render_with_targets
    from mobius.data.sources import Where

    template, where = find_template(None, tok), Where("bench", "record", 0)
    start = time.perf_counter()
    rendered = [render_with_targets(template, c, where, "assistant") for c in convs]
    middle = time.perf_counter()
    for i in range(0, len(rendered), 512):
        texts, spans = zip(*rendered[i:i + 512])
        encode(tok, list(texts), list(spans))
    return {"  of which: render + target spans alone": middle - start,
            "  of which: tokenize + flag targets alone": time.perf_counter() - middle}


def check_equal(d: Path, data, convs: list[list[dict]], count: int) -> None:
    """``count`` of our cache's conversations (spread over all of it) against transformers' ids and assistant
    masks."""
    tok, cache = hf_tokenizer(d), data.train.cache
    assert len(cache) == len(convs)
    for r in np.linspace(0, len(convs) - 1, count).astype(int):
        want = tok.apply_chat_template(convs[r], chat_template=tagged(), tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        s, e = cache.starts[r], cache.starts[r + 1]
        assert cache.tokens[s:e].tolist() == want["input_ids"], r
        assert cache.targets[s + 1:e].tolist() == want["assistant_masks"][1:], r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1000, help="conversations per batched transformers call")
    p.add_argument("--out", default=OUT)
    p.add_argument("--repeat", type=int, default=3, help="runs of each (interleaved); the fastest is reported, as "
                   "the machine's other work only ever slows a run")
    args = p.parse_args()
    convs = conversations(args.records)
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        d = tokenizer_dir(Path(tmp) / "tok", convs[:5000])
        f = Path(tmp) / "chat.jsonl"
        f.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
        tok, hf = load_tokenizer(str(d), None), hf_tokenizer(d)
        for run in range(args.repeat):
            section = DataSection(path=str(f), cache_dir=str(Path(tmp) / f"cache-{run}"), seq_len=args.seq_len,
                                  val_fraction=0.0)
            start = time.perf_counter()
            _, data = load_data(section, tok, seed=0)
            times = {"mobius load_data (.jsonl -> checked, rendered, tokenized, flagged, cached, packed)":
                     time.perf_counter() - start}
            times.update(time_stages(tok, convs))
            times.update(time_transformers(hf, convs, args.batch))
            best = {k: min(v, best.get(k, v)) for k, v in times.items()}
        check_equal(d, data, convs, min(1000, len(convs)))
        packing = {}
        for seq_len in (512, 1024, 2048, 4096):
            start = time.perf_counter()
            packed = build_chat_data(data.train.cache, DataSection(path=str(f), seq_len=seq_len, val_fraction=0.0),
                                     0, tok.pad_id)
            bound = packed.stats.fewest_blocks
            packing[seq_len] = (time.perf_counter() - start, packed.stats, bound)
    report(args, convs, data.stats, best, packing)


def report(args: argparse.Namespace, convs: list[list[dict]], stats, best: dict[str, float], packing: dict) -> None:
    n, tokens = len(convs), int(stats.tokens)
    rows = list(best.items())
    print(f"{n:,} conversations, {tokens:,} tokens ({tokens / n:.0f} per conversation), {stats.target_tokens:,} "
          f"targets; {platform.machine()}, {os.cpu_count()} cores; the fastest of {args.repeat} runs each\n")
    print(f"{'':82s} {'seconds':>8s} {'records/s':>10s} {'tokens/s':>11s}")
    for name, seconds in rows:
        print(f"{name:82s} {seconds:8.2f} {n / seconds:10,.0f} {tokens / seconds:11,.0f}")
    print(f"\n{'packing (best-fit decreasing)':30s} {'blocks':>8s} {'lower bound':>11s} {'efficiency':>10s} "
          f"{'dropped':>8s} {'seconds':>8s}")
    for seq_len, (seconds, st, bound) in packing.items():
        dropped = sum(c for c, _ in st.left_out.values())
        print(f"{'seq_len ' + str(seq_len):30s} {st.train_blocks:8,d} {bound:11,d} {100 * st.efficiency:9.1f}% "
              f"{dropped:8,d} {seconds:8.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"records": n, "tokens": tokens, "target_tokens": stats.target_tokens, "cores": os.cpu_count(),
           "repeat": args.repeat,
           "seconds": dict(rows), "records_per_s": {k: n / v for k, v in rows},
           "tokens_per_s": {k: tokens / v for k, v in rows},
           "packing": {str(k): {"blocks": st.train_blocks, "lower_bound": b, "efficiency": st.efficiency, "seconds": s,
                                "dropped": sum(c for c, _ in st.left_out.values())}
                       for k, (s, st, b) in packing.items()}}
    (out / "data_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {out / 'data_bench.json'}")


if __name__ == "__main__":
    main()
