"""The planner with train.optimizer_states: host bytes per parameter and the CPU update's traffic per rule, what
``mobius plan`` says of each rule's host memory, and the plans the rules make fit (issue 68: Qwen2.5-14B full
fine-tuning on the shipped 4 x RTX 3090 box in 192 GiB with bf16 moments and 128 GiB with int8; the round-robin
schedule's stores counted alike)."""

from __future__ import annotations

from pathlib import Path

import pytest

from in_process import mobius
from partition.costs import MOMENT_BYTES, host_bytes_per_param, states_advice, update_bytes

ROOT = Path(__file__).resolve().parents[1]
TOPO_2X2 = ROOT / "tests" / "fixtures" / "topology" / "topo2x2_sys.txt"
GiB = 2**30


def test_bytes_per_parameter_by_rule() -> None:
    """fp32 moments 8 bytes, bf16 4, int8 two codes and two fp32 scales per 64 (2.125): a bf16-trained swapped
    parameter with half-precision gradient downloads 14 / 10 / 8.125 bytes of host memory; the CPU update moves 30 /
    22 / 18.25 bytes per parameter; the sums the runtime's stores allocate (tests/test_pipeline.py's host check)."""
    from mobius.states import moment_bytes

    assert MOMENT_BYTES == {"fp32": 8.0, "bf16": 4.0, "int8": 2.125} == {r: moment_bytes(r) for r in MOMENT_BYTES}
    assert [host_bytes_per_param("bf16", True, False, r) for r in MOMENT_BYTES] == [14, 10, 8.125]
    assert [host_bytes_per_param("fp32", False, True, r) for r in MOMENT_BYTES] == [20, 16, 14.125]
    assert [update_bytes(r) for r in MOMENT_BYTES] == [30, 22, 18.25]


def test_store_host_bytes_are_what_the_stores_allocate() -> None:
    """scheduler.stage_store.host_bytes with each rule equals the bytes of a stage store's buffers and its moments."""
    import torch

    from mobius.config import TrainSection
    from mobius.models import get_preset
    from scheduler.stages import stage_layouts
    from scheduler.stage_store import StageStore, host_bytes

    layout = stage_layouts(get_preset("gpt2-tiny"), [0, 3])[0]
    for rule in MOMENT_BYTES:
        store = StageStore(layout, torch.bfloat16, TrainSection(optimizer_states=rule), half_grads=True)
        held = store.master.nbytes + store.half.nbytes + store.optimizer.moments.nbytes
        assert host_bytes([layout], torch.bfloat16, half_grads=True, states=rule) == held, rule


def test_a_plan_that_does_not_fit_names_the_rules_that_would() -> None:
    need = {"fp32": 200 * GiB, "bf16": 150 * GiB, "int8": 120 * GiB}
    assert states_advice(need, "fp32", 192 * GiB) == ("; it fits with train.optimizer_states=bf16 (150.0 GiB) or "
                                                      "train.optimizer_states=int8 (120.0 GiB)")
    assert states_advice(need, "fp32", 128 * GiB) == "; it fits with train.optimizer_states=int8 (120.0 GiB)"
    assert states_advice(need, "bf16", 100 * GiB) == "; neither would fewer bytes of optimizer states (int8: 120.0 GiB)"
    assert states_advice(need, "int8", 100 * GiB) == ""


@pytest.mark.slow
def test_qwen_14b_fits_the_3090_box_with_bf16_or_int8_moments(tmp_path: Path) -> None:
    """``mobius plan configs/finetune-qwen2.5-14b.yaml`` on the 4 x RTX 3090 box, no stage resident (the stores then
    hold every parameter, whatever the partition; resident stages would take some off the host): with fp32 moments
    192 GiB does not hold the swapped stages (192.6 GiB) and the error names both rules that would; with bf16
    moments the plan fits 192 GiB, with int8 128 GiB, each saying its bytes per parameter and every rule's need."""
    common = ["plan", str(ROOT / "configs/finetune-qwen2.5-14b.yaml"), "--topology", str(TOPO_2X2),
              "--partition.time_limit_s=1", f"--partition.cache_dir={tmp_path}", "--parallel.resident_stages=[]"]
    no = mobius([*common, "--partition.host_memory_gib=192"])
    assert no.returncode == 2
    assert ("192.6 GiB (14 bytes per parameter, train.optimizer_states=fp32, half gradient downloads), 192.0 GiB is "
            "available") in no.stderr
    fits = "it fits with train.optimizer_states=bf16 (137.6 GiB) or train.optimizer_states=int8 (111.8 GiB)"
    assert fits in no.stderr
    for rule, gib, per in (("bf16", 192, 10), ("int8", 128, 8.125)):
        yes = mobius([*common, f"--partition.host_memory_gib={gib}", f"--train.optimizer_states={rule}"])
        assert yes.returncode == 0, yes.stderr[-2000:]
        line = next(x for x in yes.stdout.splitlines() if x.startswith("optimizer states:"))
        assert line.startswith(f"optimizer states: {rule} ({MOMENT_BYTES[rule]:g} bytes of AdamW moments, {per:g} "
                               f"bytes in host memory per trained swapped parameter)"), line
        assert "fp32 " in line and "bf16 " in line and "int8 " in line


def test_round_robin_stores_count_the_rule() -> None:
    """The round-robin runtime's shared stores take 4 (bf16) or 5.875 (int8) bytes fewer per trained parameter."""
    from partition.estimate import estimate_units
    from partition.roundrobin_plan import round_robin_host_bytes
    from partition.schedule.roundrobin_actions import Cuts
    from mobius.models import get_preset, unit_specs

    prof = estimate_units(unit_specs(get_preset("llama-3.2-1b")), 1, 256, "bf16", "rtx4090")
    cuts = Cuts((0, 6, 12), (0, 4, 9, 12), prof.num_units)
    trained = sum(u.trainable_count for u in prof.units)
    need = {r: round_robin_host_bytes(prof, cuts, 8, True, 2, r) for r in MOMENT_BYTES}
    assert need["fp32"] - need["bf16"] == 4 * trained
    assert need["fp32"] - need["int8"] == pytest.approx(5.875 * trained, abs=1)
