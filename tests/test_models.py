"""Models against transformers: equal logits, lossless key maps, clear checkpoint errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_hf_model
from mobius.errors import CheckpointError
from mobius.models import build_model, get_preset, param_count, unit_specs
from mobius.checkpoint import save_model
from mobius.models.hf import from_hf, load_checkpoint, read_config, to_hf

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "gpt2": ("gpt2", {}),
    "gpt2-untied": ("gpt2", {"tie_word_embeddings": False}),
    "gpt2-gelu-inner": ("gpt2", {"activation_function": "gelu", "n_inner": 48}),
    "opt": ("opt", {}),
    "opt-350m-layout": ("opt", {"word_embed_proj_dim": 16, "do_layer_norm_before": False}),
    "opt-no-bias": ("opt", {"enable_bias": False}),
}


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant: str, tmp_path: Path) -> None:
    kind, kw = VARIANTS[variant]
    hf = make_hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "ck")
    ours = load_checkpoint(tmp_path / "ck").eval()
    ids = torch.randint(0, 300, (2, 40))
    torch.testing.assert_close(_logits(ours, ids), _logits(hf, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_key_map_round_trip(variant: str) -> None:
    kind, kw = VARIANTS[variant]
    hf = make_hf_model(kind, **kw)
    sd = hf.state_dict()
    cfg = read_config_from_model(hf)
    back = to_hf(from_hf(sd, cfg), cfg)
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def read_config_from_model(hf):
    from mobius.models.hf import config_from_hf

    return config_from_hf(hf.config.to_dict())


@pytest.mark.parametrize("variant", ["gpt2", "opt-350m-layout", "gpt2-untied"])
def test_saved_checkpoint_loads_in_transformers(variant: str, tmp_path: Path) -> None:
    import transformers

    kind, kw = VARIANTS[variant]
    hf = make_hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "in")
    ours = load_checkpoint(tmp_path / "in").eval()
    save_model(ours, tmp_path / "out")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 300, (1, 24))
    torch.testing.assert_close(_logits(again, ids), _logits(ours, ids), atol=1e-5, rtol=0)
    assert not list(tmp_path.glob(".out.tmp-*")), "temporary directory left behind"


def test_sharded_safetensors_and_bin(tmp_path: Path) -> None:
    hf = make_hf_model("opt")
    hf.save_pretrained(tmp_path / "ref")
    ours = load_checkpoint(tmp_path / "ref").eval()
    save_model(ours, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.randint(0, 300, (1, 16))
    torch.testing.assert_close(_logits(load_checkpoint(tmp_path / "sharded"), ids), _logits(hf, ids), atol=1e-5, rtol=0)
    # pytorch_model.bin, sharded with an index as older checkpoints are
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "ref" / "config.json").read_text())
    sd = hf.state_dict()
    keys = list(sd)
    half = len(keys) // 2
    torch.save({k: sd[k] for k in keys[:half]}, d / "pytorch_model-00001-of-00002.bin")
    torch.save({k: sd[k] for k in keys[half:]}, d / "pytorch_model-00002-of-00002.bin")
    wm = {k: f"pytorch_model-0000{1 if i < half else 2}-of-00002.bin" for i, k in enumerate(keys)}
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": wm}))
    torch.testing.assert_close(_logits(load_checkpoint(d), ids), _logits(hf, ids), atol=1e-5, rtol=0)


def test_bare_gpt2_checkpoint_without_prefix(tmp_path: Path) -> None:
    """Original GPT-2 files hold GPT2Model keys (no 'transformer.' prefix, legacy attn.bias buffers)."""
    from safetensors.torch import save_file

    hf = make_hf_model("gpt2")
    d = tmp_path / "bare"
    d.mkdir()
    (d / "config.json").write_text(hf.config.to_json_string())
    sd = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(sd, str(d / "model.safetensors"))
    ids = torch.randint(0, 300, (1, 16))
    torch.testing.assert_close(_logits(load_checkpoint(d), ids), _logits(hf, ids), atol=1e-5, rtol=0)


def _broken_copy(src: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_checkpoint_errors_name_the_key_or_file(gpt2_dir: Path, tmp_path: Path) -> None:
    missing = _broken_copy(gpt2_dir, tmp_path / "missing", lambda sd: sd.pop("transformer.h.1.mlp.c_fc.weight"))
    with pytest.raises(CheckpointError, match=r"transformer\.h\.1\.mlp\.c_fc\.weight"):
        load_checkpoint(missing)
    extra = _broken_copy(gpt2_dir, tmp_path / "extra", lambda sd: sd.update({"transformer.h.9.foo": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys.*h\.9\.foo"):
        load_checkpoint(extra)
    shape = _broken_copy(gpt2_dir, tmp_path / "shape",
                         lambda sd: sd.update({"transformer.ln_f.weight": torch.ones(7)}))
    with pytest.raises(CheckpointError, match=r"head\.ln_f\.weight.*\(7,\).*\(32,\)"):
        load_checkpoint(shape)
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text((gpt2_dir / "config.json").read_text())
    data = (gpt2_dir / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_checkpoint(trunc)
    with pytest.raises(CheckpointError, match="no config.json"):
        read_config(tmp_path)


def test_unit_specs_match_built_modules() -> None:
    for name in ("gpt2-tiny",):
        cfg = get_preset(name)
        model = build_model(cfg)
        specs = unit_specs(cfg)
        assert [s.name for s in specs] == model.unit_names()
        for spec, unit in zip(specs, model.units()):
            assert spec.param_count == sum(p.numel() for p in unit.parameters()), spec.name
            built = spec.build()
            assert sum(p.numel() for p in built.parameters()) == spec.param_count
        assert param_count(cfg) == sum(p.numel() for p in model.parameters())  # tied weight counted once
    from mobius.models.opt import OPTConfig

    for cfg in (OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=100,
                          max_position_embeddings=32, word_embed_proj_dim=16, do_layer_norm_before=False),
                OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=100,
                          max_position_embeddings=32, enable_bias=False)):
        model = build_model(cfg)
        for spec, unit in zip(unit_specs(cfg), model.units()):
            assert spec.param_count == sum(p.numel() for p in unit.parameters()), spec.name
        assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_preset_sizes_are_the_published_ones() -> None:
    expected = {"gpt2": 124.4e6, "gpt2-medium": 354.8e6, "gpt2-large": 774.0e6, "gpt2-xl": 1557.6e6,
                "opt-125m": 125.2e6, "opt-350m": 331.2e6, "opt-1.3b": 1315.8e6, "opt-2.7b": 2651.6e6,
                "opt-6.7b": 6658.5e6, "opt-13b": 12853.0e6, "opt-30b": 29974.4e6, "opt-66b": 65712.3e6,
                "gpt-1.4b": 1416.7e6}
    for name, n in expected.items():
        assert abs(param_count(get_preset(name)) - n) / n < 0.002, (name, param_count(get_preset(name)))


def test_tied_weights_are_one_parameter_and_units_compose() -> None:
    model = build_model(get_preset("gpt2-tiny"))
    assert model.head.lm_head.weight is model.embed.wte.weight
    assert model.tied_weights() == [("embed.wte.weight", "head.lm_head.weight")]
    ids = torch.randint(0, 100, (2, 16))
    x = ids
    for unit in model.units():
        x = unit(x)
    torch.testing.assert_close(x, model(ids))


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    from mobius.models.base import lm_loss, run_units

    torch.manual_seed(0)
    model = build_model(get_preset("gpt2-tiny"))
    ids = torch.randint(0, 100, (2, 16))
    grads = []
    for ckpt in (False, True):
        model.zero_grad()
        lm_loss(run_units(model.units(), ids, checkpoint_blocks=ckpt), ids).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_units_built_on_the_meta_device_skip_initialisation_and_torch_dynamo() -> None:
    """Every worker process builds its units on the meta device; torch's meta ``normal_`` would import
    ``torch._dynamo`` there (1.2-1.4 s of CPU a process), and it draws nothing anyway."""
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "from mobius.models import get_preset, on_meta\n"
             "from mobius.models.params import build_units, model_params\n"
             "units = build_units(get_preset('llama-3.2-1b'), 0, 3)\n"
             "assert len(model_params(get_preset('gpt2'))) == 148\n"
             "assert units[0].embed_tokens.weight.is_meta and tuple(units[0].embed_tokens.weight.shape) == (128256, 2048)\n"
             "with on_meta():\n"
             "    w = torch.nn.init.normal_(torch.empty(3))\n"
             "assert w.is_meta\n"
             "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
    x = torch.nn.init.normal_(torch.empty(1000), std=2.0)  # real tensors still draw
    assert 1.5 < x.std().item() < 2.5
