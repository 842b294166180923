"""``train.update: delayed`` (RoundPipe's one-step-delayed update) in single mode: against a plain torch
loop that implements the rule (full fine-tuning and LoRA), exact resume with an update in flight, fp16
overflow, the setting it refuses (half-precision gradient downloads), and the metrics lines. The
pipeline's and zero mode's delayed updates are held to single mode's in tests/test_pipeline_delayed.py
and tests/test_zero_delayed.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from conftest import make_hf_llama, save_special_tokenizer
from mobius import cli
from mobius.app.run import train
from mobius.assemble import initial_model, prepare_data, run_model_config
from mobius.checkpoint import COMPUTE_FILE
from mobius.config import Config, config_from_dict
from mobius.models.hf import load_checkpoint
from mobius.models.lora import trains
from mobius.models.peft import read_adapter

STEPS = 5  # all in the warm-up: the lr changes every step
CLIP = 0.05  # below every step's gradient norm: every step clips


def _cfg(tmp_path: Path, data: Path, out: str, update: str = "delayed", **sections: dict) -> Config:
    raw = {"model": {"preset": "gpt2-tiny", "dropout": 0.0},
           "data": {"path": str(data), "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": STEPS, "micro_batch_size": 2, "micro_batches": 2, "lr": 3e-3,
                     "warmup_steps": STEPS, "weight_decay": 0.1, "grad_clip": CLIP, "eval_every": 0,
                     "eval_batches": 1, "seed": 7, "update": update},
           "parallel": {"mode": "single", "device": "cpu"},
           "output": {"dir": str(tmp_path / out), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def _reference(cfg: Config, delayed: bool) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """The rule in plain torch: the model computes with its own parameters, torch's AdamW updates an fp32
    master copy; after each backward (and torch's norm clipping) the gradients go to the master and,
    delayed, the master (w_{t-1}) is copied into the model before the step makes w_t (sync: after it).
    Returns the losses per step, the newest weights (the model's state dict, master copied in) and the
    held-out loss with them."""
    tokenizer, data = prepare_data(cfg)
    model = initial_model(cfg, run_model_config(cfg, tokenizer, None)[0], None)
    compute = [p for p in model.parameters() if p.requires_grad]  # (a tied weight once)
    master = [torch.nn.Parameter(p.detach().clone()) for p in compute]
    t = cfg.train
    groups = [{"params": [m for m in master if m.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [m for m in master if m.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    losses = []
    for step in range(t.max_steps):
        batches = [data.next_batch(t.micro_batch_size) for _ in range(t.micro_batches)]
        total = 0.0
        for b in batches:
            loss = torch.nn.functional.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten())
            (loss / len(batches)).backward()
            total += float(loss.detach())
        losses.append(total / len(batches))
        assert float(torch.nn.utils.clip_grad_norm_(compute, t.grad_clip)) > t.grad_clip  # it clips
        with torch.no_grad():
            for c, m in zip(compute, master):
                m.grad, c.grad = c.grad, None
                if delayed:
                    c.copy_(m)
            for g in opt.param_groups:
                g["lr"] = t.lr * (step + 1) / t.warmup_steps
            opt.step()
            opt.zero_grad(set_to_none=True)
            for c, m in zip(compute, master):
                if not delayed or step == t.max_steps - 1:  # the end: the newest weights, to compare
                    c.copy_(m)
    with torch.no_grad():
        held_out = [float(torch.nn.functional.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten()))
                    for b in data.eval_batches(t.micro_batch_size, t.eval_batches)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, sum(held_out) / len(held_out)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_close(ours: dict[str, torch.Tensor], want: dict[str, torch.Tensor], names: list[str]) -> None:
    assert names
    for name in names:
        torch.testing.assert_close(ours[name], want[name], rtol=0, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def delayed_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> tuple[Config, object]:
    """gpt2-tiny (tied head) trained STEPS steps with train.update=delayed through mobius's entry."""
    tmp = tmp_path_factory.mktemp("delayed")
    cfg = _cfg(tmp, corpus, "run")
    return cfg, train(cfg)


def test_delayed_equals_the_plain_torch_rule(delayed_run: tuple[Config, object]) -> None:
    """Losses per step and the final weights within 1e-6 of the reference; the reference's sync run
    differs from step 2 on (steps 1 and 2 both compute with w_0), so sync cannot pass."""
    cfg, result = delayed_run
    want, newest, held_out = _reference(cfg, delayed=True)
    sync, _, _ = _reference(cfg, delayed=False)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want), rtol=0, atol=1e-6)
    assert result.eval_losses[-1][1] == pytest.approx(held_out, abs=1e-6)  # evaluated with the newest weights
    assert sync[0] == pytest.approx(want[0], abs=1e-6) and all(abs(a - b) > 1e-4 for a, b in zip(sync[1:], want[1:]))
    rows = _metrics(result.final_dir.parent)
    assert [r["lr"] for r in rows] == pytest.approx([cfg.train.lr * s / STEPS for s in range(1, STEPS + 1)])
    assert all(r["grad_norm"] > CLIP for r in rows)
    ours = load_checkpoint(result.final_dir).state_dict()
    _assert_close(ours, newest, list(newest))


def test_lora_delayed_equals_the_reference_on_the_adapters(tmp_path: Path, corpus: Path) -> None:
    """A tiny Llama with rank-4 adapters (only they train): losses and the adapters the final checkpoint
    holds equal the reference's, whose sync run differs."""
    ck = tmp_path / "llama"
    make_hf_llama("llama", num_hidden_layers=2, bos_token_id=256, eos_token_id=257).save_pretrained(ck)
    save_special_tokenizer(ck, "<|begin_of_text|>", "<|end_of_text|>")
    cfg = _cfg(tmp_path, corpus, "lora", model={"checkpoint": str(ck), "preset": None, "dropout": None},
               lora={"rank": 4, "alpha": 8.0}, train={"lr": 1e-2})
    result = train(cfg)
    want, newest, _ = _reference(cfg, delayed=True)
    sync, _, _ = _reference(cfg, delayed=False)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want), rtol=0, atol=1e-6)
    assert any(abs(a - b) > 1e-4 for a, b in zip(sync[2:], want[2:]))
    tokenizer, _ = prepare_data(cfg)
    mc = run_model_config(cfg, tokenizer, None)[0]
    ours = read_adapter(result.final_dir, mc)
    adapters = [n for n in newest if trains(mc, n)]
    assert sorted(ours) == sorted(adapters) and all("lora" in n for n in adapters)
    _assert_close(ours, newest, adapters)


def test_resume_with_an_update_in_flight_is_exact(tmp_path: Path, corpus: Path) -> None:
    """4 steps straight == 2 steps, a checkpoint, --resume, 2 more: bit-identical losses and weights; the
    checkpoint holds the compute weights (w_1, not the newest w_2)."""
    sections = {"train": {"max_steps": 4, "warmup_steps": 4}}
    straight = train(_cfg(tmp_path, corpus, "straight", **sections))
    first = train(_cfg(tmp_path, corpus, "first", output={"save_every": 2, "keep_last": 1}, **sections))
    assert first.losses == straight.losses
    step2 = tmp_path / "first" / "checkpoints" / "step-000002"
    from safetensors.torch import load_file

    compute, newest = load_file(str(step2 / COMPUTE_FILE)), load_checkpoint(step2).state_dict()
    assert set(compute) == set(newest) - {"head.lm_head.weight"}  # the tied head under the embedding's name
    assert all(v.dtype == torch.float32 for v in compute.values())
    assert any(not torch.equal(v, newest[k]) for k, v in compute.items())  # one update behind
    (tmp_path / "second" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step2, tmp_path / "second" / "checkpoints" / step2.name)
    resumed = train(_cfg(tmp_path, corpus, "second", **sections), resume="auto")
    assert resumed.losses == straight.losses
    a, b = load_checkpoint(straight.final_dir).state_dict(), load_checkpoint(resumed.final_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [(r["step"], r["update"]) for r in _metrics(tmp_path / "second")] == [(3, "delayed"), (4, "delayed")]


def test_resume_across_update_rules(tmp_path: Path, corpus: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sync checkpoint resumed delayed computes its first step with the newest weights (as sync does);
    a delayed checkpoint resumed sync drops its compute weights (its step 3 computes with w_2, not w_1);
    each says so in one line."""
    sections = {"train": {"max_steps": 3, "warmup_steps": 3}, "output": {"save_every": 2, "keep_last": 1}}
    sync = train(_cfg(tmp_path, corpus, "sync", "sync", **sections))
    delayed = train(_cfg(tmp_path, corpus, "delayed", **sections))
    resumed = {}
    for run, other in (("sync", "delayed"), ("delayed", "sync")):
        shutil.rmtree(tmp_path / run / "final")
        caplog.clear()
        with caplog.at_level(logging.INFO):
            resumed[run] = train(_cfg(tmp_path, corpus, run, other, **sections), resume="auto")
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"train.update={other}: resuming")]
        assert len(said) == 1, said
    assert resumed["sync"].losses == sync.losses
    assert resumed["delayed"].losses[:2] == delayed.losses[:2] and resumed["delayed"].losses[2] != delayed.losses[2]


def test_fp16_overflow_skips_the_update_and_still_hands_over(tmp_path: Path, corpus: Path) -> None:
    """fp16 on the CPU: an overflowing step 2 makes no update (w_2 == w_1, one optimizer step, the loss
    scale halved) and the model then computes with w_1 (the master); step 3 updates again."""
    from mobius.optim import lr_at
    from scheduler.single_engine import SingleEngine

    cfg = _cfg(tmp_path, corpus, "fp16", train={"precision": "fp16"})
    tokenizer, data = prepare_data(cfg)
    engine = SingleEngine(initial_model(cfg, run_model_config(cfg, tokenizer, None)[0], None), cfg,
                          torch.device("cpu"))
    t = cfg.train

    def step(s: int):
        return engine.train_step(s, [data.next_batch(t.micro_batch_size) for _ in range(t.micro_batches)],
                                 lr_at(s, t))

    def snapshot(named) -> list[torch.Tensor]:
        return [p.detach().clone() for _, p in named]

    w0 = snapshot(engine.named)
    assert not step(0).skipped
    w1 = snapshot(engine.weights.named)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(engine.named), w0))  # step 2 computes with w_0
    engine.rule.scaler.scale = 2.0**127  # the scaled loss overflows
    stats = step(1)
    assert stats.skipped and engine.rule.optimizer_step == 1 and engine.rule.loss_scale == 2.0**126
    assert all(torch.equal(a, b) for a, b in zip(snapshot(engine.weights.named), w1))  # w_2 == w_1
    assert all(torch.equal(a, b) for a, b in zip(snapshot(engine.named), w1))  # step 3 computes with w_1
    engine.rule.scaler.scale = 2.0**10
    stats = step(2)
    assert not stats.skipped and torch.isfinite(torch.tensor(stats.loss)) and engine.rule.optimizer_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(snapshot(engine.weights.named), w1))


def test_delayed_refuses_half_gradient_downloads(tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture) -> None:
    """Every mode runs delayed updates (pipeline: tests/test_pipeline_delayed.py, zero:
    tests/test_zero_delayed.py), but not with the pipeline's half-precision gradient downloads, which would
    land on the compute weights: one error line naming both settings, exit 2, no run directory left."""
    run_yaml = tmp_path / "run.yaml"
    cfg = _cfg(tmp_path, corpus, "out", train={"precision": "bf16"}, partition={"cache_dir": str(tmp_path / "cache")})
    run_yaml.write_text(json.dumps(cfg.to_dict()))
    code = cli.main(["train", str(run_yaml), "--parallel.mode=pipeline", "--parallel.devices=2",
                     "--parallel.grad_download=half"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mobius: error: ")]
    assert code == 2 and len(errors) == 1, errors
    assert "parallel.grad_download=half" in errors[0] and "train.update=delayed" in errors[0]
    assert not (tmp_path / "out").exists()


def test_metrics_lines_and_the_log_name_the_update_rule(tmp_path: Path, corpus: Path,
                                                       delayed_run: tuple[Config, object],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    assert [r["update"] for r in _metrics(delayed_run[1].final_dir.parent)] == ["delayed"] * STEPS
    with caplog.at_level(logging.INFO):
        train(_cfg(tmp_path, corpus, "sync", "sync", train={"max_steps": 2}))
    assert [r["update"] for r in _metrics(tmp_path / "sync")] == ["sync"] * 2
    assert not any("train.update=delayed" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(_cfg(tmp_path, corpus, "delayed", train={"max_steps": 1}))
    assert any(r.getMessage().startswith("train.update=delayed: ") for r in caplog.records)
