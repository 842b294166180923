"""A checkpointed LoRA run starts in about the host memory its plan says it needs (issue 34): a pipeline
worker reads its stages from the checkpoint one unit at a time, straight into its stores, so no second
copy of a stage's weights exists beside them. Measured in the worker process itself: its peak resident
memory from just before its engine allocates the stores until they hold the weights, above what it held
before (after torch's one-off mapping of ~34 MB on a process's first ``to_empty``, which is the
process's, not the model's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = """
import json, os
from pathlib import Path
from scheduler import engine

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open('/proc/self/status') if line.startswith(key + ':'))

init, load, seen = engine.PipelineEngine.__init__, engine.PipelineEngine._load_weights, {}

def start(self, *args, **kw):  # before the stores exist
    import torch
    torch.nn.Linear(2, 2, device='meta').to_empty(device='cpu')  # torch maps ~34 MB of its own once, on the first
    Path('/proc/self/clear_refs').write_text('5')  # the peak resident size starts again from now
    seen['before'] = status('VmRSS')
    init(self, *args, **kw)

def loaded(self, source):  # the stores allocated and filled
    load(self, source)
    Path(os.environ['MOBIUS_RSS_FILE']).write_text(json.dumps({**seen, 'peak': status('VmHWM')}))

engine.PipelineEngine.__init__, engine.PipelineEngine._load_weights = start, loaded
"""


def _peak_resets() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/status").is_file() or not _peak_resets(),
                    reason="reads and resets the peak resident size through /proc")
def test_a_checkpointed_lora_pipeline_starts_within_10_percent_of_its_plans_host_memory(tmp_path: Path,
                                                                                        corpus: Path) -> None:
    import torch
    import transformers

    ck = tmp_path / "llama"  # 102M parameters (408 MB in fp32) in 34 units: the largest unit is 3% of them
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376, num_hidden_layers=32,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(ck)
    run = {"model": {"checkpoint": str(ck)}, "lora": {"rank": 8, "targets": ["all-linear"]},
           "data": {"path": str(corpus), "seq_len": 16, "cache_dir": str(tmp_path / "cache")},
           "train": {"max_steps": 1, "micro_batch_size": 1, "micro_batches": 2, "precision": "fp32", "eval_every": 0,
                     "eval_batches": 1},
           "parallel": {"mode": "pipeline", "devices": 1, "stages": 4, "resident_stages": [], "device": "cpu"},
           "partition": {"cache_dir": str(tmp_path / "cache")},
           "output": {"dir": str(tmp_path / "out"), "plot": False}}
    (tmp_path / "run.yaml").write_text(json.dumps(run))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    rss = tmp_path / "rss.json"
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}", "MOBIUS_RSS_FILE": str(rss)}
    r = subprocess.run([sys.executable, "-m", "mobius", "train", str(tmp_path / "run.yaml")], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    measured = json.loads(rss.read_text())
    took = measured["peak"] - measured["before"]
    assert plan["host_bytes"] > 400e6 and not plan["resident"]  # every stage swapped: the stores are the plan's host
    assert 0.5 * plan["host_bytes"] < took <= 1.10 * plan["host_bytes"], (took, plan["host_bytes"])
