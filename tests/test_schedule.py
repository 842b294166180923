"""The pipeline step as data: literal action lists, invariants, and the passes that build them."""

from __future__ import annotations

import pytest

from partition.schedule import COMPUTE, Kind, build_eval_schedule, build_schedule, timeline, uploads_in_order


def _lists(s) -> list[str]:
    return [" ".join(str(a) for a in acts) for acts in s.actions]


def test_literal_timeline_four_stages_two_workers_two_micro_batches() -> None:
    """S=4, N=2, M=2, two slots, no barrier: the exact action list of each worker (read the legend of
    :func:`timeline`: U upload, F forward, FB forward+loss+backward, B backward, ra/sa and rg/sg
    receive/send activations and gradients, D download, O update, X free, R reduce)."""
    s = build_schedule(4, 2, 2)
    assert _lists(s) == [
        "Uf0 Uf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 Ub0 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 rg2,0 B2,0 sg2,0 rg2,1 B2,1 D2 O2 "
        "sg2,1 Xf2 rg0,0 B0,0 rg0,1 B0,1 D0 O0 Xb0 R",
        "Uf1 Uf3 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 Ub1 ra3,0 FB3,0 sg3,0 ra3,1 FB3,1 D3 O3 sg3,1 Xf3 rg1,0 B1,0 "
        "sg1,0 rg1,1 B1,1 D1 O1 sg1,1 Xb1 R",
    ]


def test_literal_timeline_with_a_barrier_a_tied_weight_and_one_slot() -> None:
    """Clipping (updates after REDUCE, ascending), a tied weight (TIE before REDUCE), no prefetch."""
    s = build_schedule(4, 2, 2, num_slots=1, barrier=True, tied=True)
    assert _lists(s) == [
        "Uf0 F0,0 sa0,0 F0,1 sa0,1 Xf0 Uf2 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 rg2,0 B2,0 sg2,0 rg2,1 B2,1 D2 sg2,1 "
        "Xf2 Ub0 rg0,0 B0,0 rg0,1 B0,1 D0 Xb0 T R O0 O2",
        "Uf1 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 Uf3 ra3,0 FB3,0 sg3,0 ra3,1 FB3,1 D3 sg3,1 Xf3 Ub1 rg1,0 B1,0 "
        "sg1,0 rg1,1 B1,1 D1 sg1,1 Xb1 T R O1 O3",
    ]


def test_eval_schedule_is_forward_only() -> None:
    s = build_eval_schedule(4, 2, 2)
    assert _lists(s) == ["Uf0 Uf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 Xf2 R",
                         "Uf1 Uf3 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 ra3,0 F3,0 ra3,1 F3,1 Xf3 R"]
    assert not s.train



@pytest.mark.parametrize("S,N,M", [(4, 2, 2), (6, 2, 3), (12, 4, 2), (3, 1, 4), (1, 1, 2), (8, 4, 1)])
@pytest.mark.parametrize("slots", [2, 1])
def test_schedule_invariants(S: int, N: int, M: int, slots: int) -> None:
    s = build_schedule(S, N, M, num_slots=slots)  # check() runs inside: residency, slots, one update
    computes = [a for acts in s.actions for a in acts if a.kind in COMPUTE]
    assert sorted((a.stage, a.micro) for a in computes if a.kind != Kind.BACKWARD) == [(j, m) for j in range(S)
                                                                                        for m in range(M)]
    assert len([a for a in computes if a.kind == Kind.BACKWARD]) == (S - 1) * M
    pairs = {Kind.SEND_ACT: "act", Kind.SEND_GRAD: "grad", Kind.RECV_ACT: "act", Kind.RECV_GRAD: "grad"}
    sends = sorted((pairs[a.kind], a.stage, a.micro) for acts in s.actions for a in acts
                   if a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD))
    recvs = sorted((pairs[a.kind], a.stage + (-1 if a.kind == Kind.RECV_ACT else 1), a.micro)
                   for acts in s.actions for a in acts if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD))
    assert sends == recvs
    uploads = sum(a.kind == Kind.UPLOAD for acts in s.actions for a in acts)
    resident_turns = min(S, N)  # each worker's last forward stage stays for its first backward
    assert uploads == 2 * S - resident_turns
    grid = timeline(s)
    assert grid.count("gpu") == N and "FB" in grid


def test_prefetch_issues_the_next_upload_before_the_current_stage_computes() -> None:
    acts = [str(a) for a in build_schedule(6, 2, 2, num_slots=2).actions[0]]
    assert acts.index("Uf2") < acts.index("F0,0")  # stage 2 uploads while stage 0 computes
    assert acts.index("Uf4") < acts.index("F2,0")
    acts = [str(a) for a in build_schedule(6, 2, 2, num_slots=1).actions[0]]
    assert acts.index("Uf2") > acts.index("Xf0")  # only after stage 0 is freed
    order = uploads_in_order(build_schedule(6, 2, 2))
    assert order[:6] == [(j, "f") for j in range(6)] and order[6:] == [(3, "b"), (2, "b"), (1, "b"), (0, "b")]


