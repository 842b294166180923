"""A checkpointed LoRA run starts in about the host memory its plan says it needs (issue 34): a pipeline
worker reads its stages from the checkpoint one unit at a time, straight into its stores, so no second
copy of a stage's weights exists beside them. Measured in the worker process itself: its peak resident
memory from just before its engine allocates the stores until they hold the weights, above what it held
before (after torch's one-off mapping of ~34 MB on a process's first ``to_empty``, which is the
process's, not the model's).

And it writes its checkpoints without a copy of the frozen base: a LoRA checkpoint holds what trains, so a
save adds about the adapters' bytes to what the process holds, whatever the model's size (an fp32 copy of
Llama-3.1-70B's frozen weights would take 280 GB of host memory at every save)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_hf_model, needs_proc, proc_status

ROOT = Path(__file__).resolve().parents[1]
HOOK = """
import json, os
from pathlib import Path
from scheduler import pipeline_engine

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith(key + ':'))

init, load, seen = pipeline_engine.PipelineEngine.__init__, pipeline_engine.PipelineEngine._load_weights, {}

def start(self, *args, **kw):  # before the stores exist
    import torch
    torch.nn.Linear(2, 2, device='meta').to_empty(device='cpu')  # torch maps ~34 MB of its own once, on the first
    Path('/proc/self/clear_refs').write_text('5')  # the peak resident size starts again from now
    seen['before'] = status('VmRSS')
    init(self, *args, **kw)

def loaded(self, source):  # the stores allocated and filled
    load(self, source)
    Path(os.environ['MOBIUS_RSS_FILE']).write_text(json.dumps({**seen, 'peak': status('VmHWM')}))

pipeline_engine.PipelineEngine.__init__, pipeline_engine.PipelineEngine._load_weights = start, loaded
"""


SINGLE_HOOK = """
import json, os
from pathlib import Path
from mobius import assemble

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith(key + ':'))

build = assemble.initial_model

def initial_model(*args, **kw):  # the whole model, from the checkpoint, where it lives
    import torch
    torch.nn.Linear(2, 2, device='meta').to_empty(device='cpu')  # torch maps ~34 MB of its own once, on the first
    Path('/proc/self/clear_refs').write_text('5')
    before = status('VmRSS')
    model = build(*args, **kw)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    Path(os.environ['MOBIUS_RSS_FILE']).write_text(json.dumps({'before': before, 'peak': status('VmHWM'),
                                                              'model': held}))
    return model

assemble.initial_model = initial_model
"""

SAVE_HOOK = """
from mobius import trainer

def measured(name):  # the process's peak resident memory while it writes a checkpoint (or the merged model)
    write = getattr(trainer.Trainer, name)

    def wrapped(self, *args, **kw):
        Path('/proc/self/clear_refs').write_text('5')
        before = status('VmRSS')
        path = write(self, *args, **kw)
        with open(os.environ['MOBIUS_SAVE_RSS_FILE'], 'a') as f:
            f.write(json.dumps({'what': name, 'before': before, 'peak': status('VmHWM')}) + chr(10))
        return path

    setattr(trainer.Trainer, name, wrapped)

measured('save')
measured('save_merged')
"""



def _checkpoint(tmp_path: Path) -> Path:
    """A Llama of 102M parameters (408 MB in fp32) in 34 units, saved by transformers in fp32: the
    largest unit is 3% of it."""
    import torch
    import transformers

    ck = tmp_path / "llama"
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=32,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(ck)
    return ck


def _train(tmp_path: Path, corpus: Path, hook_text: str, train: dict, parallel: dict,
           output: dict | None = None) -> dict:
    """``mobius train`` of a LoRA run on :func:`_checkpoint` with ``hook_text`` and :data:`SAVE_HOOK` loaded
    first (as ``sitecustomize``); what the hook measured, and under ``save`` (and ``save_merged``) what each
    checkpoint's write (and the merged model's) added to its process's resident memory at its peak."""
    run = {"model": {"checkpoint": str(_checkpoint(tmp_path))}, "lora": {"rank": 8, "targets": ["all-linear"]},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": 1, "micro_batch_size": 1, "micro_batches": 2, "eval_every": 0, "eval_batches": 1,
                     **train},
           "parallel": {"device": "cpu", **parallel},
           "partition": {"cache_dir": str(tmp_path / "cache")},
           "output": {"dir": str(tmp_path / "out"), "plot": False, **(output or {})}}
    (tmp_path / "run.yaml").write_text(json.dumps(run))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_text + SAVE_HOOK)
    rss, saves = tmp_path / "rss.json", tmp_path / "saves.jsonl"
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "MOBIUS_RSS_FILE": str(rss),
           "MOBIUS_SAVE_RSS_FILE": str(saves)}
    r = subprocess.run([sys.executable, "-m", "mobius", "train", str(tmp_path / "run.yaml")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    written = list(map(json.loads, saves.read_text().splitlines()))
    return {**json.loads(rss.read_text()), **{what: [m["peak"] - m["before"] for m in written if m["what"] == what]
                                              for what in ("save", "save_merged")}}


@pytest.mark.slow
@needs_proc
def test_a_checkpointed_lora_pipeline_starts_within_10_percent_of_its_plans_host_memory(tmp_path: Path,
                                                                                        corpus: Path) -> None:
    measured = _train(tmp_path, corpus, HOOK, {"precision": "fp32"},
                      {"mode": "pipeline", "devices": 1, "stages": 4, "resident_stages": []})
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    took = measured["peak"] - measured["before"]
    assert plan["host_bytes"] > 400e6 and not plan["resident"]  # every stage swapped: the stores are the plan's host
    assert 0.5 * plan["host_bytes"] < took <= 1.10 * plan["host_bytes"], (took, plan["host_bytes"])
    # the final checkpoint: the adapters and norms (10 MB), no copy of the frozen base (400 MB); the stores' own
    # tensors are already fp32 on the CPU, so the bf16 single run below is the one whose copy would be a cast
    assert measured["save"] and max(measured["save"]) < 0.25 * plan["host_bytes"], measured["save"]


@needs_proc
def test_a_checkpointed_lora_single_run_builds_its_model_where_it_lives(tmp_path: Path, corpus: Path) -> None:
    """Single mode makes the model in place, its frozen base in the training dtype (bf16: 2 bytes a
    parameter), reading the fp32 checkpoint one unit at a time: not the whole model in fp32 beside the
    whole checkpoint (8 bytes a parameter, four times as much) and then a copy. Its final checkpoint adds
    the adapters to what it holds, and the merged model about one fp32 copy of the weights."""
    measured = _train(tmp_path, corpus, SINGLE_HOOK, {"precision": "bf16"}, {"mode": "single"},
                      {"save_merged": True, "save_dtype": "bf16"})
    took = measured["peak"] - measured["before"]
    assert measured["model"] > 200e6  # 102M parameters, nearly all of them frozen in bf16
    assert 0.5 * measured["model"] < took <= 1.10 * measured["model"], (took, measured["model"])
    assert measured["save"] and max(measured["save"]) < 0.25 * measured["model"], measured["save"]
    # the merged model: the fp32 weights the engine hands over (2x the bf16 model), each layer merged into bf16 as
    # its fp32 input goes; not also a merged fp32 copy of every layer (4.4x the model before)
    assert measured["save_merged"] and max(measured["save_merged"]) < 2.5 * measured["model"], measured["save_merged"]


@needs_proc
def test_a_save_converts_one_shard_at_a_time(tmp_path: Path) -> None:
    """A bf16 save of fp32 weights holds one converted shard at a time beside them, not a bf16 copy of them all
    (an 8B model: one 5 GiB shard instead of 16 GB)."""
    import torch

    from mobius.checkpoint import save_model
    from mobius.models.hf import load_checkpoint

    make_hf_model("opt", hidden_size=512, ffn_dim=2048, num_hidden_layers=6, max_position_embeddings=64,
                  vocab_size=2048).save_pretrained(tmp_path / "in")
    model = load_checkpoint(tmp_path / "in")
    half = sum(p.numel() for p in model.parameters()) * 2  # 40 MB in bf16
    largest = max(p.numel() for p in model.parameters()) * 2  # 2 MB
    Path("/proc/self/clear_refs").write_text("5")
    before = proc_status("VmRSS")
    save_model(model, tmp_path / "out", torch.bfloat16, max_shard_bytes=2 * largest)
    added = proc_status("VmHWM") - before
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 8
    assert added < 0.3 * half, (added, half)
