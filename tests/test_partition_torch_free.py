"""The planner is numbers in, plans out: importing partition (and partition.zero) and planning a model
from unit descriptions with the datasheet profile -- the pipeline's plan and zero mode's -- never
imports torch. Checked in a fresh interpreter in which importing torch fails (mobius.models, whose
``unit_specs`` builds torch modules, is not imported: the units are described by hand)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import importlib.abc
    import json
    import sys
    from types import SimpleNamespace


    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked here (import of {name})")
            return None


    sys.meta_path.insert(0, NoTorch())

    import partition
    import partition.single_plan
    import partition.zero
    from mobius.layout import ParamInfo
    from partition import Hardware, PlanRequest, SwappedPlan, estimate_units, plan_model
    from partition.zero import ZeroHardware

    H, V = 256, 1000  # a small GPT-shaped model: the unit descriptions mobius.models.unit_specs gives, by hand


    def unit(name, kind, params, flops_per_token):
        return SimpleNamespace(
            name=name, kind=kind, signature=f"{kind}:{params}", param_count=params, frozen_count=0,
            hidden_size=H, vocab_size=V, fwd_flops=lambda b, s: 2.0 * flops_per_token * b * s,
            out_numel=lambda b, s: b * s * (V if kind == "head" else H),
            memory=lambda b, s, elem: (8 * b * s * H * elem, 4 * b * s * H * elem))


    specs = ([unit("embed", "embed", V * H, 0)] + [unit(f"block.{i}", "block", 12 * H * H, 12 * H * H)
                                                    for i in range(6)] + [unit("head", "head", V * H, V * H)])
    hw = Hardware.uniform(2, 2 * 2**30, 10e9, groups=[[0], [1]])
    prof = estimate_units(specs, 1, 64, "bf16", "rtx3090")
    plan = plan_model(prof, hw, PlanRequest(micro_batches=2, time_limit_s=2, with_baselines=False))
    again = SwappedPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.options == plan.options and again.boundaries == plan.boundaries
    params = [ParamInfo((f"{s.name}.weight",), (s.param_count,), (i,), True) for i, s in enumerate(specs)]
    zhw = ZeroHardware(1, 2 * 2**30, 10e9, 10e9, 10e9, 700e9, 1e9, 25e9)
    zero = partition.zero.plan(params, len(specs), prof, zhw, micro_batches=2, checkpointing=True, barrier=False)
    assert zero.fits and zero.predicted_step_s > 0
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    print(json.dumps({"stages": plan.num_stages, "torch": loaded}))
''')


def test_partition_plans_without_torch() -> None:
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout.strip().splitlines()[-1]
    assert '"torch": []' in out and '"stages": ' in out, out
