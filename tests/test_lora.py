"""LoRA: frozen base weights and trainable rank-r adapters, against PEFT (a test dependency), through
mobius's checkpoints in PEFT's format, and with one-line errors for settings that cannot run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_hf_llama, make_hf_model, save_special_tokenizer
from in_process import mobius
from mobius.assemble import adapters, initial_model
from mobius.batch import MicroBatch
from mobius.config import config_from_dict
from scheduler.single_engine import SingleEngine
from mobius.models.base import lm_loss
from mobius.models import unit_specs
from mobius.models.hf import read_config
from mobius.models.lora import trains
from mobius.models.peft import to_peft
from mobius.optim import lr_at

ROOT = Path(__file__).resolve().parents[1]
STEPS, MICRO = 4, 2


def _cfg(ck: Path, out: Path, **sections: dict):
    raw = {"model": {"checkpoint": str(ck)}, "data": {"seq_len": 16},
           "train": {"max_steps": STEPS, "micro_batch_size": 2, "micro_batches": MICRO, "lr": 1e-2, "warmup_steps": 1,
                     "weight_decay": 0.1, "grad_clip": 0.5, "seed": 3},
           "parallel": {"mode": "single", "device": "cpu"}, "lora": {"rank": 4, "alpha": 8.0},
           "output": {"dir": str(out), "plot": False}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw, "test.yaml")


def _batches(step: int) -> list[MicroBatch]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = [torch.randint(0, 300, (2, 17), generator=g) for _ in range(MICRO)]
    return [MicroBatch(t[:, :-1], t[:, 1:]) for t in tokens]


def _peft_model(ck: Path, start: dict[str, torch.Tensor], mc, targets: str | list[str]):
    """The checkpoint in transformers under PEFT's LoRA, its adapters set to mobius's initial ones."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(ck)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.0, target_modules=targets))
    params = dict(model.named_parameters())
    for key, value in to_peft(start, mc).items():
        params[key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")].data.copy_(value)
    return model


def _train_peft(model, cfg) -> list[float]:
    """PEFT's model with torch AdamW (decay on matrices), torch's norm clipping and mobius's lr schedule."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    t = cfg.train
    groups = [{"params": [p for _, p in trainable if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for _, p in trainable if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for b in _batches(step):
            loss = lm_loss(model(b.inputs).logits, b.targets)
            (loss / MICRO).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], t.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        opt.step()
        losses.append(total / MICRO)
    return losses


@pytest.mark.parametrize("kind,targets", [("llama", "all-linear"), ("gpt2", "all-linear"),
                                          ("llama", ["q_proj", "v_proj", "down_proj"])])
def test_lora_trains_like_peft(tmp_path: Path, kind: str, targets) -> None:
    """Same adapters, data, AdamW, clipping and schedule: losses and adapters within 1e-5 of PEFT's, every
    frozen weight bit-identical to the checkpoint's after training."""
    ck = tmp_path / "ck"
    (make_hf_llama("llama", num_hidden_layers=2) if kind == "llama" else make_hf_model("gpt2")).save_pretrained(ck)
    cfg = _cfg(ck, tmp_path / "run", lora={"targets": [targets] if isinstance(targets, str) else targets})
    mc = read_config(ck)
    mc.lora = adapters(cfg)
    mc.set_dropout(0.0)  # the reference runs transformers' model in eval mode
    model = initial_model(cfg, mc, None)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine = SingleEngine(model, cfg, torch.device("cpu"))
    ours = [engine.train_step(s, _batches(s), lr_at(s, cfg.train)).loss for s in range(STEPS)]
    peft_model = _peft_model(ck, start, mc, targets)
    theirs = _train_peft(peft_model, cfg)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=1e-5)
    now = model.state_dict()
    peft_params = dict(peft_model.named_parameters())
    trained = 0
    for name, value in now.items():
        if not trains(mc, name):
            assert torch.equal(value, start[name]), f"frozen {name} changed"
            continue
        key = next(iter(to_peft({name: value}, mc)))
        key = key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        torch.testing.assert_close(value, peft_params[key].detach(), rtol=0, atol=1e-5, msg=name)
        trained += not torch.equal(value, start[name])
    assert trained > 0


def test_saved_adapter_and_merged_model_load_in_peft_and_transformers(tmp_path: Path, corpus: Path) -> None:
    """`final/` is a PEFT adapter directory: PeftModel.from_pretrained on the base model gives mobius's
    logits; `merged/` (output.save_merged) is a plain checkpoint transformers loads with the same logits."""
    import peft
    import transformers

    from mobius.app.run import train
    from mobius.models.hf import load_checkpoint

    ck = tmp_path / "ck"
    make_hf_llama("llama", num_hidden_layers=2, tie_word_embeddings=True).save_pretrained(ck)
    cfg = _cfg(ck, tmp_path / "run", data={"path": str(corpus), "cache_dir": str(tmp_path / "cache")},
               output={"save_merged": True}, lora={"train": ["norms"]})
    result = train(cfg)
    final, merged = result.final_dir, result.merged_dir
    conf = json.loads((final / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["peft_type"] == "LORA" and "norm" in conf["modules_to_save"]
    base = transformers.AutoModelForCausalLM.from_pretrained(ck).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, final).eval()
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    mc = read_config(ck)
    mc.lora = adapters(cfg)
    ours = load_checkpoint(ck, mc)
    from mobius.models.peft import read_adapter

    state = ours.state_dict()
    state.update(read_adapter(final, mc))
    ours.load_state_dict(state)
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        want = ours(ids)
        torch.testing.assert_close(with_adapter(ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(plain(ids).logits, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("edit,message", [
    ({"rank": -1}, r"lora\.rank must be >= 0, got -1"),
    ({"alpha": 0}, r"lora\.alpha must be > 0, got 0"),
    ({"dropout": 1.0}, r"lora\.dropout must be >= 0 and < 1, got 1"),
    ({"targets": ["qkv_proj"]}, r"lora\.targets: 'qkv_proj' matches no layer of a llama model"),
    ({"train": ["bias"]}, r"lora\.train: 'bias' is not one of embeddings, norms, head"),
])
def test_bad_lora_settings_are_one_line_errors(tmp_path: Path, edit: dict, message: str) -> None:
    ck = tmp_path / "ck"
    make_hf_llama("llama").save_pretrained(ck)
    save_special_tokenizer(ck, "<|begin_of_text|>", "<|end_of_text|>")
    r = mobius(["plan", str(ROOT / "configs" / "demo.yaml"), f"--model.checkpoint={ck}", "--model.preset=",
                "--parallel.mode=single", "--data.seq_len=16",
                *[f"--lora.{k}={json.dumps(v)}" for k, v in {"rank": 4, **edit}.items()]])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("mobius: error: "), r.stderr
    import re

    assert re.search(message, lines[0]), lines[0]


# ---- every mode against the single-device LoRA run (fp32, CPU workers) ----------------------------
def _run(tmp: Path, ck: Path, corpus: Path, out: str, **sections: dict):
    from test_zero import _run_cfg

    lora = {"lora": {"rank": 4, "alpha": 8.0, "train": ["norms"], **sections.pop("lora", {})}}
    # lr 1e-3: AdamW divides by sqrt(v), so an adapter element whose gradient is near zero turns
    # summation-order rounding into a step of up to lr; at 1e-3 that stays inside 1e-5
    train_ = {"max_steps": 3, "micro_batches": 4, "eval_every": 0, "lr": 1e-3, **sections.pop("train", {})}
    return _run_cfg(tmp, ck, corpus, out, train=train_, **lora, **sections)


@pytest.fixture(scope="module")
def lora_reference(tmp_path_factory: pytest.TempPathFactory, llama_checkpoint: Path, corpus: Path):
    from mobius.app.run import train

    tmp = tmp_path_factory.mktemp("lora-ref")
    result = train(_run(tmp, llama_checkpoint, corpus, "ref"))
    return result


LORA_MODES = {  # 12 units: embed, 10 blocks, head (untied)
    "pipeline-2-resident-kept": ({"mode": "pipeline", "devices": 2, "stages": 6, "resident_stages": [1, 5],
                                  "kept_stages": [0, 2, 3]}, {}),
    "pipeline-4-swapped-offload": ({"mode": "pipeline", "devices": 4, "stages": 8, "resident_stages": [2],
                                    "kept_stages": [1], "offload_inputs": "on"}, {}),
    "zero-2": ({"mode": "zero", "devices": 2}, {"zero": {"chunk_size": 3001, "gpu_chunks": 2}}),
}


@pytest.mark.parametrize("mode", list(LORA_MODES))
def test_every_mode_trains_lora_like_the_reference(tmp_path: Path, llama_checkpoint: Path, corpus: Path,
                                                   lora_reference, mode: str) -> None:
    """Frozen base weights swapped (or gathered) in the training dtype only, adapters and norms with
    their masters and AdamW: losses and everything that trains within 1e-5 of the single-device run."""
    from mobius.app.run import train
    from mobius.models.peft import read_adapter

    par, extra = LORA_MODES[mode]
    result = train(_run(tmp_path, llama_checkpoint, corpus, "run", parallel=par, **extra))
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(lora_reference.losses), rtol=0, atol=1e-5)
    mc = read_config(llama_checkpoint)
    mc.lora = adapters(_run(tmp_path, llama_checkpoint, corpus, "x"))
    want, got = read_adapter(lora_reference.final_dir, mc), read_adapter(result.final_dir, mc)
    assert set(got) == set(want) and any(".lora_B." in k for k in got)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_a_lora_run_resumes_across_modes(tmp_path: Path, llama_checkpoint: Path, corpus: Path) -> None:
    """Adapter moments and the data position by name: 2 steps in the pipeline, 2 in zero mode, 2 on one
    device equal 6 uninterrupted steps."""
    import shutil

    from mobius.app.run import train

    tr, out = {"max_steps": 6}, {"save_every": 2, "keep_last": 3}
    straight = train(_run(tmp_path, llama_checkpoint, corpus, "straight", train=tr))
    train(_run(tmp_path, llama_checkpoint, corpus, "a", train=tr, output=out,
               parallel={"mode": "pipeline", "devices": 2, "stages": 4}))
    for name, source, par in (("b", tmp_path / "a" / "checkpoints" / "step-000002", {"mode": "zero", "devices": 2}),
                              ("c", tmp_path / "b" / "checkpoints" / "step-000004", {})):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(source, tmp_path / name / "checkpoints" / source.name)
        run = train(_run(tmp_path, llama_checkpoint, corpus, name, train=tr, output=out, parallel=par), resume="auto")
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(straight.losses), rtol=0, atol=1e-5)


HOST_PROBE = r"""
import ctypes, dataclasses, gc, json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from mobius.app.launch import free_port
from mobius.app.planning import plan_pipeline
from mobius.app.settings import Machine, resolve
from mobius.assemble import with_adapters
from mobius.config import config_from_dict
from mobius.models import get_preset, unit_specs
from scheduler.pipeline_engine import PipelineEngine

def rss():
    # what the process holds, not what it freed and the allocator kept: collected and trimmed first
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
dist.init_process_group("gloo", rank=0, world_size=1)
cfg = config_from_dict({"model": {"preset": "qwen2.5-0.5b", "dropout": 0.0}, "data": {"seq_len": 64},
                        "train": {"micro_batch_size": 1, "micro_batches": 2, "precision": "bf16", "grad_clip": 1.0},
                        "parallel": {"mode": "pipeline", "device": "cpu", "stages": 3, "resident_stages": [],
                                     "kept_stages": []},
                        "lora": {"rank": 8, "alpha": 16.0},
                        "partition": {"cache_dir": sys.argv[2], "profile": "estimated", "gpu": "h100"},
                        "output": {"dir": sys.argv[2]}}, "probe")
mc = with_adapters(dataclasses.replace(get_preset("qwen2.5-0.5b"), num_hidden_layers=4), cfg)
settings = resolve(cfg, Machine.detect(cfg))
plan = plan_pipeline(cfg, mc, settings, Machine.detect(cfg))[0].swapped
before = rss()
engine = PipelineEngine(cfg, mc, plan, settings, torch.device("cpu"), None)
grown = rss() - before
frozen = sum(s.frozen_count for s in unit_specs(mc))
print(json.dumps({"host_bytes": plan.host_bytes, "rss_growth": grown, "frozen": frozen,
                  "trainable": sum(s.param_count - s.frozen_count for s in unit_specs(mc))}))
engine.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_lora_host_memory_is_two_bytes_per_frozen_parameter(tmp_path: Path) -> None:
    """The stores of a bf16 LoRA run on one CPU worker (Qwen2.5-0.5B's widths in 4 blocks, 0.2B
    frozen parameters, the tied embedding a copy at each end): the process grows by the planner's
    figure within 10%, and that figure is at most 2.1 bytes per frozen parameter."""
    r = subprocess.run([sys.executable, "-c", HOST_PROBE, str(ROOT), str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["host_bytes"] <= 2.1 * out["frozen"], out
    assert out["rss_growth"] == pytest.approx(out["host_bytes"], rel=0.10), out


# ---- the shipped LoRA configs: what mobius plan says ----------------------------------------------
@pytest.mark.parametrize("config,frozen_b", [("lora-llama-3.1-70b", 70.35e9), ("lora-qwen2.5-72b", 72.5e9)])
def test_the_4x3090_lora_configs_fit_in_192_gib(config: str, frozen_b: float, capsys: pytest.CaptureFixture) -> None:
    """70B-class LoRA on 4 x 24 GB with at most 192 GiB of host memory, no quantization: the swapped
    stages' host stores take at most 2.1 bytes per frozen parameter, and the step's time is accounted."""
    from test_partition_plan import _run_plan

    argv = [str(ROOT / "configs" / f"{config}.yaml"), "--topology",
            str(ROOT / "tests" / "fixtures" / "topology" / "topo2x2_sys.txt"), "--partition.time_limit_s=1", "--json"]
    assert _run_plan(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["num_gpus"] == 4 and max(plan["peak_bytes"]) <= plan["gpu_memory_bytes"] <= 24 * 2**30
    assert plan["host_bytes"] <= plan["host_memory_bytes"] == 192 * 2**30
    assert plan["host_bytes"] <= 2.1 * frozen_b
    split = plan["time_split"]
    assert sum(split.values()) == pytest.approx(plan["predicted_step_s"], rel=1e-6)
    assert split["forward"] > 0 and split["backward"] > split["forward"]


def test_single_mode_plans_frozen_weights_in_the_training_dtype() -> None:
    """LoRA on 8B: plain training holds the frozen base in bf16 (2 bytes) and trains the adapters with
    16 bytes each, so its states take ~15.6 GiB where full fine-tuning needs ~120 GiB."""
    import topology
    from mobius.app.planning import plan_single
    from mobius.app.settings import Machine, resolve
    from mobius.assemble import planned_architecture
    from mobius.config import load_config

    cfg = load_config(str(ROOT / "configs" / "lora-llama-3.1-8b.yaml"))
    machine = Machine.saved(topology.load_topology(str(ROOT / "tests" / "fixtures" / "topology" / "single_gpu.txt")))
    plan, _, _ = plan_single(cfg, planned_architecture(cfg), resolve(cfg, machine, "single"), machine)
    frozen, trainable = plan.frozen_count, plan.param_count - plan.frozen_count
    assert 8.0e9 < frozen < 8.1e9 and 41e6 < trainable < 43e6
    assert plan.memory["states"] == 16 * trainable + 2 * frozen < 16 * 2**30
    assert "16 bytes x 41.9M parameters + 2 x 8030.3M frozen" in plan.summary()


def test_the_one_gpu_lora_config_plans_the_pipeline(capsys: pytest.CaptureFixture) -> None:
    """8B LoRA on one 24 GB card: plain training does not fit (bf16 base + activations), auto picks the
    pipeline, whose frozen weights take 2 bytes each in host memory."""
    from test_partition_plan import _run_plan

    argv = [str(ROOT / "configs" / "lora-llama-3.1-8b.yaml"), "--topology",
            str(ROOT / "tests" / "fixtures" / "topology" / "single_gpu.txt"), "--json"]
    assert _run_plan(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    fits = {c["mode"]: c["fits"] for c in plan["mode"]["candidates"]}
    assert plan["mode"]["chosen"] == "pipeline" and fits == {"single": False, "pipeline": True, "zero": False}
    assert max(plan["peak_bytes"]) <= plan["gpu_memory_bytes"] and plan["host_bytes"] <= 2.1 * 8.03e9


# ---- on a GPU (skipped without one) --------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode,precision,atol", [("pipeline-2-resident-kept", "fp32", 1e-4),
                                                 ("pipeline-2-resident-kept", "bf16", 3e-2),
                                                 ("zero-1", "fp32", 1e-4)])
def test_lora_on_cuda_matches_the_cuda_reference(tmp_path: Path, llama_checkpoint: Path, corpus: Path, mode: str,
                                                 precision: str, atol: float) -> None:
    """Frozen weights swapped onto the GPU in the training dtype, adapters through the GPU's kernels and
    the CPU / GPU AdamW: the single-GPU LoRA run's losses (TF32 off)."""
    from mobius.app.run import train

    torch.backends.cuda.matmul.allow_tf32 = False
    dev, tr = {"device": "cuda"}, {"precision": precision}
    ref = train(_run(tmp_path, llama_checkpoint, corpus, "ref", parallel=dev, train=tr))
    par, extra = LORA_MODES[mode] if mode in LORA_MODES else ({"mode": "zero"}, {"zero": {"chunk_size": 3001,
                                                                                        "gpu_chunks": 2}})
    run = train(_run(tmp_path, llama_checkpoint, corpus, "run", train=tr, partition={"gpu_memory_gib": 4.0},
                     parallel={**dev, **par}, **extra))
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(ref.losses), rtol=0, atol=atol)


def test_profiled_units_freeze_what_the_run_freezes(llama_checkpoint: Path) -> None:
    """A profile times the backward the run does: the units it builds leave the frozen weights without
    gradients (their count is the spec's), and a frozen embedding over token ids has no backward."""
    from partition.measure import profile_units

    mc = read_config(llama_checkpoint)
    mc.lora = adapters(_cfg(llama_checkpoint, Path("unused")))
    specs = unit_specs(mc)
    for spec in specs:
        unit = spec.build()
        assert sum(p.numel() for p in unit.parameters() if not p.requires_grad) == spec.frozen_count > 0
    prof = profile_units([specs[0], specs[1], specs[-1]], 2, 16, "fp32", device="cpu", reps=1, warmup=0)
    assert [u.frozen_count for u in prof.units] == [specs[0].frozen_count, specs[1].frozen_count,
                                                    specs[-1].frozen_count]
    assert all(u.grad_bytes == 4 * (u.param_count - u.frozen_count) for u in prof.units)
