"""The pipeline step as data: literal action lists, invariants, and the passes that build them."""

from __future__ import annotations

import pytest

from partition.schedule import (COMPUTE, Kind, PipelineOptions, ScheduleError, build_eval_schedule, build_schedule,
                                timeline, uploads_in_order)


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
    s = build_schedule(4, 2, 2, options=PipelineOptions(num_slots=1, barrier=True), tied=True)
    assert _lists(s) == [
        "Uf0 F0,0 sa0,0 F0,1 sa0,1 Xf0 Uf2 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 rg2,0 B2,0 sg2,0 rg2,1 B2,1 D2 sg2,1 "
        "Xf2 Ub0 rg0,0 B0,0 rg0,1 B0,1 D0 Xb0 T R O0 O2",
        "Uf1 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 Uf3 ra3,0 FB3,0 sg3,0 ra3,1 FB3,1 D3 sg3,1 Xf3 Ub1 rg1,0 B1,0 "
        "sg1,0 rg1,1 B1,1 D1 sg1,1 Xb1 T R O1 O3",
    ]


def test_literal_timeline_of_a_tied_weight_whose_ends_one_worker_holds() -> None:
    """Both ends on worker 0 (5 stages on 2 workers): no TIE; stage 0's backward upload (``Ub0``) brings the head's
    end's gradient up, so it comes after the head's download (D4) and the sum is D0's; the ends update last."""
    s = build_schedule(5, 2, 2, options=PipelineOptions(), tied=True)
    assert s.tie_in
    assert _lists(s)[0] == ("Uf0 Uf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 Uf4 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 Xf2 Ub2 "
                            "ra4,0 FB4,0 sg4,0 ra4,1 FB4,1 D4 sg4,1 Xf4 Ub0 rg2,0 B2,0 sg2,0 rg2,1 B2,1 D2 O2 sg2,1 "
                            "Xb2 rg0,0 B0,0 rg0,1 B0,1 D0 Xb0 O0 O4 R")
    assert not build_schedule(4, 2, 2, tied=True).tie_in  # the ends on two workers: summed on the host (TIE)


def test_literal_timeline_with_one_slot_and_a_prefetch_buffer() -> None:
    """Partial prefetch: with one slot, the next residency's first bytes go to the prefetch buffer (P)
    where two slots would issue its upload -- when the current residency starts computing -- and its
    upload (U, after the free) completes it; one residency in the buffer at a time."""
    s = build_schedule(4, 2, 2, options=PipelineOptions(num_slots=1, barrier=True, prefetch_bytes=64), tied=True)
    assert _lists(s) == [
        "Uf0 Pf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 Uf2 Pb0 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 rg2,0 B2,0 sg2,0 rg2,1 B2,1 D2 "
        "sg2,1 Xf2 Ub0 rg0,0 B0,0 rg0,1 B0,1 D0 Xb0 T R O0 O2",
        "Uf1 Pf3 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 Uf3 Pb1 ra3,0 FB3,0 sg3,0 ra3,1 FB3,1 D3 sg3,1 Xf3 Ub1 rg1,0 "
        "B1,0 sg1,0 rg1,1 B1,1 D1 sg1,1 Xb1 T R O1 O3",
    ]
    evaluation = build_eval_schedule(4, 2, 2, options=PipelineOptions(num_slots=1, prefetch_bytes=64))
    assert _lists(evaluation)[0] == "Uf0 Pf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 Uf2 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 Xf2 R"


def test_eval_schedule_is_forward_only() -> None:
    s = build_eval_schedule(4, 2, 2)
    assert _lists(s) == ["Uf0 Uf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 Xf2 R",
                         "Uf1 Uf3 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 ra3,0 F3,0 ra3,1 F3,1 Xf3 R"]
    assert not s.train



@pytest.mark.parametrize("S,N,M", [(4, 2, 2), (6, 2, 3), (12, 4, 2), (3, 1, 4), (1, 1, 2), (8, 4, 1)])
@pytest.mark.parametrize("slots", [2, 1])
def test_schedule_invariants(S: int, N: int, M: int, slots: int) -> None:
    s = build_schedule(S, N, M, options=PipelineOptions(num_slots=slots))  # check() runs inside
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
    acts = [str(a) for a in build_schedule(6, 2, 2, options=PipelineOptions(num_slots=2)).actions[0]]
    assert acts.index("Uf2") < acts.index("F0,0")  # stage 2 uploads while stage 0 computes
    assert acts.index("Uf4") < acts.index("F2,0")
    acts = [str(a) for a in build_schedule(6, 2, 2, options=PipelineOptions(num_slots=1)).actions[0]]
    assert acts.index("Uf2") > acts.index("Xf0")  # only after stage 0 is freed
    order = uploads_in_order(build_schedule(6, 2, 2))
    assert order[:6] == [(j, "f") for j in range(6)] and order[6:] == [(3, "b"), (2, "b"), (1, "b"), (0, "b")]




def _six(**options) -> list[str]:
    return _lists(build_schedule(6, 2, 2, options=PipelineOptions(**options)))


def test_literal_timeline_with_boundary_inputs_in_host_memory() -> None:
    """Offload: every stage that leaves its slot before its backward sends each forward's input to host
    memory (H) and takes them back right after its backward upload (L); not stage 0 (token ids), not a
    worker's last swapped stage (4 and 5: their backward follows without an upload)."""
    assert _six(offload_inputs=True) == [
        "Uf0 Uf2 F0,0 sa0,0 F0,1 sa0,1 Xf0 Uf4 ra2,0 F2,0 H2,0 sa2,0 ra2,1 F2,1 H2,1 sa2,1 Xf2 Ub2 L2 ra4,0 F4,0 "
        "sa4,0 ra4,1 F4,1 sa4,1 rg4,0 B4,0 sg4,0 rg4,1 B4,1 D4 O4 sg4,1 Xf4 Ub0 rg2,0 B2,0 sg2,0 rg2,1 B2,1 D2 O2 "
        "sg2,1 Xb2 rg0,0 B0,0 rg0,1 B0,1 D0 O0 Xb0 R",
        "Uf1 Uf3 ra1,0 F1,0 H1,0 sa1,0 ra1,1 F1,1 H1,1 sa1,1 Xf1 Uf5 ra3,0 F3,0 H3,0 sa3,0 ra3,1 F3,1 H3,1 sa3,1 Xf3 "
        "Ub3 L3 ra5,0 FB5,0 sg5,0 ra5,1 FB5,1 D5 O5 sg5,1 Xf5 Ub1 L1 rg3,0 B3,0 sg3,0 rg3,1 B3,1 D3 O3 sg3,1 Xb3 "
        "rg1,0 B1,0 sg1,0 rg1,1 B1,1 D1 O1 sg1,1 Xb1 R",
    ]


def test_a_kept_stage_offloads_nothing() -> None:
    """A kept stage's graph holds its input on the device: stage 1 has no H / L (stage 3 still has)."""
    lists = _six(offload_inputs=True, kept=frozenset({1}))
    assert "H1" not in lists[1] and "L1" not in lists[1] and "H3,0" in lists[1] and "Ub3 L3" in lists[1]
    assert build_schedule(6, 2, 2, options=PipelineOptions(offload_inputs=True, kept=frozenset({1}))).offloaded \
        == frozenset({2, 3})


def test_literal_timeline_with_resident_and_kept_stages() -> None:
    """Stage 2 resident (no upload, download or CPU update: a device update Od2 after its last
    backward's send) and kept (its backward reuses the forward's graph: the list is the same, the
    compute differs); worker 0 holds one slot fewer in use."""
    assert _six(resident=frozenset({2}), kept=frozenset({2, 3})) == [
        "Uf0 Uf4 F0,0 sa0,0 F0,1 sa0,1 Xf0 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 Ub0 ra4,0 F4,0 sa4,0 ra4,1 F4,1 sa4,1 "
        "rg4,0 B4,0 sg4,0 rg4,1 B4,1 D4 O4 sg4,1 Xf4 rg2,0 B2,0 sg2,0 rg2,1 B2,1 sg2,1 Od2 rg0,0 B0,0 rg0,1 B0,1 D0 "
        "O0 Xb0 R",
        "Uf1 Uf3 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 Uf5 ra3,0 F3,0 sa3,0 ra3,1 F3,1 sa3,1 Xf3 Ub3 ra5,0 FB5,0 "
        "sg5,0 ra5,1 FB5,1 D5 O5 sg5,1 Xf5 Ub1 rg3,0 B3,0 sg3,0 rg3,1 B3,1 D3 O3 sg3,1 Xb3 rg1,0 B1,0 sg1,0 rg1,1 "
        "B1,1 D1 O1 sg1,1 Xb1 R",
    ]


def test_literal_timeline_of_device_updates_after_the_barrier() -> None:
    """With a barrier every update follows REDUCE, resident stages' device updates first (they run on
    the compute stream before the next step's first forward), then the CPU updates in ascending order."""
    assert _six(resident=frozenset({2, 3}), barrier=True) == [
        "Uf0 Uf4 F0,0 sa0,0 F0,1 sa0,1 Xf0 ra2,0 F2,0 sa2,0 ra2,1 F2,1 sa2,1 Ub0 ra4,0 F4,0 sa4,0 ra4,1 F4,1 sa4,1 "
        "rg4,0 B4,0 sg4,0 rg4,1 B4,1 D4 sg4,1 Xf4 rg2,0 B2,0 sg2,0 rg2,1 B2,1 sg2,1 rg0,0 B0,0 rg0,1 B0,1 D0 Xb0 R "
        "Od2 O0 O4",
        "Uf1 Uf5 ra1,0 F1,0 sa1,0 ra1,1 F1,1 sa1,1 Xf1 ra3,0 F3,0 sa3,0 ra3,1 F3,1 sa3,1 Ub1 ra5,0 FB5,0 sg5,0 "
        "ra5,1 FB5,1 D5 sg5,1 Xf5 rg3,0 B3,0 sg3,0 rg3,1 B3,1 sg3,1 rg1,0 B1,0 sg1,0 rg1,1 B1,1 D1 sg1,1 Xb1 R "
        "Od3 O1 O5",
    ]


def test_delayed_updates_after_the_barrier_go_in_the_order_of_the_downloads() -> None:
    """Under train.update=delayed the next step's uploads wait only for the compute copy taken at each DOWNLOAD,
    and its downloads for the updates: the updates after REDUCE follow the downloads (D4 D0: O4 O0), the
    device updates still first."""
    s = build_schedule(6, 2, 2, options=PipelineOptions(barrier=True, delayed=True, resident=frozenset({2, 3})))
    for acts in s.actions:
        downloads = [a.stage for a in acts if a.kind == Kind.DOWNLOAD]
        after = [a for a in acts[[a.kind for a in acts].index(Kind.REDUCE) + 1:]]
        assert after[0].kind == Kind.DEVICE_UPDATE and [a.stage for a in after[1:]] == downloads
    assert [str(a) for a in s.actions[0] if a.kind in (Kind.DOWNLOAD, Kind.UPDATE)] == ["D4", "D0", "O4", "O0"]


def test_broken_settings_are_errors_even_under_python_O() -> None:
    """The schedule's checks raise (not assert): a tied end cannot be resident, placements must cover
    every worker."""
    with pytest.raises(ScheduleError, match=r"stage\(s\) \[0\] hold an end of the tied weight"):
        build_schedule(4, 2, 2, options=PipelineOptions(resident=frozenset({0})), tied=True)
    with pytest.raises(ScheduleError, match="every worker a stage"):
        build_schedule(4, 2, 2, gpu_of=[0, 0, 0, 0])
    with pytest.raises(ScheduleError, match="prefetch buffer .* goes with one device slot, not 2"):
        PipelineOptions(num_slots=2, prefetch_bytes=64)


def test_zero_program_is_printable_like_the_pipelines() -> None:
    """Zero mode's program (beside the pipeline's schedule): unit-major forwards, the last unit's loss
    and backward, backwards in reverse; a tied weight's chunk is reduced after each of its runs."""
    from mobius.layout import ParamInfo, build_layout
    from partition.schedule import program_timeline, train_program

    params = [ParamInfo(("embed.w", "head.w"), (64,), (0, 3), True)] + \
        [ParamInfo((f"blocks.{i}.w",), (64,), (i + 1,), True) for i in range(2)]
    layout = build_layout(params, 4, 64)
    lines = program_timeline(train_program(4), layout).splitlines()
    assert lines[:-1] == ["   F0  chunks [0]", "   F1  chunks [1]", "   F2  chunks [2]", "   L3  chunks [0]  reduce [0]",
                          "   B2  chunks [2]  reduce [2]", "   B1  chunks [1]  reduce [1]", "   B0  chunks [0]  reduce [0]"]
