"""YAML configs: every shipped file loads, bad keys are named with their file, overrides apply."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mobius.config import Config, describe_fields, load_config, parse_overrides
from mobius.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    names = {p.name for p in CONFIGS}
    assert "demo.yaml" in names
    for model in ("opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "gpt2-xl", "llama-3.1-8b", "qwen2.5-14b", "qwen3-32b"):
        assert f"finetune-{model}.yaml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    from mobius.assemble import architecture

    assert architecture(cfg).family in ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                                        "gpt_oss")


def test_placeholders_are_rejected_before_running() -> None:
    cfg = load_config(ROOT / "configs" / "finetune-opt-13b.yaml")
    with pytest.raises(ConfigError, match=r"finetune-opt-13b\.yaml: model\.checkpoint is still a placeholder"):
        cfg.check_ready()


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "run.yaml"
    f.write_text(text)
    return f


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  lerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"run\.yaml: unknown key train\.lerning_rate"):
        load_config(f)
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrian:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown section 'trian' \(did you mean train\?\)"):
        load_config(f)


def test_types_and_values_are_checked(tmp_path: Path) -> None:
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  max_steps: ten\n")
    with pytest.raises(ConfigError, match=r"train\.max_steps must be int, got 'ten'"):
        load_config(f)
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  precision: fp8\n")
    with pytest.raises(ConfigError, match=r"train\.precision must be one of fp32\|bf16\|fp16"):
        load_config(f)
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  micro_batches: 0\n")
    with pytest.raises(ConfigError, match=r"train\.micro_batches must be >= 1, got 0"):
        load_config(f)
    f = _write(tmp_path, "data:\n  seq_len: 64\n")
    with pytest.raises(ConfigError, match="model.checkpoint"):
        load_config(f)


def test_overrides(tmp_path: Path) -> None:
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  lr: 1.0e-3\n")
    cfg = load_config(f, ["--train.lr=5e-4", "--train.max_steps", "7", "--parallel.prefetch=false",
                          "--model.dropout=0.1"])
    assert cfg.train.lr == 5e-4 and cfg.train.max_steps == 7 and cfg.parallel.prefetch is False
    assert cfg.model.dropout == 0.1
    assert parse_overrides(["--data.tokenizer=null"]) == {"data": {"tokenizer": None}}
    with pytest.raises(ConfigError, match=r"unknown key train\.nope"):
        load_config(f, ["--train.nope=1"])
    with pytest.raises(ConfigError, match="overrides look like"):
        load_config(f, ["train.lr=1"])


TYPED_OVERRIDES = {  # override -> (section, key, the value the config holds): the key's type reads the text
    "--output.dir=runs/exp #3": ("output", "dir", "runs/exp #3"),  # YAML would start a comment at " #"
    "--output.dir=123": ("output", "dir", "123"),
    "--data.path=data/a: b.txt": ("data", "path", "data/a: b.txt"),
    "--data.text_field=yes": ("data", "text_field", "yes"),  # YAML would read a boolean
    "--data.tokenizer=tok #1/tokenizer.json": ("data", "tokenizer", "tok #1/tokenizer.json"),
    "--data.tokenizer=null": ("data", "tokenizer", None),
    "--data.tokenizer=": ("data", "tokenizer", None),
    "--data.tokenizer='null'": ("data", "tokenizer", "null"),  # quoted: a YAML string
    '--parallel.p2p="off"': ("parallel", "p2p", "off"),
    "--model.preset=gpt2 #x": ("model", "preset", "gpt2 #x"),
    "--parallel.p2p=off": ("parallel", "p2p", "off"),
    "--parallel.prefetch=no": ("parallel", "prefetch", False),
    "--data.accept_new_data=true": ("data", "accept_new_data", True),
    "--train.lr=1e-4": ("train", "lr", 1e-4),
    "--train.max_steps=7": ("train", "max_steps", 7),
    "--parallel.resident_stages=[0, 2]": ("parallel", "resident_stages", [0, 2]),
    "--model.dropout=null": ("model", "dropout", None),
}


@pytest.mark.parametrize("override", list(TYPED_OVERRIDES))
def test_an_override_means_what_was_typed(override: str, tmp_path: Path) -> None:
    section, key, value = TYPED_OVERRIDES[override]
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\n")
    assert getattr(getattr(load_config(f, [override]), section), key) == value


def test_an_override_of_a_number_is_still_checked(tmp_path: Path) -> None:
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\n")
    with pytest.raises(ConfigError, match=r"train\.max_steps must be int, got 'ten'"):
        load_config(f, ["--train.max_steps=ten"])


def test_help_lists_every_field() -> None:
    text = describe_fields()
    for key in ("model.checkpoint", "data.seq_len", "train.micro_batches", "train.precision", "parallel.mode",
                "parallel.devices", "output.dir", "partition.solver"):
        assert key in text


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mobius.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    f = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  lerning_rate: 0.1\n")
    r = _cli("train", str(f), cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "unknown key train.lerning_rate" in r.stderr and "run.yaml" in r.stderr
    assert "Traceback" not in r.stderr
    r = _cli("train", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = _cli("train", str(ROOT / "configs" / "finetune-opt-1.3b.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "placeholder" in r.stderr and "Traceback" not in r.stderr


QUICK = """
import sys
from mobius import cli
for argv in (["--version"], ["--help"], ["train", "--help"], ["topo", "--help"], ["train", sys.argv[1]]):
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    print("exit", code, "torch" in sys.modules)
"""


def test_cli_version_and_help(tmp_path: Path) -> None:
    from mobius import __version__

    r = _cli("--version", cwd=ROOT)
    assert r.returncode == 0 and __version__ in r.stdout
    # none of these imports torch (1.5-3 s): a typo in a run file is reported at once
    bad = _write(tmp_path, "model:\n  preset: gpt2-tiny\ntrain:\n  lerning_rate: 0.1\n")
    r = subprocess.run([sys.executable, "-c", QUICK, str(bad)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    ends = [line for line in r.stdout.splitlines() if line.startswith("exit ")]
    assert ends == ["exit 0 False"] * 4 + ["exit 2 False"], r.stdout + r.stderr
    assert "unknown key train.lerning_rate" in r.stderr
    r = _cli("train", "--help", cwd=ROOT)
    assert r.returncode == 0 and "train.micro_batch_size" in r.stdout
    assert "lora.rank (default 0, >= 0)" in r.stdout and "lora.targets (default ['all-linear'])" in r.stdout
