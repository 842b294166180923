"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers: equal logits, lossless key maps from
and to the Hub's per-expert layout, configs in and out, the router's load-balancing loss and its gradients,
published sizes, one-line errors for what is not implemented, the experts' kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_hf_moe
from test_models import _logits
from mobius.checkpoint import save_model
from mobius.errors import CheckpointError
from mobius.models import get_preset, param_count, unit_specs
from mobius.models import experts as moe_experts
from mobius.models.base import lm_loss_sum
from mobius.models.experts import balance_of, recording
from mobius.models.hf import config_from_hf, from_hf, load_checkpoint, to_hf
from mobius.models.moe import PUBLISHED, active_params

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-unnormed-dense-layer": ("qwen3_moe", {"norm_topk_prob": False, "num_hidden_layers": 3,
                                                     "mlp_only_layers": [1]}),
    "qwen3_moe-sparse-step-tied-bias": ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4,
                                                      "tie_word_embeddings": True, "attention_bias": True}),
    "mixtral": ("mixtral", {}),
    "mixtral-top1": ("mixtral", {"num_experts_per_tok": 1}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_key_map_match_transformers(variant: str, tmp_path: Path) -> None:
    """transformers writes the Hub's per-expert layout; mobius reads it into fused experts with equal logits and
    writes the same tensors back under the same keys."""
    model_type, kw = VARIANTS[variant]
    hf = make_hf_moe(model_type, **kw)
    hf.save_pretrained(tmp_path / "ck")
    ours = load_checkpoint(tmp_path / "ck")
    assert ours.config.family == model_type
    ids = torch.randint(0, 300, (2, 48))
    torch.testing.assert_close(_logits(ours, ids), _logits(hf, ids), atol=1e-5, rtol=0)
    from mobius.models.hf import read_state_dict

    sd = read_state_dict(tmp_path / "ck")
    assert any(".experts.1." in k for k in sd), "transformers wrote fused experts; the test expects the Hub's layout"
    cfg = config_from_hf(hf.config.to_dict())
    back = to_hf(from_hf(sd, cfg), cfg)
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_saved_checkpoint_loads_in_transformers(model_type: str, tmp_path: Path) -> None:
    """mobius's writer: config.json transformers reads, the Hub's per-expert keys in sharded safetensors."""
    import transformers

    make_hf_moe(model_type, num_hidden_layers=3).save_pretrained(tmp_path / "in")
    ours = load_checkpoint(tmp_path / "in")
    save_model(ours, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and any(".experts.3." in k for k in index)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[model_type]
    ids = torch.randint(0, 300, (1, 40))
    torch.testing.assert_close(_logits(again, ids), _logits(ours, ids), atol=1e-5, rtol=0)
    assert load_checkpoint(tmp_path / "out").config == ours.config


@pytest.mark.parametrize("variant", ["qwen3_moe-unnormed-dense-layer", "mixtral"])
def test_aux_loss_and_its_gradients_equal_transformers(variant: str, tmp_path: Path) -> None:
    """transformers' loss with output_router_logits (the next-token loss + coef * load-balancing loss over every
    MoE layer's logits together) and mobius's (the router log of one forward, Balance) give the same value and
    the same gradient to every weight, routers and embedding included."""
    import transformers

    model_type, kw = VARIANTS[variant]
    make_hf_moe(model_type, **kw).save_pretrained(tmp_path / "ck")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").train()
    ours = load_checkpoint(tmp_path / "ck").train()
    hf.router_aux_loss_coef = ours.config.router_aux_loss_coef = 0.3  # large enough to matter in the gradients
    ids = torch.randint(0, 300, (2, 24))
    out = hf(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    with recording() as log:
        logits = ours(ids)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # transformers' shift
    balance = balance_of(ours.config)
    aux = balance.value(log.count_sum(), log.prob_sum(), log.tokens)
    assert len(log.counts) == len(ours.config.moe_layers) and log.tokens == ids.numel()
    torch.testing.assert_close(aux, out.aux_loss, atol=1e-6, rtol=0)
    (lm_loss_sum(logits, targets) / (targets != -100).sum() + 0.3 * aux).backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[in_memory_name(name)].grad, atol=1e-7, rtol=1e-5, msg=name)


def in_memory_name(ours: str) -> str:
    """A mobius parameter's name in a transformers 5 model in memory (fused experts, Mixtral's ``mlp``)."""
    if ours.startswith("embed."):
        return "model." + ours.removeprefix("embed.")
    if ours.startswith("head."):
        return ours.removeprefix("head.") if "lm_head" in ours else "model." + ours.removeprefix("head.")
    return "model.layers." + ours.removeprefix("blocks.")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_sizes_are_the_published_ones(name: str) -> None:
    """Total parameters within 0.5% of the model card's, active ones (k of E experts, embedding and head whole)
    within 2% (the cards round to two or three digits)."""
    cfg = get_preset(name)
    total, active = PUBLISHED[name]
    assert param_count(cfg) == pytest.approx(total, rel=5e-3)
    assert active_params(cfg) == pytest.approx(active, rel=2e-2)


def test_unit_specs_count_what_the_modules_hold() -> None:
    """An MoE block's parameters are all its experts' (what it weighs); its FLOPs the k it routes each token to."""
    from mobius.models.moe import MoeBlock, moe_flops

    cfg = config_from_hf(make_hf_moe("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]).config.to_dict())
    specs = unit_specs(cfg)
    for k, spec in enumerate(specs):
        assert spec.param_count == sum(p.numel() for p in spec.build().parameters()), spec.name
    sparse, dense = specs[1], specs[2]
    assert sparse.signature != dense.signature and isinstance(sparse.build(), MoeBlock)
    H, I_, k, E = cfg.hidden_size, cfg.expert_size, cfg.num_experts_per_tok, cfg.num_experts
    tokens = 2 * 16
    experts_only = moe_flops(cfg, 0, 2, 16) - moe_flops(cfg, 1, 2, 16) + 2.0 * tokens * 3 * H * cfg.intermediate_size
    assert experts_only == pytest.approx(2.0 * tokens * (k * 3 * H * I_ + H * E))


@pytest.mark.parametrize("edit,message", [
    ({"router_jitter_noise": 0.1, "model_type": "mixtral"}, "router_jitter_noise=0.1 is not supported"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) exceeds num_experts"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers entry 5 is not a layer"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.* is not supported"),
])
def test_unsupported_config_fields_are_one_line_errors(edit: dict, message: str) -> None:
    model_type = edit.pop("model_type", "qwen3_moe")
    hf = make_hf_moe(model_type).config.to_dict()
    hf.update(edit)
    with pytest.raises(CheckpointError, match=message):
        config_from_hf(hf)


def test_a_dense_family_refuses_expert_fields() -> None:
    from conftest import make_hf_llama

    hf = make_hf_llama("qwen3").config.to_dict()
    hf["num_experts"] = 8
    with pytest.raises(CheckpointError, match="num_experts=8 is not supported for model_type 'qwen3' .*qwen3_moe"):
        config_from_hf(hf)


def test_every_token_reaches_its_experts_however_skewed(tmp_path: Path) -> None:
    """Dropless: a router that sends every token to the same two experts (the others get none) still gives
    transformers' logits."""
    hf = make_hf_moe("mixtral")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:2] = 0.01  # experts 0 and 1 win for positive inputs, ties go to the lowest
    hf.save_pretrained(tmp_path / "ck")
    ours = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 300, (2, 32))
    with recording() as log:
        logits = _logits(ours, ids)
    counts = log.count_sum()
    assert counts[2:].sum() < counts.sum()  # (most choices go to two experts)
    torch.testing.assert_close(logits, _logits(hf, ids), atol=1e-5, rtol=0)


def test_grouped_kernel_equals_the_loop_over_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch._grouped_mm over the sorted rows (the GPU's path; its CPU forward runs here) equals one matmul per
    expert, an expert without tokens included; LoRA's two extra grouped matmuls too."""
    from mobius.models.experts import ExpertAdapters, ExpertShape, Experts, Routing

    torch.manual_seed(0)
    for shape in (ExpertShape(4, 32, 16), ExpertShape(4, 32, 16, transposed=True, bias=True,
                                                        activation="clamped_swiglu")):
        experts = Experts(shape)
        for p in experts.parameters():
            p.data.normal_(0, 0.3)
        experts.adapters = ExpertAdapters(shape, {"gate_up_proj": 8, "down_proj": 8}, {"gate_up_proj": 2.0,
                                                                                      "down_proj": 0.5})
        for p in experts.adapters.parameters():
            p.data.normal_(0, 0.3)
        x = torch.randn(24, 32)
        chosen = torch.randint(0, 3, (24, 2))  # expert 3 gets no token
        chosen[:, 1] = (chosen[:, 0] + 1) % 3
        routing = Routing(torch.rand(24, 2), chosen)
        monkeypatch.setattr(moe_experts, "KERNEL", "loop")
        loop = experts(x, routing)
        monkeypatch.setattr(moe_experts, "KERNEL", "grouped")
        torch.testing.assert_close(experts(x, routing), loop, atol=1e-5, rtol=1e-5)
