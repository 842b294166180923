"""The Llama architecture (Llama, Mistral, Qwen2, Qwen3) against transformers: equal logits, lossless
key maps, configs in and out, published sizes, one-line errors for what is not implemented, the
checkpoint's tokens around each document, and the planner's activation memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_hf_llama, save_special_tokenizer
from test_models import _logits
from mobius.checkpoint import save_model
from mobius.errors import CheckpointError, ConfigError
from mobius.models import build_model, get_preset, param_count, unit_specs
from mobius.models.hf import config_from_hf, from_hf, load_checkpoint, to_hf

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # wavelengths of a 64-position model cross all three bands
VARIANTS = {
    "llama-gqa2-untied": ("llama", {}),
    "llama-gqa1-tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama3-rope-biases": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0, "attention_bias": True,
                                     "mlp_bias": True}),
    "llama-rope-linear-mha": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                        "num_key_value_heads": 4}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral-window-covers": ("mistral", {"sliding_window": 64}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-gqa1": ("qwen2", {"num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "qwen3-bias-tied": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_key_map_match_transformers(variant: str, tmp_path: Path) -> None:
    model_type, kw = VARIANTS[variant]
    hf = make_hf_llama(model_type, **kw)
    hf.save_pretrained(tmp_path / "ck")
    ours = load_checkpoint(tmp_path / "ck")
    assert ours.config.family == model_type
    ids = torch.randint(0, 300, (2, 48))
    torch.testing.assert_close(_logits(ours, ids), _logits(hf, ids), atol=1e-5, rtol=0)
    sd = hf.state_dict()
    cfg = config_from_hf(hf.config.to_dict())
    back = to_hf(from_hf(sd, cfg), cfg)
    if cfg.tie_word_embeddings:
        sd = {**{k: v for k, v in sd.items() if k != "lm_head.weight"}, "lm_head.weight": sd["model.embed_tokens.weight"]}
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("variant", ["llama3-rope-biases", "llama-gqa1-tied", "mistral", "qwen2-tied", "qwen3"])
def test_saved_checkpoint_loads_in_transformers(variant: str, tmp_path: Path) -> None:
    """mobius's writer: config.json transformers reads, sharded safetensors with an index."""
    import transformers

    model_type, kw = VARIANTS[variant]
    make_hf_llama(model_type, **kw).save_pretrained(tmp_path / "in")
    ours = load_checkpoint(tmp_path / "in")
    save_model(ours, tmp_path / "out", max_shard_bytes=40_000)
    assert len(set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
                   .values())) > 1
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]
    ids = torch.randint(0, 300, (1, 40))
    torch.testing.assert_close(_logits(again, ids), _logits(ours, ids), atol=1e-5, rtol=0)
    assert load_checkpoint(tmp_path / "out").config == ours.config


def test_transformers_4_config_reads_like_5() -> None:
    """Checkpoints on disk carry transformers 4's rope_theta / rope_scaling (with the old "type" key)
    or 5's rope_parameters: both give one architecture."""
    v5 = make_hf_llama("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0).config.to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=500000.0, rope_scaling={**{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"},
                                                 "type": "llama3"})
    assert config_from_hf(v4) == config_from_hf(v5)
    assert config_from_hf(v4).rope_scaling["rope_type"] == "llama3"


# published parameter counts (the safetensors totals; Qwen3-1.7B's checkpoint also stores its tied head,
# the model card's 1.7B counts it once)
PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688, "qwen2.5-7b": 7_615_616_512, "qwen2.5-14b": 14_770_033_664,
    "qwen2.5-32b": 32_763_876_352, "qwen2.5-72b": 72_706_203_648, "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200, "qwen3-32b": 32_762_123_264, "mistral-7b": 7_248_023_552,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_sizes_are_the_published_ones(name: str) -> None:
    assert param_count(get_preset(name)) == PUBLISHED[name]


@pytest.mark.parametrize("variant", ["llama3-rope-biases", "llama-gqa1-tied", "qwen2-tied", "qwen3-bias-tied"])
def test_unit_specs_count_what_the_modules_hold(variant: str) -> None:
    model_type, kw = VARIANTS[variant]
    cfg = config_from_hf(make_hf_llama(model_type, **kw).config.to_dict())
    model = build_model(cfg)
    for spec, unit in zip(unit_specs(cfg), model.units()):
        assert spec.param_count == sum(p.numel() for p in unit.parameters()), spec.name
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())  # a tied weight counted once
    assert not list(model.buffers()), "units hold no buffers (the pipeline binds parameters only)"


# ---- what is not implemented: one line naming the field and its value ----------------------------
UNSUPPORTED = [
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn' is not supported"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type='dynamic' is not supported"),
    ("llama", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ("llama", {"pretraining_tp": 2}, r"pretraining_tp=2 is not supported"),
    ("llama", {"quantization_config": {"quant_method": "awq"}}, r"quantization_config=.*awq.* is not supported"),
    ("llama", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5 is not supported"),
    ("mistral", {"attention_bias": True}, r"attention_bias=True is not supported for model_type 'mistral'"),
    ("qwen2", {"attention_bias": True}, r"attention_bias=True is not supported for model_type 'qwen2'"),
    ("qwen3", {"mlp_bias": True}, r"mlp_bias=True is not supported for model_type 'qwen3'"),
    ("qwen2", {"num_experts": 8}, r"num_experts=8 is not supported for model_type 'qwen2' \(its mixture-of-experts"),
    ("mistral", {"num_local_experts": 8}, r"num_local_experts=8 is not supported for model_type 'mistral' \(its "
                                          r"mixture-of-experts families are .*mixtral"),
    ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}, r"layer_types entry 'chunked_attention'"),
    ("llama", {"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
]


@pytest.mark.parametrize("model_type,edit,message", UNSUPPORTED)
def test_unsupported_config_fields_are_one_line_errors(model_type: str, edit: dict, message: str) -> None:
    hf = make_hf_llama(model_type).config.to_dict()
    if "rope_scaling" in edit:
        hf.pop("rope_parameters")
    hf.update(edit)
    with pytest.raises(CheckpointError, match=message) as e:
        config_from_hf(hf, "ck/config.json")
    assert str(e.value).startswith("ck/config.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("model_type,fields", [("mistral", {"sliding_window": 32}),
                                               ("qwen2", {"use_sliding_window": True, "sliding_window": 32,
                                                          "max_window_layers": 1})])
def test_a_sliding_window_below_the_sequence_is_refused(model_type: str, fields: dict) -> None:
    cfg = config_from_hf(make_hf_llama(model_type, **fields).config.to_dict())
    cfg.check_sequence(32)  # the window covers the sequence: full attention, exactly
    with pytest.raises(ConfigError, match=r"sliding_window \(32\) is below data.seq_len \(48\)"):
        cfg.check_sequence(48)
    with pytest.raises(ConfigError, match=r"data.seq_len \(65\) exceeds the model's 64 positions"):
        cfg.check_sequence(65)


# ---- the checkpoint's own tokens around each document --------------------------------------------
@pytest.mark.parametrize("bos,eos,extra,expect_bos", [
    ("<|begin_of_text|>", "<|end_of_text|>", {}, True),  # Llama 3: bos from the config, added by mobius
    (None, "<|endoftext|>", {}, False),  # Qwen: no bos
    ("<s>", "</s>", {"add_bos_token": False}, False),  # a tokenizer that says not to
    ("<|endoftext|>", "<|endoftext|>", {}, False),  # GPT-2 / OPT: one token between documents
])
def test_documents_are_packed_with_the_configured_tokens(tmp_path: Path, bos: str | None, eos: str, extra: dict,
                                                         expect_bos: bool) -> None:
    from mobius.data import load_tokenizer, tokenize_to_cache

    ck = save_special_tokenizer(tmp_path / "ck", bos, eos, **extra)
    tok = load_tokenizer(None, str(ck))
    assert tok.eos_id == tok.tokenizer.token_to_id(eos)
    assert tok.bos_id == (tok.tokenizer.token_to_id(bos) if expect_bos else None)
    (tmp_path / "docs").mkdir()
    for i, text in enumerate(["first doc", "second"]):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    ids = list(tokenize_to_cache(str(tmp_path / "docs"), "text", tok, str(tmp_path / "cache")))
    lead = [tok.bos_id] if expect_bos else []
    assert ids == lead + list(b"first doc") + [tok.eos_id] + lead + list(b"second") + [tok.eos_id]
    tok.save(tmp_path / "saved")  # a checkpoint's tokenizer reads back the same (resume tokenizes alike)
    again = load_tokenizer(None, str(tmp_path / "saved"))
    assert (again.bos_id, again.eos_id, again.name) == (tok.bos_id, tok.eos_id, tok.name)
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["eos_token"] == eos


def test_a_config_naming_a_missing_token_is_an_error(tmp_path: Path) -> None:
    from mobius.data import load_tokenizer
    from mobius.errors import MobiusError

    ck = save_special_tokenizer(tmp_path / "ck", None, "<|endoftext|>")
    (ck / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    with pytest.raises(MobiusError, match=r"eos_token '<\|im_end\|>' is not in the tokenizer's vocabulary"):
        load_tokenizer(None, str(ck))


# ---- the planner's picture of these models -------------------------------------------------------
@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen3", {"head_dim": 24})])
def test_estimated_activation_memory_matches_autograd(model_type: str, extra: dict) -> None:
    """The estimate's saved bytes of a GQA block and of a large-vocabulary head against what autograd
    saves on the CPU (saved-tensor hooks; the input counted as the memory model counts it)."""
    from mobius.models.llama import LlamaConfig
    from partition.estimate import estimate_units
    from partition.measure import profile_units

    cfg = LlamaConfig(model_type=model_type, vocab_size=16384, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, **extra)
    specs = unit_specs(cfg)
    for precision, tol in (("fp32", 0.03), ("bf16", 0.07)):
        measured = profile_units(specs, 2, 64, precision, "cpu", reps=1, warmup=0).units
        estimated = estimate_units(specs, 2, 64, precision, "h100").units
        for m, e in zip(measured[1:], estimated[1:]):
            assert e.saved_bytes == pytest.approx(m.saved_bytes + m.in_bytes, rel=tol), (precision, m.kind)


def test_gqa_flops_count_the_narrow_kv_projections() -> None:
    """Llama-3.1-8B: 218M parameters per layer, 2 FLOPs per parameter and token, plus attention."""
    specs = unit_specs(get_preset("llama-3.1-8b"))
    block = specs[1]
    assert block.param_count == 218_112_000
    tokens, seq = 4 * 2048, 2048
    attention = 2.0 * 4 * seq * seq * 4096
    assert block.fwd_flops(4, seq) == pytest.approx(2.0 * tokens * (block.param_count - 2 * 4096) + attention)


# ---- every mode against the single-device reference (fp32, CPU workers) ---------------------------
def _run_cfg(tmp: Path, ck: Path, corpus: Path, out: str, **sections: dict):
    """test_zero's run config, at 3 steps of 4 micro-batches without evaluations."""
    from test_zero import _run_cfg as zero_run_cfg

    return zero_run_cfg(tmp, ck, corpus, out, **{**sections, "train": {"max_steps": 3, "micro_batches": 4,
                                                                       "eval_every": 0, **sections.get("train", {})}})


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path, corpus: Path):
    from mobius.app.run import train

    tmp = tmp_path_factory.mktemp("llama-ref")
    result = train(_run_cfg(tmp, llama_checkpoint, corpus, "ref"))
    return tmp / "ref", result.losses


MODES = {  # 12 units: embed, 10 blocks, head (untied: the ends may stay on the GPU)
    "pipeline-2-resident-kept": {"mode": "pipeline", "devices": 2, "stages": 6, "resident_stages": [1, 5],
                                 "kept_stages": [0, 2, 3]},
    "pipeline-4-resident-kept-swapped": {"mode": "pipeline", "devices": 4, "stages": 8, "resident_stages": [2],
                                         "kept_stages": [1, 4]},
    "zero-2": {"mode": "zero", "devices": 2},
    "auto-2": {"mode": "auto", "devices": 2},  # whichever mode auto picks on CPU workers
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_a_llama_like_the_reference(tmp_path: Path, llama_checkpoint: Path, corpus: Path,
                                                      llama_reference, mode: str) -> None:
    from mobius.app.run import train
    from mobius.models.hf import read_state_dict

    ref_dir, ref_losses = llama_reference
    extra = {"zero": {"chunk_size": 3001, "gpu_chunks": 3}} if mode.startswith("zero") else {}
    result = train(_run_cfg(tmp_path, llama_checkpoint, corpus, "run", parallel=MODES[mode], **extra))
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    want, got = read_state_dict(ref_dir / "final"), read_state_dict(result.final_dir)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=k)
    if mode.startswith("pipeline"):
        plan = json.loads((tmp_path / "run" / "plan.json").read_text())
        assert (plan["resident"], plan["kept"]) == (MODES[mode]["resident_stages"], MODES[mode]["kept_stages"])


# ---- the shipped configs: a plan that fits, or one line saying which memory does not --------------
@pytest.mark.parametrize("config,fits", [("finetune-llama-3.1-8b", True), ("finetune-qwen2.5-14b", True),
                                         ("finetune-qwen3-32b", False)])
@pytest.mark.slow
def test_mobius_plan_on_the_shipped_configs(config: str, fits: bool, capsys: pytest.CaptureFixture) -> None:
    """On an 8-GPU PCIe box with 300 GiB of host memory: 8B and 14B fit (14-18 bytes per parameter on the
    host); 32B needs 427 GiB even with half gradient downloads, said in one line with both figures and the
    optimizer states' rule that would fit."""
    from test_partition_plan import _run_plan

    from mobius.errors import MobiusError

    root = Path(__file__).resolve().parents[1]
    argv = [str(root / "configs" / f"{config}.yaml"), "--topology",
            str(root / "tests" / "fixtures" / "topology" / "topo8_4x4_nic.txt"), "--parallel.devices=8",
            "--partition.host_memory_gib=300", "--partition.time_limit_s=3", "--json"]
    if not fits:
        with pytest.raises(MobiusError, match=r"host memory does not suffice: the swapped stages need 427\.2 GiB "
                                              r"\(14 bytes per parameter, train\.optimizer_states=fp32, half "
                                              r"gradient downloads\), 300\.0 GiB .*; it fits with "
                                              r"train\.optimizer_states=int8 \(2[0-9.]+ GiB\)$"):
            _run_plan(argv)
        return
    assert _run_plan(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_gpus"] == 8 and plan["seq_len"] == 2048 and plan["host_bytes"] <= 300 * 2**30
    assert max(plan["peak_bytes"]) <= plan["gpu_memory_bytes"]
    assert plan["unit_names"][-1] == "head" and plan["predicted_step_s"] > 0


# ---- on a GPU (skipped without one) --------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision,atol", [("fp32", 1e-4), ("bf16", 3e-2)])
def test_llama_pipeline_on_cuda_matches_reference(tmp_path: Path, llama_checkpoint: Path, corpus: Path,
                                                  precision: str, atol: float) -> None:
    """GQA through the GPU's attention kernels and the rotary tables on the device: two workers sharing
    the GPU, resident, kept and swapped stages, against the single-GPU reference."""
    from mobius.app.run import train

    torch.backends.cuda.matmul.allow_tf32 = False
    dev, tr = {"device": "cuda"}, {"precision": precision}
    ref = train(_run_cfg(tmp_path, llama_checkpoint, corpus, "ref", parallel=dev, train=tr))
    pipe = train(_run_cfg(tmp_path, llama_checkpoint, corpus, "pipe", train=tr, partition={"gpu_memory_gib": 4.0},
                          parallel={**dev, **MODES["pipeline-2-resident-kept"]}))
    torch.testing.assert_close(torch.tensor(pipe.losses), torch.tensor(ref.losses), rtol=0, atol=atol)
