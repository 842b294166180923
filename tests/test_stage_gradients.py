"""A stage's half-precision gradients go into its fp32 sums directly (scheduler.stages.bind/add_gradients)."""

from __future__ import annotations

import pytest
import torch

from mobius.models.base import lm_loss, run_units
from mobius.models.gpt2 import GPT2Config
from mobius.models.params import build_units
from scheduler.stages import add_gradients, bind, stage_layouts


def _stage(tied: bool):
    """A whole tiny GPT-2 as one stage (embedding, 2 blocks, head): its units, layout and bf16 weights."""
    cfg = GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, tie_word_embeddings=tied)
    layout = stage_layouts(cfg, [0, 4])[0]
    units = build_units(cfg, 0, 4)
    torch.manual_seed(0)
    params = (torch.randn(layout.numel) * 0.05).to(torch.bfloat16)
    return units, layout, params


def _micro_batch(units, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    tokens = torch.randint(0, 320, (2, 16), generator=g)
    lm_loss(run_units(list(units), tokens), torch.randint(0, 320, (2, 16), generator=g)).backward()


@pytest.mark.parametrize("tied", [False, True])
def test_each_micro_batchs_half_gradients_are_added_into_the_fp32_sums_once(tied: bool) -> None:
    """With ``sums`` every trainable ``.grad`` starts empty, so autograd hands over each micro-batch's gradient
    without adding it into a half buffer, and add_gradients adds it into the fp32 sum and drops it. The sums equal
    each micro-batch's gradient taken alone (into a zeroed half buffer, as before), summed in fp32; a weight tied
    within the stage gets both ends' gradients in its one sum."""
    units, layout, params = _stage(tied)
    t = layout.trainable_numel
    alone = []
    for m in range(3):  # the old way: .grad views of a zeroed bf16 buffer, one micro-batch each
        grads = torch.zeros(t, dtype=torch.bfloat16)
        bind(units, layout, 4, params, grads)
        _micro_batch(units, m)
        alone.append(grads.float())
    sums = torch.zeros(t)
    pairs = bind(units, layout, 4, params, None, sums=sums)
    assert pairs and all(p.grad is None and p.requires_grad for p, _ in pairs)
    for m in range(3):
        _micro_batch(units, m)
        add_gradients(pairs)
        assert all(p.grad is None for p, _ in pairs)
    expected = alone[0] + alone[1] + alone[2]
    if not tied:
        assert torch.equal(sums, expected)
    else:  # the old way added the two ends in bf16 first: the same within its rounding, and both ends are there
        assert torch.allclose(sums, expected, rtol=1e-2, atol=1e-4)
        assert len(pairs) == len({id(p) for p, _ in pairs}) and len(pairs) > len({s.data_ptr() for _, s in pairs})



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ends", [2, 1, 0])
def test_a_tied_weights_ends_sum_in_place_a_chunk_at_a_time(monkeypatch, dtype: torch.dtype, ends: int) -> None:
    """TIE sums the two ends' gradients in fp32 into both ends, one (what the pipeline does: the end that
    updates, in place) or neither (the round-robin runtime's norm), without a temporary of the weight's size;
    the values are x + y rounded once, as a whole-tensor sum gives them."""
    import scheduler.stages as stages

    monkeypatch.setattr(stages, "TIE_CHUNK", 7)  # several chunks and a short last one
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(45, generator=g).to(dtype) for _ in range(2))
    total = x.float() + y.float()
    mine, theirs = x.clone(), y.clone()
    sumsq = stages.add_tied(mine, theirs, (mine, theirs)[:ends])  # into mine alone in fp32: added in place
    assert torch.equal(mine, total.to(dtype) if ends >= 1 else x)
    assert torch.equal(theirs, total.to(dtype) if ends == 2 else y)
    assert sumsq == pytest.approx(float(torch.dot(total, total)), rel=1e-6)


def test_a_slot_puts_back_the_parameters_it_made_for_a_stage_and_they_sum_as_fresh_ones() -> None:
    """DeviceSlot.point binds a stage's units the first time and afterwards puts back the parameters it made (a
    dict store each, where making them costs about 40 us a parameter): after another stage and another mode used
    the slot, they are the same objects again, views of the slot's buffers, with their mode's requires_grad, and
    a micro-batch's gradients reach the fp32 sums as through a fresh binding."""
    from scheduler.device_slot import DeviceSlot

    cfg = GPT2Config(vocab_size=320, n_positions=64, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    layouts = stage_layouts(cfg, [0, 2, 4])
    units = [build_units(cfg, lay.first_unit, lay.end_unit) for lay in layouts]
    slot = DeviceSlot(max(lay.numel for lay in layouts), max(lay.trainable_numel for lay in layouts),
                      torch.bfloat16, torch.device("cpu"), accumulate_fp32=True)
    made = []

    def point(j: int, grads: bool) -> None:
        def make():
            made.append((j, grads))
            return bind(units[j], layouts[j], 4, slot.params[:layouts[j].numel], None, grads,
                        slot.acc[:layouts[j].trainable_numel] if grads else None)
        slot.point((j, grads), units[j], make)

    point(0, True)
    first, pairs = dict(units[0].named_parameters()), slot.pairs
    point(1, True)
    point(0, False)
    assert not any(p.requires_grad for p in units[0].parameters())
    point(0, True)
    assert made == [(0, True), (1, True), (0, False)]
    again = dict(units[0].named_parameters())
    assert all(again[n] is p for n, p in first.items()) and slot.pairs is pairs
    base = slot.params.data_ptr()
    views = [base + p.offset * 2 for p in layouts[0].params]  # bf16: 2 bytes an element
    assert sorted({p.data_ptr() for p in again.values()}) == sorted(set(views))
    assert all(p.requires_grad and p.grad is None for p in again.values())
    torch.manual_seed(0)
    slot.params.copy_(torch.randn(slot.params.numel()) * 0.05)
    tokens = torch.randint(0, 320, (2, 16))
    slot.acc.zero_()
    run_units(list(units[0]), tokens).float().square().mean().backward()
    add_gradients(slot.pairs)
    fresh, sums = build_units(cfg, 0, 2), torch.zeros(layouts[0].trainable_numel)
    fresh_pairs = bind(fresh, layouts[0], 4, slot.params[:layouts[0].numel], None, sums=sums)
    run_units(list(fresh), tokens).float().square().mean().backward()
    add_gradients(fresh_pairs)
    assert sums.abs().sum() > 0 and torch.equal(slot.acc[:layouts[0].trainable_numel], sums)
