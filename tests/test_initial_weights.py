"""Initial weights (issue 34): nothing is drawn that a checkpoint then overwrites (torch's random functions
watched while a run's model or a stage's weights are made), and the weights drawn from scratch are
bit-identical to the reference way in every mode (the whole model, a pipeline stage's units, a zero
rank's parameters)."""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Iterator

import pytest
import torch

from conftest import make_hf_llama, tiny_llama_config
from mobius.batch import MicroBatch
from mobius.assemble import initial_model, weights_source, with_adapters
from mobius.config import config_from_dict
from scheduler.single_engine import SingleEngine
from mobius.models import build_model, family_of, get_preset, initial_weights, unit_prefix, unit_specs
from mobius.models.base import lm_loss, unit_seed
from mobius.models.hf import from_hf, read_config, read_state_dict
from mobius.models.llama import LlamaConfig
from mobius.models.lora import LoraSpec, trains
from mobius.models.opt import OPTConfig
from mobius.optim import lr_at

RANDOM_METHODS = ("normal_", "uniform_", "random_", "bernoulli_", "exponential_", "cauchy_", "log_normal_",
                  "geometric_")
RANDOM_FUNCTIONS = ("randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "normal", "bernoulli",
                    "multinomial", "randperm")


@contextlib.contextmanager
def recorded_draws() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Every draw of random values into a real (not meta) tensor while inside, from any thread, as
    (function, shape): torch's random functions and tensor methods (``nn.init``'s functions and the
    modules' default initialisation draw through them)."""
    seen: list[tuple[str, tuple[int, ...]]] = []

    def watch(mp: pytest.MonkeyPatch, owner: object, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor) and not out.is_meta:
                seen.append((name, tuple(out.shape)))
            return out

        mp.setattr(owner, name, recorded)

    with pytest.MonkeyPatch.context() as mp:
        for name in RANDOM_METHODS:
            watch(mp, torch.Tensor, name)
        for name in RANDOM_FUNCTIONS:
            watch(mp, torch, name)
        yield seen


def test_recorded_draws_see_default_initialisation_and_threads() -> None:
    """The watch itself: a module's default initialisation and a draw in another thread are seen, a meta
    tensor's is not."""
    from concurrent.futures import ThreadPoolExecutor

    with recorded_draws() as seen:
        torch.nn.Linear(3, 2)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(lambda: torch.empty(4).normal_()).result()
        torch.empty(5, device="meta").uniform_()
    assert ("uniform_", (2, 3)) in seen and ("normal_", (4,)) in seen and all(s != (5,) for _, s in seen)


def _adapter_draws(model: torch.nn.Module, prefixes: tuple[str, ...] = ("",)) -> list[tuple[str, tuple[int, ...]]]:
    """The draws a LoRA run's start makes: one ``torch.rand`` per adapter A (B starts at zero)."""
    return sorted(("rand", tuple(p.shape)) for n, p in model.named_parameters()
                  if ".lora_A." in n and n.startswith(prefixes))


def _run_cfg(ck: Path, out: Path, lora: dict | None):
    raw = {"model": {"checkpoint": str(ck)}, "data": {"seq_len": 16},
           "train": {"micro_batch_size": 2, "micro_batches": 2, "lr": 1e-2, "warmup_steps": 1, "seed": 3},
           "parallel": {"mode": "single", "device": "cpu"}, "output": {"dir": str(out), "plot": False}}
    if lora is not None:
        raw["lora"] = {"rank": 4, "alpha": 8.0, **lora}
    return config_from_dict(raw, "test.yaml")


@pytest.mark.parametrize("lora", [None, {"train": ["norms"]}, {"targets": ["q_proj", "down_proj"]}])
@pytest.mark.parametrize("tied", [False, True])
def test_nothing_drawn_that_the_checkpoint_holds(tmp_path: Path, lora: dict | None, tied: bool) -> None:
    """From a checkpoint transformers wrote, the whole model (single mode) and a stage's or a rank's
    weights (pipeline, zero: ``WeightSource.load``) draw nothing but a LoRA run's adapters; the weights
    are the checkpoint's, the adapters the same in both paths."""
    ck = tmp_path / "ck"
    make_hf_llama("llama", num_hidden_layers=3, tie_word_embeddings=tied).save_pretrained(ck)
    cfg = _run_cfg(ck, tmp_path / "run", lora)
    mc = with_adapters(read_config(ck), cfg)
    with recorded_draws() as seen:
        model = initial_model(cfg, mc, None)
    assert sorted(seen) == _adapter_draws(model)
    state = model.state_dict()
    checkpoint = from_hf(read_state_dict(ck), mc)
    assert set(state) - set(checkpoint) == {n for n in state if ".lora_" in n}
    for name, value in checkpoint.items():
        assert torch.equal(state[name], value), name
    source = weights_source(cfg, mc, None)
    block0_q = "blocks.0.self_attn.q_proj"
    for units, names in [({0}, None), ({1, 2}, None), ({4}, None),  # pipeline stages: whole units
                         ({1, 3}, {f"{block0_q}.weight", f"{block0_q}.lora_A.weight", "blocks.2.mlp.up_proj.weight"})]:
        prefixes = tuple(unit_prefix(k, 5) for k in units)
        names = names or {n for n in state if n.startswith(prefixes)}
        names &= set(state)
        with recorded_draws() as seen:
            weights = source.load(mc, names, units)
        adapted = tuple(unit_prefix(k, 5) for k in units if any(".lora_" in n and n.startswith(unit_prefix(k, 5))
                                                                 for n in names))
        assert sorted(seen) == _adapter_draws(model, adapted), units  # a unit's adapters are drawn together
        assert set(weights) == names
        for name in names:
            assert torch.equal(weights[name], state[name]), name


# ---- from scratch: bit-identical to the reference way, whole model and unit by unit ---------------------
def _reference(cfg, seed: int) -> dict[str, torch.Tensor]:
    """The reference way (mobius before issue 34), written out: the model built on the CPU (torch's
    default initialisation), then each unit's weights drawn into temporaries from the generator of (seed,
    unit) and copied in: N(0, 0.02) matrices (residual projections / sqrt(2 layers)), zero biases, unit norm
    gains, a tied head left to the embedding; each adapter A uniform in +-1/sqrt(in) from the generator
    of (seed, -2, -2, unit), B zero."""
    family = family_of(cfg)
    cls = family.model_cls
    model = cls(cfg, family.unit_specs(cfg))
    tied = {head.split(".", 1)[1] for _, head in cfg.tied_weights()}
    last = len(model.units()) - 1
    with torch.no_grad():
        for k, unit in enumerate(model.units()):
            gen = torch.Generator().manual_seed(unit_seed(seed, -1, -1, k))
            adapter_gen = torch.Generator().manual_seed(unit_seed(seed, -2, -2, k))
            for name, p in unit.named_parameters():
                if ".lora_A." in f".{name}":
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.rand(p.shape, generator=adapter_gen) * 2 * bound - bound)
                elif ".lora_B." in f".{name}":
                    p.zero_()
                elif k == last and name in tied:
                    continue
                elif p.dim() == 1:
                    p.fill_(1.0 if ("ln" in name or "norm" in name) and name.endswith("weight") else 0.0)
                else:
                    s = cls.INIT_STD / math.sqrt(2 * cfg.num_layers) if name.endswith(cls.RESIDUAL_SUFFIXES) \
                        else cls.INIT_STD
                    p.copy_(torch.randn(p.shape, generator=gen) * s)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _configs() -> dict[str, object]:
    gpt2_untied = get_preset("gpt2-tiny")
    gpt2_untied.tie_word_embeddings = False
    gpt2_untied.lora = LoraSpec(4, 8.0, targets=("c_attn", "c_fc"))
    llama_tied = get_preset("llama-tiny")
    llama_tied.tie_word_embeddings = True
    llama_tied.lora = LoraSpec(4, 8.0, train=("norms",))
    return {
        "gpt2-tied": get_preset("gpt2-tiny"),
        "gpt2-untied-lora": gpt2_untied,
        "opt-350m-layout": OPTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
                                     vocab_size=100, max_position_embeddings=32, word_embed_proj_dim=16,
                                     do_layer_norm_before=False),
        "llama-untied": get_preset("llama-tiny"),
        "llama-tied-lora": llama_tied,
        "qwen3-bias-tied": LlamaConfig(model_type="qwen3", vocab_size=300, hidden_size=32, intermediate_size=56,
                                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                       attention_bias=True, tie_word_embeddings=True),
    }


CONFIGS = _configs()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_scratch_equals_the_reference_in_every_mode(name: str) -> None:
    """``build_model`` (single mode) and ``initial_weights`` of any units or parameters (a pipeline stage,
    a zero rank) give exactly the reference's tensors."""
    cfg = CONFIGS[name]
    n = len(unit_specs(cfg))
    for seed in (0, 11):
        want = _reference(cfg, seed)
        model = build_model(cfg, seed)
        got = model.state_dict()
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (seed, key)
        for a, b in model.tied_weights():
            assert model.get_parameter(a) is model.get_parameter(b)
        assert all(p.requires_grad == trains(cfg, key) for key, p in model.named_parameters())
        made_half = build_model(cfg, seed, frozen_dtype=torch.bfloat16).state_dict()  # single mode in bf16: in place
        for key in want:
            assert torch.equal(made_half[key], want[key] if trains(cfg, key) else want[key].bfloat16()), (seed, key)
        for units in ({0}, {n - 1}, {1, 2}, set(range(n))):
            weights = initial_weights(cfg, units, seed)
            mine = {k for k in want if k.startswith(tuple(unit_prefix(u, n) for u in units))}
            assert mine <= set(weights), units
            for key in weights:
                assert torch.equal(weights[key], want[key]), (seed, units, key)
        some = sorted(want)[1::3]  # a zero rank's parameters: parts of units
        weights = initial_weights(cfg, set(range(n)), seed, set(some))
        assert set(weights) == set(some)
        for key in some:
            assert torch.equal(weights[key], want[key]), (seed, key)


def test_weights_given_in_part_leave_the_draws_of_the_rest_unchanged() -> None:
    """A unit whose weights are given in part (a LoRA run from scratch resumed: its trained norms from the
    adapter checkpoint, its frozen weights from the seed) draws the rest as the reference does."""
    cfg = CONFIGS["llama-tied-lora"]
    want = _reference(cfg, 4)
    given = {"blocks.1.input_layernorm.weight": torch.full((128,), 3.0),
             "blocks.1.self_attn.q_proj.weight": torch.zeros(128, 128),
             "head.lm_head.weight": torch.ones(320, 128)}  # the tied weight under the head's name
    got = build_model(cfg, 4, given).state_dict()
    want.update(given)
    want["embed.embed_tokens.weight"] = given["head.lm_head.weight"]
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_given_weights_are_checked() -> None:
    from mobius.errors import CheckpointError

    cfg = get_preset("gpt2-tiny")
    with pytest.raises(CheckpointError, match=r"here: unexpected weights \['blocks\.9\.x'\]"):
        build_model(cfg, 0, {"blocks.9.x": torch.zeros(1)}, source="here")
    with pytest.raises(CheckpointError, match=r"weight 'head\.ln_f\.weight' has shape \(7,\), the model expects"):
        build_model(cfg, 0, {"head.ln_f.weight": torch.zeros(7)})


# ---- a LoRA run's first step from a checkpoint transformers wrote -----------------------------------------
def _llama32_3b_shaped(layers: int, vocab: int) -> dict:
    """transformers config fields of the llama-3.2-3b preset's shapes, with fewer layers and a small vocabulary."""
    p = get_preset("llama-3.2-3b")
    return dict(num_hidden_layers=layers, vocab_size=vocab, hidden_size=p.hidden_size,
                intermediate_size=p.intermediate_size, num_attention_heads=p.num_attention_heads,
                num_key_value_heads=p.num_key_value_heads, rms_norm_eps=p.rms_norm_eps, rope_theta=p.rope_theta,
                rope_scaling=p.rope_scaling, max_position_embeddings=p.max_position_embeddings,
                tie_word_embeddings=p.tie_word_embeddings)


@pytest.mark.parametrize("shape", ["tiny", pytest.param("llama-3.2-3b-2-layers", marks=pytest.mark.slow)])
def test_lora_first_step_from_a_transformers_checkpoint(tmp_path: Path, shape: str) -> None:
    """A LoRA run starting from a bf16 checkpoint transformers wrote: the adapters are its only draws, the
    first step's loss is transformers' own on the same tokens (B = 0: the adapted model computes the
    checkpoint's function), and the step moves what trains alone."""
    import transformers

    fields = _llama32_3b_shaped(2, 512) if shape != "tiny" else dict(num_hidden_layers=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_llama_config("llama", **fields)).to(torch.bfloat16)
    ck = tmp_path / "ck"
    hf.save_pretrained(ck)
    hf = hf.float().eval()  # the checkpoint's values, as mobius trains them
    cfg = _run_cfg(ck, tmp_path / "run", {"train": ["norms"]})
    mc = with_adapters(read_config(ck), cfg)
    with recorded_draws() as seen:
        model = initial_model(cfg, mc, None)
    assert sorted(seen) == _adapter_draws(model) and seen
    start = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, mc.vocab_size, (2, 17), generator=g) for _ in range(2)]
    batches = [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]
    with torch.no_grad():
        theirs = sum(float(lm_loss(hf(b.inputs).logits, b.targets)) for b in batches) / len(batches)
    ours = SingleEngine(model, cfg, torch.device("cpu")).train_step(0, batches, lr_at(0, cfg.train)).loss
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, start[k])}
    assert moved and all(".lora_" in k or "norm" in k for k in moved), sorted(moved)
    assert any(".lora_B." in k for k in moved)
