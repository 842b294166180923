"""Shared fixtures: tiny Hugging Face checkpoints built locally (never downloaded) and local text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The tests run side by side (pytest-xdist, and the worker processes and `mobius` commands many of them
# start): OpenMP threads that spin while they wait for work take the cores the others compute on. Two demo
# runs side by side on 2 cores took 63 s each with spinning threads, 7.6 s with sleeping ones. Set before
# torch loads its OpenMP runtime; the processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))

TEXT = (
    "The quick brown fox jumps over the lazy dog. " * 3
    + "Pipelines move activations between stages; swapping moves stages between memories. "
    + "A root complex shares its bandwidth among the GPUs beneath it. "
)


def _peak_resets() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


needs_proc = pytest.mark.skipif(not Path("/proc/self/status").is_file() or not _peak_resets(),
                                reason="reads and resets the peak resident size through /proc")


def proc_status(key: str) -> int:
    """This process's ``/proc/self/status`` figure ``key`` (``VmRSS``, ``VmHWM``) in bytes."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The ``slow`` tests first (otherwise in collection order): the workers start on them together and
    end on short ones, instead of one worker running a 40 s matrix at the end while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def tiny_gpt2_config(**kw):
    import transformers

    base = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=300, n_positions=64, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return transformers.GPT2Config(**base)


def tiny_opt_config(**kw):
    import transformers

    base = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64, vocab_size=300,
                max_position_embeddings=64, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    base.update(kw)
    return transformers.OPTConfig(**base)


def make_hf_model(kind: str, **kw):
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(tiny_gpt2_config(**kw))
    else:
        model = transformers.OPTForCausalLM(tiny_opt_config(**kw))
    return model.eval()


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT * 40)
    return f


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Path:
    f = tmp_path / "corpus.jsonl"
    with f.open("w") as fh:
        for i in range(200):
            fh.write(json.dumps({"body": f"record {i}: " + TEXT}) + "\n")
    return f


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    d = tmp_path / "gpt2-tiny-hf"
    make_hf_model("gpt2").save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def demo_data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One token cache for every test that trains the demo config (the standard library's docstrings
    are tokenized once per session, not once per test)."""
    return tmp_path_factory.mktemp("demo-data")


DEMO_SHORT = ["--train.max_steps=4", "--train.eval_every=2"]  # the demo runs the exactness tests compare


@pytest.fixture(scope="session")
def demo_single(tmp_path_factory: pytest.TempPathFactory, demo_data_cache: Path) -> Path:
    """The demo config, shortened (``DEMO_SHORT``), trained by plain training: the reference that the
    demo's pipeline and zero runs are compared with."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("demo-single")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "mobius.cli", "train", str(root / "configs" / "demo.yaml"),
                        f"--output.dir={out / 'run'}", f"--data.cache_dir={demo_data_cache}",
                        f"--partition.cache_dir={out / 'cache'}", *DEMO_SHORT], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "run"


@pytest.fixture(scope="session")
def deep_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 with 10 blocks (12 units) so 4 workers can run 12 stages."""
    from mobius.data import byte_tokenizer

    d = tmp_path_factory.mktemp("deep") / "gpt2-10"
    make_hf_model("gpt2", n_layer=10, n_embd=32, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0).save_pretrained(d)
    byte_tokenizer().save(d)
    return d


@pytest.fixture(scope="session")
def untied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``deep_checkpoint`` with its own head weight (the benchmark models' layout): the first and last
    stages may then be resident."""
    from mobius.data import byte_tokenizer

    d = tmp_path_factory.mktemp("untied") / "gpt2-10-untied"
    make_hf_model("gpt2", n_layer=10, n_embd=32, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  tie_word_embeddings=False).save_pretrained(d)
    byte_tokenizer().save(d)
    return d


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    f = tmp_path_factory.mktemp("text") / "corpus.txt"
    f.write_text(TEXT * 40)
    return f


def round_robin_cuts_with_kept_inputs(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """Plans of this test choose round-robin cuts among those with at least two backward ops (inputs kept in host
    memory and reloaded) and more ops than ``workers`` (each worker runs several): a loaded machine's profile can
    make others the fastest."""
    from partition import roundrobin_plan

    def wanted(shape: tuple[int, int, int]) -> bool:  # (the fused op's first unit, forward ops, backward ops)
        return shape[2] >= 2 and shape[1] + 1 + shape[2] > workers

    for name in ("candidate_shapes", "neighbours"):
        found = getattr(roundrobin_plan, name)
        monkeypatch.setattr(roundrobin_plan, name, lambda *a, found=found: [s for s in found(*a) if wanted(s)])


def tiny_llama_config(model_type: str = "llama", **kw):
    """A tiny transformers config of one of the Llama-architecture families (4 query heads, 2 KV heads)."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
    base = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=56, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if model_type == "qwen3":
        base["head_dim"] = 12  # apart from hidden / heads, as Qwen3's are
    base.update(kw)
    return cls(**base)


def make_hf_llama(model_type: str = "llama", seed: int = 0, **kw):
    """A tiny randomly initialised transformers model of a Llama-architecture family, with norm gains
    and biases drawn at random too (transformers starts them at 1 and 0, which would hide mistakes)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_llama_config(model_type, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model.eval()


def save_special_tokenizer(directory: Path, bos: str | None, eos: str, **config) -> Path:
    """A byte-level tokenizer.json with the given special tokens (Llama 3 / Qwen style) and a
    tokenizer_config.json naming them, as checkpoints ship them."""
    from tokenizers import Tokenizer

    from mobius.data import byte_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tok: Tokenizer = byte_tokenizer().tokenizer
    tok.add_special_tokens([t for t in (bos, eos) if t])
    tok.save(str(directory / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(conf))
    return directory


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (4 query heads sharing 2 KV heads, untied head, llama3 rotary scaling) with 10 blocks
    (12 units) and a Llama-3-style tokenizer (a begin-of-text and an end-of-text token)."""
    d = tmp_path_factory.mktemp("llama") / "llama-10"
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    make_hf_llama("llama", num_hidden_layers=10, rope_scaling=rope, bos_token_id=256,
                  eos_token_id=257).save_pretrained(d)
    save_special_tokenizer(d, "<|begin_of_text|>", "<|end_of_text|>")
    return d


def tiny_moe_config(model_type: str = "qwen3_moe", **kw):
    """A tiny transformers config of a mixture-of-experts family: 4 query heads on 2 KV heads, 4 experts of
    which each token takes 2, widths that are multiples of 8 (a GPU's grouped matmul takes them)."""
    import transformers

    base = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, num_experts_per_tok=2,
                tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        base.update(intermediate_size=48, moe_intermediate_size=16, head_dim=8, num_experts=4, norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif model_type == "mixtral":
        base.update(intermediate_size=16, num_local_experts=4)
        cls = transformers.MixtralConfig
    else:
        base.update(intermediate_size=16, head_dim=8, num_local_experts=4, sliding_window=4,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 16,
                                     "rope_theta": 150000.0})
        cls = transformers.GptOssConfig
    base.update(kw)
    return cls(**base)


def make_hf_moe(model_type: str = "qwen3_moe", seed: int = 0, **kw):
    """A tiny randomly initialised transformers MoE model, norm gains, biases and sinks drawn at random too, the
    router's weights wide enough that the tokens do not all choose alike."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(model_type, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.normal_(0.0, 0.5)
    return model.eval()
