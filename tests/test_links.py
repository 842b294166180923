"""The mailboxes between the workers of one machine (``scheduler.links.MailLink``): every message arrives
whole and under its own tag, whatever order the receiver takes them in, also when the mailbox is full or the
message does not fit a slot (then it goes through gloo, as its record says); on CPU workers, and on two
workers sharing a GPU (page-locked mailboxes, copies on the link's threads and side streams)."""

from __future__ import annotations

import pytest
import torch

from partition.schedule import Kind, PipelineOptions, build_schedule
from scheduler.links import mailbox_sends
from spawned import spawn_cases

SHAPE = (3, 4)
CASES = [{"slots": 8, "tags": [3, 1, 4, 5], "taken": [5, 3, 4, 1]},  # every message in a slot
         {"slots": 2, "tags": [7, 8, 9, 10, 11], "taken": [11, 7, 9, 8, 10]},  # three past a full mailbox
         {"slots": 4, "tags": [20, 21, 22], "taken": [21, 20, 22], "odd": 21}]  # one of another size


def _message(tag: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * tag


def _exchange(case: dict, world: int) -> dict:
    import torch.distributed as dist

    from scheduler.counters import Counters
    from scheduler.links import Mailboxes, MailLink

    rank, device = dist.get_rank(), torch.device(case["device"])
    boxes = Mailboxes({(0, 1): case["slots"], (1, 0): case["slots"]}, SHAPE, torch.float32, pin=device.type == "cuda")
    link = MailLink(rank, 1 - rank, boxes, Counters(), device)
    shape = {tag: (2, 2) if tag == case.get("odd") else SHAPE for tag in case["tags"]}
    through_gloo = 0
    if rank == 0:
        for tag in case["tags"]:
            link.send(_message(tag, shape[tag]).to(device), tag)
        for sent in link.sends:  # a GPU's sends run on the link's thread
            sent.result()
        through_gloo = len(link.pending)
        dist.barrier()  # every message sent before the first is taken
        back = [link.recv(SHAPE, torch.float32, 99)().cpu().tolist()]
    else:
        dist.barrier()
        waiters = {tag: link.recv(shape[tag], torch.float32, tag) for tag in case["tags"]}
        back = [waiters[tag]().cpu().tolist() for tag in case["taken"]]
        link.send(_message(99).to(device), 99)
    link.flush()
    dist.barrier()
    return {"back": back, "through_gloo": through_gloo, "left": sorted(link.arrived)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_messages_arrive_whole_in_any_order_and_past_a_full_mailbox(device: str) -> None:
    cases = [{**case, "device": device} for case in CASES]
    results = spawn_cases(_exchange, cases, 2)
    for case, (sender, receiver) in zip(cases, results):
        odd = case.get("odd")
        assert receiver["back"] == [_message(t, (2, 2) if t == odd else SHAPE).tolist() for t in case["taken"]]
        assert sender["back"] == [_message(99).tolist()]
        assert sender["through_gloo"] == max(0, len(case["tags"]) - case["slots"]) + (odd is not None)
        assert receiver["left"] == sender["left"] == []


def test_mailboxes_hold_two_steps_of_each_pairs_messages() -> None:
    sched = build_schedule(4, 2, 3, [0, 1, 0, 1], PipelineOptions(), False)
    sends = mailbox_sends([sched.actions], 2)
    for src in range(2):
        n = sum(a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD) for a in sched.actions[src])
        assert sends[(src, 1 - src)] == 2 * n > 0


def test_a_mailbox_holds_its_messages_within_its_bytes() -> None:
    from scheduler.links import MAILBOX_BYTES, mailbox_slots

    assert mailbox_slots(36, 512 << 10) == 36  # the bench's GPT-2: two steps of messages fit
    assert mailbox_slots(240, 64 << 20) == 2  # a 1B-class model's 64 MiB activations: two, the rest via gloo
    assert mailbox_slots(240, 1 << 20) * (1 << 20) == MAILBOX_BYTES
    assert mailbox_slots(1, 1 << 30) == 1
