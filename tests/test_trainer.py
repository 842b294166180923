"""The reference trainer: learning, exact resume, precisions, checkpoints that transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mobius.config import Config, config_from_dict
from mobius.app.run import train


def _cfg(tmp_path: Path, data: Path, out: str = "run", **sections) -> Config:
    raw = {
        "model": {"preset": "gpt2-tiny"},
        "data": {"path": str(data), "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
        "train": {"max_steps": 6, "micro_batch_size": 2, "micro_batches": 2, "lr": 3e-3, "warmup_steps": 2,
                  "eval_every": 3, "eval_batches": 2, "seed": 7},
        "parallel": {"mode": "single", "device": "cpu"},
        "output": {"dir": str(tmp_path / out), "plot": False},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def test_loss_falls_and_metrics_are_written(tmp_path: Path, text_file: Path) -> None:
    cfg = _cfg(tmp_path, text_file, train={"max_steps": 30, "eval_every": 10})
    result = train(cfg)
    assert result.losses[-1] < result.losses[0] - 1.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm"):
        assert key in rows[0]
    assert sum("eval_loss" in r for r in rows) == 3 and rows[-1]["eval_ppl"] > 1


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_gives_the_same_losses(tmp_path: Path, text_file: Path, dropout: float) -> None:
    """N steps, stop, resume, N more steps == 2N steps straight (losses and weights)."""
    import shutil

    sections = dict(model={"dropout": dropout}, train={"max_steps": 8, "weight_decay": 0.1})
    straight = train(_cfg(tmp_path, text_file, "straight", **sections))
    interrupted = train(_cfg(tmp_path, text_file, "first", output={"save_every": 4, "keep_last": 1}, **sections))
    assert interrupted.losses == straight.losses  # checkpointing does not disturb training
    # a second run directory holding only what the first had written at step 4
    (tmp_path / "second" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step-000004",
                    tmp_path / "second" / "checkpoints" / "step-000004")
    resumed = train(_cfg(tmp_path, text_file, "second", **sections), resume="auto")
    assert resumed.losses[:4] == straight.losses[:4]
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(straight.losses), rtol=0, atol=1e-6)
    from mobius.models.hf import read_state_dict

    a, b = read_state_dict(tmp_path / "straight" / "final"), read_state_dict(tmp_path / "second" / "final")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_resume_auto_finds_latest_step_checkpoint(tmp_path: Path, text_file: Path) -> None:
    cfg = _cfg(tmp_path, text_file, train={"max_steps": 6}, output={"save_every": 2, "keep_last": 2})
    train(cfg)
    names = [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())]
    assert names == ["step-000002", "step-000004"]
    from mobius.errors import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg)
    result = train(_cfg(tmp_path, text_file, train={"max_steps": 6}), resume="auto")
    assert len(result.losses) == 6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path: Path, text_file: Path, precision: str) -> None:
    result = train(_cfg(tmp_path, text_file, train={"precision": precision, "max_steps": 12}))
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert result.losses[-1] < result.losses[0]


def test_fp16_overflow_skips_the_step() -> None:
    from mobius.optim import LossScaler

    s = LossScaler(enabled=True, scale=1024.0, growth_interval=2)
    assert s.update(found_inf=True) and s.scale == 512.0
    assert not s.update(found_inf=False) and not s.update(found_inf=False) and s.scale == 1024.0


def test_fine_tune_checkpoint_round_trips_through_transformers(tmp_path: Path, text_file: Path, gpt2_dir: Path) -> None:
    import transformers

    from mobius.data import byte_tokenizer
    from mobius.models.hf import load_checkpoint

    byte_tokenizer().save(gpt2_dir)  # the checkpoint's own tokenizer (257 tokens < vocab 300)
    cfg = _cfg(tmp_path, text_file, model={"checkpoint": str(gpt2_dir), "preset": None},
               train={"max_steps": 3, "lr": 1e-3})
    result = train(cfg)
    final = result.final_dir
    assert (final / "tokenizer.json").is_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    ours = load_checkpoint(final).eval()
    ids = torch.randint(0, 257, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=0)
    # the weights moved away from the starting checkpoint
    start = load_checkpoint(gpt2_dir)
    assert not torch.equal(start.embed.wte.weight, ours.embed.wte.weight)


@pytest.mark.slow
def test_demo_config_end_to_end_through_the_cli(tmp_path: Path, demo_data_cache: Path) -> None:
    """The embedded default, shortened: trains, evaluates, writes a checkpoint transformers loads."""
    import subprocess
    import sys

    import transformers

    from mobius.models.hf import load_checkpoint

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "mobius.cli", "train", str(root / "configs" / "demo.yaml"),
                        f"--output.dir={tmp_path / 'demo'}", "--train.max_steps=12", "--train.eval_every=6",
                        f"--data.cache_dir={demo_data_cache}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done: 12 steps" in r.stdout
    png = tmp_path / "demo" / "loss.png"  # the demo draws its picture (matplotlib is a dependency)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"loss plot: {png}" in r.stderr
    first = json.loads((tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["ready_s"] > 0 and {"data", "plan", "weights", "start"} <= set(first["ready"])
    assert f"ready in {first['ready_s']:.1f} s: " in r.stderr
    final = tmp_path / "demo" / "final"
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    ours = load_checkpoint(final).eval()
    ids = torch.randint(0, 257, (1, 64))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=0)
