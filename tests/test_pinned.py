"""Host buffers page-locked at their exact size (scheduler/pinned.py), against a stand-in for the CUDA
runtime that records what is registered; tests/test_pipeline_gpu.py checks the real one."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from mobius.config import TrainSection
from mobius.models.gpt2 import GPT2Config
from scheduler import pinned
from scheduler.stages import stage_layouts
from scheduler.stage_store import StageStore, host_bytes


class FakeCudart:
    """Records registrations by address; ``fail`` makes every registration return CUDA error 2."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.registered: dict[int, int] = {}
        self.attempts = 0
        self.errors_cleared = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.attempts += 1
        if self.fail:
            return 2
        assert ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0

    def cudaGetLastError(self) -> int:
        self.errors_cleared += 1
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setitem(pinned._state, "register", True)
    return fake


class Owner:
    pass


def test_a_buffer_is_registered_at_its_exact_size_on_its_own_pages(cudart: FakeCudart) -> None:
    owner = Owner()
    t = pinned.host_zeros(1_000_003, torch.bfloat16, True, owner)  # 2,000,006 bytes: 2 MiB would be 2,097,152
    assert cudart.registered == {t.data_ptr(): 2_000_006}
    assert t.data_ptr() % 4096 == 0 and t.dtype == torch.bfloat16 and t.shape == (1_000_003,)
    assert not t.any()


def test_the_registration_ends_with_the_owner_and_the_memory_outlives_it(cudart: FakeCudart) -> None:
    owner = Owner()
    view = pinned.host_zeros(4096, torch.float32, True, owner)[100:200]
    view.fill_(3.0)
    assert len(cudart.registered) == 1
    del owner
    gc.collect()
    assert cudart.registered == {}
    assert view.sum().item() == 300.0  # unregistered, not freed: the view still holds the mapping


def test_without_pinning_nothing_is_registered(cudart: FakeCudart) -> None:
    t = pinned.host_zeros(1000, torch.float32, False)
    assert cudart.attempts == 0 and t.shape == (1000,) and not t.any()


def test_a_refused_registration_falls_back_to_torch_pinned_memory_once_and_says_so(
        cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cudart.fail = True
    fallbacks = []
    monkeypatch.setattr(pinned, "_torch_pinned", lambda t: fallbacks.append(t.numel()) or t)
    with caplog.at_level(logging.WARNING, logger="scheduler.pinned"):
        a = pinned.host_zeros(1000, torch.float32, True, Owner())
        b = pinned.host_zeros(2000, torch.bfloat16, True, Owner())
    assert fallbacks == [1000, 2000] and a.shape == (1000,) and b.dtype == torch.bfloat16
    assert cudart.attempts == 1, "after one refusal the process stops trying"
    assert cudart.errors_cleared == 1, "the refused call's error must not surface in torch's next launch check"
    assert len(caplog.records) == 1 and "failed with CUDA error 2" in caplog.text and "power of two" in caplog.text


def _layout(numel_blocks: int = 2):
    cfg = GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=numel_blocks, n_head=2)
    return stage_layouts(cfg, [0, 1 + numel_blocks, 2 + numel_blocks])[0]


@pytest.mark.parametrize("dtype,half_grads,locked,delayed", [(torch.bfloat16, False, 6, False),
                                                             (torch.bfloat16, True, 2, False),
                                                             (torch.float32, False, 8, False),
                                                             (torch.bfloat16, False, 6, True),
                                                             (torch.float32, False, 8, True)])
def test_a_stage_store_locks_exactly_what_the_host_memory_check_counts(cudart: FakeCudart, dtype: torch.dtype,
                                                                       half_grads: bool, locked: int,
                                                                       delayed: bool) -> None:
    """bf16: the half copy (2) and the fp32 gradient (4) page-locked, master and moments (12) pageable;
    fp32: the master is the upload copy (4) and the gradient (4); none of it rounded up. train.update=
    delayed in fp32: the upload copy (the compute weights) and the gradient locked, the master beside
    them pageable (4 more); in bf16 the same as sync."""
    lay = _layout()
    store = StageStore(lay, dtype, TrainSection(), pin=True, half_grads=half_grads, delayed=delayed)
    assert sum(cudart.registered.values()) == locked * lay.numel
    pageable = 8 if dtype == torch.float32 and not delayed else 12  # AdamW's m and v (and a separate fp32 master)
    assert host_bytes([lay], dtype, half_grads, delayed) == (locked + pageable) * lay.numel
    del store
    gc.collect()
    assert cudart.registered == {}


@pytest.mark.parametrize("dtype,half_grads,delayed", [(torch.bfloat16, False, False), (torch.bfloat16, True, False),
                                                     (torch.float32, False, False), (torch.float32, False, True)])
def test_a_tied_head_end_has_no_master_or_moments_and_uploads_the_embeddings_copy(
        cudart: FakeCudart, dtype: torch.dtype, half_grads: bool, delayed: bool) -> None:
    """Both ends of a tied weight on one worker: the head's store updates only what precedes its end (the
    end is the last thing that trains there), so its master and moments stop there; its half copy and
    gradient keep the end (the gradient comes down for the two ends' sum). The host memory check counts
    exactly that, the upload reads the end from the embedding's copy, and the head's weights name it too."""
    from scheduler.stage_store import TiedEnd

    cfg = GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    first, _, last = stage_layouts(cfg, [0, 1, 3, 4])
    emb, head = first.place_of("embed.wte.weight"), last.place_of("head.lm_head.weight")
    assert head.offset + head.numel == last.trainable_numel  # laid last
    source = StageStore(first, dtype, TrainSection(), pin=True, half_grads=half_grads, delayed=delayed)
    before = sum(cudart.registered.values())
    store = StageStore(last, dtype, TrainSection(), pin=True, half_grads=half_grads, delayed=delayed,
                       tied=TiedEnd(head.offset, head.numel, source, emb.offset))
    own, t = store.own, last.trainable_numel
    assert own == head.offset and store.master.numel() == own and store.optimizer.moments.numel == own
    locked = sum(cudart.registered.values()) - before
    shared = dtype == torch.float32 and not delayed
    allocated = locked + own * (8 if shared else 12)  # AdamW's m and v (and a separate fp32 master)
    assert host_bytes([last], dtype, half_grads, delayed, tied_numel=t - own) == allocated
    source.master.uniform_()
    source.half[:first.trainable_numel].copy_(source.master)
    store.half.fill_(-1.0)
    got = torch.cat([src for _, _, src in store.upload_pieces(0, last.numel)])
    assert torch.equal(got[:own], store.half[:own])
    assert torch.equal(got[own:own + head.numel], source.half[emb.offset:emb.offset + head.numel])
    assert [(a, b) for a, b, _ in store.upload_pieces(3, own + 5)] == [(3, own), (own, own + 5)]
    assert torch.equal(store.weights()["head.lm_head.weight"], source.weights()["embed.wte.weight"])
    store.optimizer.set_steps(1)
    assert store.tied_names == {"head.lm_head.weight"}
    assert set(store.moments()) == {"head.ln_f.weight", "head.ln_f.bias"}


@pytest.mark.parametrize("dtype,delayed,locked", [(torch.bfloat16, False, [2, 4]), (torch.float32, False, [4, 4]),
                                                  (torch.bfloat16, True, [2, 4]), (torch.float32, True, [4, 4])])
def test_an_offloaded_zero_chunk_locks_its_gradient_shard_and_half_copy(cudart: FakeCudart, dtype: torch.dtype,
                                                                        delayed: bool, locked: list[int]) -> None:
    """The half copy (fp32: the master, or under train.update=delayed the separate compute copy) and the
    fp32 gradient shard are page-locked, at their exact size; the AdamW of a delayed chunk writes no copy."""
    from mobius.layout import ParamInfo, build_layout
    from scheduler.zero.shards import HostChunk

    params = [ParamInfo((f"u{u}.w",), (1000, 3), (u,), decay=True) for u in range(2)]
    layout = build_layout(params, 2, chunk_size=4096, world=2, align=16)
    chunk = HostChunk(layout, 0, 1, dtype, TrainSection(), pin=True, delayed=delayed)
    assert sorted(cudart.registered.values()) == [n * layout.shard for n in locked]  # half copy, fp32 gradient
    assert (chunk.half.data_ptr() == chunk.shards.master.data_ptr()) == (dtype == torch.float32 and not delayed)
    assert (chunk.shards.optimizer.half is None) == (delayed or dtype == torch.float32)
    del chunk
    gc.collect()
    assert cudart.registered == {}
