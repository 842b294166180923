"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers: equal logits, lossless key maps from
and to the Hub's per-expert layout, configs in and out, the router's load-balancing loss and its gradients,
published sizes, one-line errors for what is not implemented, the experts' kernels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_hf_moe
from spawned import EXACT_EPS
from test_models import _logits
from mobius.checkpoint import save_model
from mobius.errors import CheckpointError
from mobius.models import get_preset, param_count, unit_specs
from mobius.models import experts as moe_experts
from mobius.models.base import lm_loss_sum
from mobius.models.experts import balance_of, recording
from mobius.models.hf import config_from_hf, from_hf, load_checkpoint, to_hf
from mobius.models import gpt_oss, moe

VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-unnormed-dense-layer": ("qwen3_moe", {"norm_topk_prob": False, "num_hidden_layers": 3,
                                                     "mlp_only_layers": [1]}),
    "qwen3_moe-sparse-step-tied-bias": ("qwen3_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4,
                                                      "tie_word_embeddings": True, "attention_bias": True}),
    "mixtral": ("mixtral", {}),
    "mixtral-top1": ("mixtral", {"num_experts_per_tok": 1}),
    # sinks, YaRN, a 4-token window in every other layer (24-token rows), the clamped SwiGLU, biases everywhere
    "gpt_oss": ("gpt_oss", {"num_hidden_layers": 3}),
    "gpt_oss-full-attention-tied-top1": ("gpt_oss", {"layer_types": ["full_attention"] * 2, "num_experts_per_tok": 1,
                                                      "tie_word_embeddings": True}),
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
    per_expert = any(".experts.1." in k for k in sd)  # the Hub's layout (GPT-OSS's Hub checkpoints are fused)
    assert per_expert == (model_type != "gpt_oss"), "transformers' layout changed"
    cfg = config_from_hf(hf.config.to_dict())
    back = to_hf(from_hf(sd, cfg), cfg)
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_saved_checkpoint_loads_in_transformers(model_type: str, tmp_path: Path) -> None:
    """mobius's writer: config.json transformers reads, the Hub's per-expert keys in sharded safetensors."""
    import transformers

    make_hf_moe(model_type, num_hidden_layers=3).save_pretrained(tmp_path / "in")
    ours = load_checkpoint(tmp_path / "in")
    save_model(ours, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and any(".experts." in k for k in index)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                                    "gpt_oss": "GptOssForCausalLM"}[model_type]
    ids = torch.randint(0, 300, (1, 40))
    torch.testing.assert_close(_logits(again, ids), _logits(ours, ids), atol=1e-5, rtol=0)
    assert load_checkpoint(tmp_path / "out").config == ours.config


@pytest.mark.parametrize("variant", ["qwen3_moe-unnormed-dense-layer", "mixtral", "gpt_oss"])
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


@pytest.mark.parametrize("name", [*moe.PUBLISHED, *gpt_oss.PUBLISHED])
def test_preset_sizes_are_the_published_ones(name: str) -> None:
    """Total parameters within 0.5% of the model card's, active ones (k of E experts; Qwen and Mistral count the
    embedding and head, OpenAI the head) within 2% (the cards round to two or three digits)."""
    family = moe if name in moe.PUBLISHED else gpt_oss
    cfg = get_preset(name)
    total, active = family.PUBLISHED[name]
    assert param_count(cfg) == pytest.approx(total, rel=5e-3)
    assert family.active_params(cfg) == pytest.approx(active, rel=2e-2)


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
    ({"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4"}},
     "quant_method='mxfp4' is not supported; mobius trains floating-point experts: .*Mxfp4Config\\(dequantize=True\\)"),
    ({"model_type": "gpt_oss", "layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must name"),
    ({"model_type": "gpt_oss", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "rope_scaling must be YaRN's"),
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
        routing = Routing(torch.rand(24, 2), chosen, torch.rand(24, 4))
        monkeypatch.setattr(moe_experts, "KERNEL", "loop")
        loop = experts(x, routing)
        monkeypatch.setattr(moe_experts, "KERNEL", "grouped")
        torch.testing.assert_close(experts(x, routing), loop, atol=1e-5, rtol=1e-5)


# ---- LoRA on the experts, against PEFT ----------------------------------------------------------------------
LORA_STEPS, LORA_MICRO = 4, 2
LORA_CASES = {  # checkpoint, lora.targets, lora.train
    "qwen3_moe-all-linear": ("qwen3_moe", ["all-linear"], []),  # experts (gate_up at rank 2r), router adapter
    "mixtral-experts-router-trained": ("mixtral", ["q_proj", "w1", "w3", "w2"], ["router"]),
    "qwen3_moe-down-and-gate": ("qwen3_moe", ["down_proj", "gate"], ["norms"]),
    "gpt_oss-experts-router-trained": ("gpt_oss", ["q_proj", "v_proj", "gate_up_proj", "down_proj"], ["router"]),
}


def _lora_batches(step: int) -> list:
    from mobius.batch import MicroBatch

    g = torch.Generator().manual_seed(100 + step)
    tokens = [torch.randint(0, 300, (2, 17), generator=g) for _ in range(LORA_MICRO)]
    return [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]


def _peft_moe(ck: Path, start: dict, mc, targets: list[str], train: list[str]):
    """transformers' model under PEFT's LoRA as a user would ask for it (target_modules by transformers 4 name,
    which PEFT converts; the routers in modules_to_save), its adapters set to mobius's initial ones."""
    import peft
    import transformers

    from mobius.models.peft import to_peft

    hf = transformers.AutoModelForCausalLM.from_pretrained(ck)
    router = "router" if mc.family == "gpt_oss" else "gate"
    saved = {"router": [router], "norms": ["input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                                           "norm"]}
    fused = {"gate_up_proj", "down_proj"} if mc.family == "gpt_oss" else set()  # GPT-OSS's were always parameters
    config = peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0,
                             target_modules=targets[0] if targets == ["all-linear"] else
                             [t for t in targets if t not in fused],
                             target_parameters=[f"mlp.experts.{t}" for t in targets if t in fused] or None,
                             modules_to_save=[m for t in train for m in saved[t]] or None)
    model = peft.get_peft_model(hf, config)
    params = dict(model.named_parameters())
    for key, value in to_peft(start, mc).items():
        if ".lora_" in key:
            name = key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        else:
            module, leaf = key.rsplit(".", 1)
            name = f"{module}.modules_to_save.default.{leaf}"
        params[name].data.copy_(value)
    return model


def _train_peft_moe(model, cfg, coef: float) -> list[float]:
    """PEFT's model with transformers' aux loss (output_router_logits; coef x its mean over the micro-batches),
    torch AdamW, torch's clipping and mobius's schedule."""
    from mobius.models.base import lm_loss
    from mobius.optim import lr_at

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    t = cfg.train
    groups = [{"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    losses = []
    for step in range(LORA_STEPS):
        opt.zero_grad()
        total = 0.0
        for b in _lora_batches(step):
            out = model(b.inputs, output_router_logits=True)
            loss = lm_loss(out.logits, b.targets)
            ((loss + coef * out.aux_loss) / LORA_MICRO).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        losses.append(total / LORA_MICRO)
    return losses


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_on_experts_trains_like_peft(tmp_path: Path, case: str) -> None:
    """Per-expert adapters (PEFT's target_parameters on the fused experts), the router's adapter or the router
    trained whole, the aux loss in both objectives: 4 steps' losses and everything that trains within 1e-5 of
    PEFT's, every frozen weight bit-identical to the checkpoint's (AdamW's eps as the exactness matrices': PEFT
    adds B A to each expert's weight where mobius adds B (A x), and an adapter of an expert few tokens reach has
    gradients near eps); the adapter mobius writes loads in PEFT with mobius's logits, and PEFT's own saved
    adapter reads back into mobius with PEFT's."""
    import peft

    from mobius.assemble import adapters, initial_model
    from mobius.config import config_from_dict
    from mobius.models.hf import read_config
    from mobius.models.lora import trains
    from mobius.models.peft import read_adapter, to_peft, write_adapter
    from mobius.optim import lr_at
    from scheduler.single_engine import SingleEngine

    model_type, targets, train = LORA_CASES[case]
    ck = tmp_path / "ck"
    make_hf_moe(model_type, router_aux_loss_coef=0.3).save_pretrained(ck)
    cfg = config_from_dict({"model": {"checkpoint": str(ck)}, "data": {"seq_len": 16},
                            "train": {"max_steps": LORA_STEPS, "micro_batch_size": 2, "micro_batches": LORA_MICRO,
                                      "lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 0.5, "seed": 3,
                                      "eps": EXACT_EPS},
                            "parallel": {"mode": "single", "device": "cpu"},
                            "lora": {"rank": 4, "alpha": 8.0, "targets": targets, "train": train},
                            "output": {"dir": str(tmp_path / "run")}}, "test.yaml")
    mc = read_config(ck)
    mc.lora = adapters(cfg)
    model = initial_model(cfg, mc, None)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine = SingleEngine(model, cfg, torch.device("cpu"))
    ours = [engine.train_step(s, _lora_batches(s), lr_at(s, cfg.train)).loss for s in range(LORA_STEPS)]
    peft_model = _peft_moe(ck, start, mc, targets, train)
    theirs = _train_peft_moe(peft_model, cfg, 0.3)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
    now = {k: v for k, v in model.state_dict().items()}
    trained = {k: v for k, v in now.items() if trains(mc, k)}
    assert any(".experts.adapters.lora_B." in k for k in trained) == ("all-linear" in targets or "w2" in targets
                                                                       or "down_proj" in targets)
    assert any(".router.weight" in k or ".gate.weight" in k for k in trained) == ("router" in train)
    for name, value in now.items():
        if name not in trained:
            assert torch.equal(value, start[name]), f"frozen {name} changed"
    theirs_now = {k.replace(".default", ""): v.detach() for k, v in peft_model.named_parameters() if v.requires_grad}
    theirs_now = {k.replace(".modules_to_save", ""): v for k, v in theirs_now.items()}
    for key, value in to_peft(trained, mc).items():
        torch.testing.assert_close(value, theirs_now[key], rtol=0, atol=1e-5, msg=key)
    # mobius's adapter in PEFT, PEFT's adapter in mobius
    import transformers

    (tmp_path / "ours").mkdir()
    write_adapter(tmp_path / "ours", mc, trained, torch.float32, str(ck))
    base = transformers.AutoModelForCausalLM.from_pretrained(ck).eval()
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    ids = torch.randint(0, 300, (2, 16))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=0, atol=1e-5)
        peft_model.save_pretrained(tmp_path / "theirs")
        again = read_adapter(tmp_path / "theirs", mc)
        assert set(again) == set(trained)
        model.load_state_dict({**now, **again})
        torch.testing.assert_close(model(ids), peft_model.eval()(ids).logits, rtol=0, atol=1e-5)
        # output.save_merged: every adapter, the experts' included, folded into a plain model
        import dataclasses

        from mobius.models import build_model
        from mobius.models.lora import merge

        merged = merge({k: v.clone() for k, v in model.state_dict().items()}, mc, torch.float32)
        plain = build_model(dataclasses.replace(mc, lora=None), given=merged).eval()
        torch.testing.assert_close(plain(ids), model(ids), rtol=0, atol=1e-5)


def test_lora_settings_for_experts_are_checked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Half of a fused pair, dropout on PEFT's parameter wrappers: one-line errors; targets that reach no expert
    say so at start-up (the experts would silently stay frozen)."""
    import logging

    from mobius.assemble import with_adapters
    from mobius.config import config_from_dict
    from mobius.errors import ConfigError
    from mobius.models.hf import read_config

    ck = tmp_path / "ck"
    make_hf_moe("qwen3_moe").save_pretrained(ck)

    def check(**lora):
        cfg = config_from_dict({"model": {"checkpoint": str(ck)}, "lora": {"rank": 4, **lora}}, "t.yaml")
        return with_adapters(read_config(ck), cfg)

    with pytest.raises(ConfigError, match="gate_proj, up_proj are one fused parameter .* name gate_proj and up_proj"):
        check(targets=["gate_proj", "down_proj"])
    with pytest.raises(ConfigError, match=r"lora.dropout is 0.1, but lora.targets reach mlp.experts.gate_up_proj"):
        check(targets=["gate_proj", "up_proj"], dropout=0.1)
    check(targets=["q_proj", "v_proj"], dropout=0.1)  # attention alone may take dropout
    with caplog.at_level(logging.WARNING):
        check(targets=["q_proj", "v_proj"])
    assert "reach no expert of this qwen3_moe model: its experts stay frozen" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check(targets=["all-linear"])
    assert "reach no expert" not in caplog.text


# ---- the planner's picture of an MoE ---------------------------------------------------------------------------
def _tiny_planned(family: str):
    from mobius.models.gpt_oss import GptOssConfig
    from mobius.models.moe import MoeConfig

    if family == "gpt_oss":
        return GptOssConfig(vocab_size=16384, hidden_size=256, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=16)
    return MoeConfig(model_type=family, vocab_size=16384, hidden_size=256, intermediate_size=128 if family == "mixtral"
                     else 688, moe_intermediate_size=None if family == "mixtral" else 128, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_estimated_activation_memory_matches_autograd(family: str) -> None:
    """The estimate's saved bytes of an MoE block (the routing, each chosen expert's rows; GPT-OSS's widened heads
    and mask) against what autograd saves on the CPU with a random router (the input counted as the memory model
    counts it)."""
    from partition.estimate import estimate_units
    from partition.measure import profile_units

    specs = unit_specs(_tiny_planned(family))
    for precision, tol in (("fp32", 0.03), ("bf16", 0.07)):
        measured = profile_units(specs, 2, 64, precision, "cpu", reps=1, warmup=0).units
        estimated = estimate_units(specs, 2, 64, precision, "h100").units
        for m, e in zip(measured[1:], estimated[1:]):
            assert e.saved_bytes == pytest.approx(m.saved_bytes + m.in_bytes, rel=tol), (precision, m.kind)


def test_an_moe_block_weighs_every_expert_and_computes_k() -> None:
    """Qwen3-30B-A3B on an RTX 3090's datasheet: a block's bytes are its 128 experts' (1.25 GB in bf16), its
    forward the FLOPs of 8 experts per token; routing every token to all 128 experts would cost 16x the experts'
    FLOPs at the same bytes."""
    import dataclasses

    from partition.estimate import estimate_units

    cfg = get_preset("qwen3-30b-a3b")
    block = estimate_units(unit_specs(cfg)[:2], 1, 2048, "bf16", "rtx3090").units[1]
    assert block.param_bytes == pytest.approx(2 * (moe.moe_param_count(cfg, 0)), rel=1e-9)
    assert block.param_bytes == pytest.approx(1.246e9, rel=1e-3)
    dense = estimate_units(unit_specs(dataclasses.replace(cfg, num_experts_per_tok=128))[:2], 1, 2048, "bf16",
                           "rtx3090").units[1]
    assert dense.param_bytes == block.param_bytes and dense.fwd_s > 5 * block.fwd_s


@pytest.mark.slow
@pytest.mark.parametrize("config,frozen", [("finetune-qwen3-30b-a3b-lora", 30.53e9), ("finetune-gpt-oss-20b-lora",
                                                                                       20.91e9)])
def test_the_moe_lora_configs_fit_the_4x3090_box(config: str, frozen: float, capsys: pytest.CaptureFixture) -> None:
    """The shipped MoE LoRA configs on 4 x RTX 3090 (PCIe 2+2): a plan that fits 22.5 GiB per GPU, whose swapped
    stages take at most 2.1 host bytes per frozen parameter (every expert's in bf16), adapters on the experts, and
    the plan's line saying what it assumes of the routing."""
    from test_partition_plan import _run_plan

    root = Path(__file__).resolve().parents[1]
    argv = [str(root / "configs" / f"{config}.yaml"), "--topology",
            str(root / "tests" / "fixtures" / "topology" / "topo2x2_sys.txt")]
    assert _run_plan(argv) == 0
    text = capsys.readouterr().out
    assert "experts: " in text and "spread evenly" in text and "predicted step time" in text
    assert _run_plan([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_gpus"] == 4 and max(plan["peak_bytes"]) <= plan["gpu_memory_bytes"]
    assert plan["host_bytes"] <= 2.1 * frozen


def test_frozen_experts_take_two_host_bytes_under_lora(tmp_path: Path) -> None:
    """A swapped stage of an MoE under LoRA in bf16: every expert's weights (frozen) in its one bf16 copy, the
    adapters (experts', router's, attention's) with fp32 masters and moments: the store allocates what
    ``host_bytes`` plans, 2 bytes per frozen parameter and host_bytes_per_param per trained one."""
    from mobius.config import TrainSection
    from mobius.models.hf import read_config
    from mobius.models.lora import LoraSpec
    from partition.costs import host_bytes_per_param
    from scheduler.stages import stage_layouts
    from scheduler.stage_store import StageStore, host_bytes

    make_hf_moe("qwen3_moe", num_hidden_layers=2).save_pretrained(tmp_path)
    mc = read_config(tmp_path)
    mc.lora = LoraSpec(4, 8.0, 0.0, ("all-linear",), ())
    lay = stage_layouts(mc, [0, 1, 3, 4])[1]  # the two blocks
    experts = 2 * mc.num_experts * 3 * mc.hidden_size * mc.expert_size
    frozen = lay.numel - lay.trainable_numel
    assert frozen >= experts
    store = StageStore(lay, torch.bfloat16, TrainSection())
    allocated = sum(t.numel() * t.element_size() for t in (store.half, store.master, store.grad) if t is not None)
    allocated += store.optimizer.moments.nbytes
    assert allocated == host_bytes([lay], torch.bfloat16)
    assert host_bytes([lay], torch.bfloat16) == 2 * frozen + host_bytes_per_param("half", False, False) * \
        lay.trainable_numel


# ---- on a GPU (skipped without one) -----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_experts_on_cuda_match_the_loop(transposed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's path (torch._grouped_mm, bf16, an expert without tokens, LoRA's adapters) against a matmul per
    expert: outputs and every gradient within bf16's rounding."""
    from mobius.models.experts import ExpertAdapters, ExpertShape, Experts, Routing, _kernel

    torch.manual_seed(0)
    shape = ExpertShape(8, 64, 32, transposed=transposed, bias=transposed,
                        activation="clamped_swiglu" if transposed else "silu")
    experts = Experts(shape)
    experts.adapters = ExpertAdapters(shape, {"gate_up_proj": 16, "down_proj": 8}, {"gate_up_proj": 1.0,
                                                                                   "down_proj": 2.0})
    experts = experts.cuda().to(torch.bfloat16)
    for p in experts.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16)
    chosen = torch.randint(0, 7, (256, 2), device="cuda")  # expert 7 gets no token
    chosen[:, 1] = (chosen[:, 0] + 1) % 7
    routing = Routing(torch.rand(256, 2, device="cuda", dtype=torch.bfloat16), chosen, torch.rand(256, 8))
    assert _kernel(x) == "grouped"
    results = {}
    for kernel in ("grouped", "loop"):
        monkeypatch.setattr(moe_experts, "KERNEL", kernel)
        xg = x.clone().requires_grad_()
        y = experts(xg, routing)
        y.float().square().mean().backward()
        grads = {n: p.grad.float().clone() for n, p in experts.named_parameters()}
        results[kernel] = (y.float(), xg.grad.float(), grads)
        experts.zero_grad()
    (y1, g1, p1), (y2, g2, p2) = results["grouped"], results["loop"]
    torch.testing.assert_close(y1, y2, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(g1, g2, atol=2e-2, rtol=2e-2)
    for n in p1:
        torch.testing.assert_close(p1[n], p2[n], atol=2e-2, rtol=2e-2, msg=n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_moe_pipeline_on_cuda_matches_the_gpu_reference(tmp_path: Path, corpus: Path) -> None:
    """A Qwen3-MoE (grouped experts, its aux loss's counts in the messages between two workers sharing the GPU)
    in bf16 against the single-GPU run."""
    from mobius.app.run import train
    from mobius.data import byte_tokenizer
    from test_zero import _run_cfg

    ck = tmp_path / "ck"
    make_hf_moe("qwen3_moe", num_hidden_layers=6, router_aux_loss_coef=0.5).save_pretrained(ck)
    byte_tokenizer().save(ck)
    dev, tr = {"device": "cuda"}, {"precision": "bf16", "max_steps": 3, "micro_batches": 4, "eval_every": 0}
    ref = train(_run_cfg(tmp_path, ck, corpus, "ref", parallel=dev, train=tr))
    pipe = train(_run_cfg(tmp_path, ck, corpus, "pipe", train=tr, partition={"gpu_memory_gib": 4.0},
                          parallel={**dev, "mode": "pipeline", "devices": 2, "stages": 4, "resident_stages": [1],
                                    "kept_stages": [0]}))
    torch.testing.assert_close(torch.tensor(pipe.losses), torch.tensor(ref.losses), rtol=0, atol=3e-2)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_an_adapter_per_expert_module_reads_as_peft_converts_it(model_type: str, tmp_path: Path) -> None:
    """What PEFT wrote for these models with transformers 4 (an adapter per expert module, the Mixtral's under
    block_sparse_moe): mobius reads it into its fused adapters (gate's and up's A stacked, B block-diagonal) and
    gives the logits PEFT gives it on transformers 5."""
    import peft
    import transformers
    from safetensors.torch import save_file

    from mobius.models.hf import read_config
    from mobius.models.lora import LoraSpec
    from mobius.models.peft import read_adapter

    make_hf_moe(model_type).save_pretrained(tmp_path / "ck")
    mc = read_config(tmp_path / "ck")
    gate, up, down = ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    where = "block_sparse_moe" if model_type == "mixtral" else "mlp"
    H, I_, r = mc.hidden_size, mc.expert_size, 4
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(mc.num_hidden_layers):
        tensors[f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight"] = torch.randn(r, H, generator=g)
        tensors[f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight"] = torch.randn(H, r, generator=g)
        for e in range(mc.num_experts):
            for proj, (fan_in, fan_out) in ((gate, (H, I_)), (up, (H, I_)), (down, (I_, H))):
                key = f"base_model.model.model.layers.{i}.{where}.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.3
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.3
    (tmp_path / "ad").mkdir()
    save_file(tensors, str(tmp_path / "ad" / "adapter_model.safetensors"))
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 8, "lora_dropout": 0.0,
         "target_modules": ["q_proj", gate, up, down], "bias": "none",
         "base_model_name_or_path": str(tmp_path / "ck")}))
    mc.lora = LoraSpec(r, 8.0, 0.0, ("q_proj", gate, up, down), ())
    ours = load_checkpoint(tmp_path / "ck", mc)
    ours.load_state_dict({**ours.state_dict(), **read_adapter(tmp_path / "ad", mc)})
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "ad").eval()
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        adapted = theirs(ids).logits
        torch.testing.assert_close(_logits(ours.eval(), ids), adapted, atol=1e-5, rtol=0)
        with theirs.disable_adapter():
            assert (theirs(ids).logits - adapted).abs().max() > 1e-2  # (the adapters do something)


def test_zero_modes_search_plans_an_moe(capsys: pytest.CaptureFixture) -> None:
    """Zero mode's search (chunk size, rCache blocks, GPU chunks) on Qwen3-30B-A3B LoRA over 8 NVLink A100s: every
    expert in the chunks (31.5B parameters with the adapters), a plan that fits."""
    from test_partition_plan import _run_plan

    root = Path(__file__).resolve().parents[1]
    argv = [str(root / "configs" / "finetune-qwen3-30b-a3b-lora.yaml"), "--topology",
            str(root / "tests" / "fixtures" / "topology" / "dgx_a100_nv12.txt"), "--parallel.mode=zero",
            "--parallel.devices=8", "--partition.gpu=a100-80gb", "--json"]
    assert _run_plan(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["mode"]["chosen"] == "zero" and plan["fits"] and plan["world"] == 8
    assert plan["param_count"] == pytest.approx(param_count(get_preset("qwen3-30b-a3b")) + 0.997e9, rel=1e-3)
