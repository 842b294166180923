"""Conversations through ``mobius train``: the start-up line and metrics.jsonl carry the target tokens, the
pipeline on two CPU workers trains as single mode does, and a resumed run continues exactly."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from mobius.app.run import train
from mobius.config import Config, config_from_dict

TOPICS = ["lists", "tuples", "dicts", "sets", "strings", "files", "classes", "loops", "generators", "decorators"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120 short conversations (a system turn in some, two exchanges in others) in a .jsonl file."""
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    lines = []
    for i in range(120):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"What are {topic}? ({i})"},
                     {"role": "assistant", "content": f"{topic.capitalize()} are a Python feature, number {i % 7}."}]
        if i % 4 == 0:
            messages += [{"role": "user", "content": "And more?"}, {"role": "assistant", "content": "That is all."}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(tmp: Path, chats: Path, out: str, **sections) -> Config:
    raw = {"model": {"preset": "gpt2-tiny"},
           "data": {"path": str(chats), "chat_template": "builtin:demo-chat", "seq_len": 192,
                    "cache_dir": str(tmp / "cache")},
           "train": {"max_steps": 4, "micro_batch_size": 2, "micro_batches": 2, "lr": 3e-3, "warmup_steps": 1,
                     "eval_every": 2, "eval_batches": 2, "seed": 5},
           "parallel": {"mode": "single", "device": "cpu"},
           "partition": {"cache_dir": str(tmp / "cache")},
           "output": {"dir": str(tmp / out), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_chat_trains_alike_in_single_mode_and_the_pipeline(tmp_path: Path, chats: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        single = train(_cfg(tmp_path, chats, "single"))
    assert "target tokens a step" in caplog.text
    pipeline = train(_cfg(tmp_path, chats, "pipeline", parallel={"mode": "pipeline", "devices": 2}))
    torch.testing.assert_close(torch.tensor(pipeline.losses), torch.tensor(single.losses), rtol=0, atol=1e-5)
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "pipeline")
    assert [r["target_tokens"] for r in a] == [r["target_tokens"] for r in b]
    assert all(0 < r["target_tokens"] < 2 * 2 * 192 for r in a)  # answers only: fewer targets than positions
    assert abs(a[-1]["eval_loss"] - b[-1]["eval_loss"]) < 1e-5


def test_a_resumed_chat_run_continues_exactly(tmp_path: Path, chats: Path) -> None:
    straight = train(_cfg(tmp_path, chats, "straight"))
    train(_cfg(tmp_path, chats, "first", output={"save_every": 2, "keep_last": 1}))
    (tmp_path / "second" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step-000002",
                    tmp_path / "second" / "checkpoints" / "step-000002")
    resumed = train(_cfg(tmp_path, chats, "second"), resume="auto")
    assert resumed.losses == straight.losses
    assert (tmp_path / "second" / "final" / "chat_template.jinja").is_file()  # the template trained with
