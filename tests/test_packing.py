"""Rows of several documents (packed conversations): positions restart and attention stays within each
document, in every family and kernel, equal to each document alone and to transformers' packed sequences; the
loss of a step is the mean over its target tokens, equal to transformers' with ``labels = -100`` outside the
targets and ``num_items_in_batch`` over the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import make_hf_llama, make_hf_model, make_hf_moe
from mobius.batch import IGNORE, MicroBatch, step_targets
from mobius.models.hf import load_checkpoint
from mobius.models.packing import Documents

FAMILIES = {"llama-gqa": lambda: make_hf_llama("llama"), "qwen3": lambda: make_hf_llama("qwen3"),
            "gpt2": lambda: make_hf_model("gpt2"), "opt": lambda: make_hf_model("opt"),
            "qwen3_moe": lambda: make_hf_moe("qwen3_moe"),
            "gpt_oss": lambda: make_hf_moe("gpt_oss")}  # sinks, and a 4-token window inside 9-token documents
LENGTHS = [[5, 9, 1, 9], [24, 0, 0, 0]]  # two rows of 24 positions: four documents (one of a single token), one


def _docs() -> torch.Tensor:
    return torch.tensor(LENGTHS, dtype=torch.int32)


def _positions(lengths: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[i for n in row for i in range(n)] for row in lengths])


def test_documents_give_positions_segments_and_a_block_diagonal_mask() -> None:
    d = Documents(torch.tensor([[3, 2, 0], [5, 0, 0]]), "cpu")
    assert d.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert d.segment.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]]
    assert d.mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0],
                                           [0, 0, 0, 1, 1]]
    cu, longest = d.cu_seqlens
    assert cu.tolist() == [0, 3, 5, 10] and longest == 5


@pytest.mark.parametrize("groups", [1, 2])
def test_kernels_equal_attending_to_each_document_alone(groups: int) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 8, generator=g)
    k, v = (torch.randn(2, 4 // groups, 24, 8, generator=g) for _ in range(2))
    alone = torch.zeros_like(q)
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in (n for n in row if n):
            s = slice(start, start + n)
            kk, vv = (t[b:b + 1, :, s].repeat_interleave(groups, dim=1) for t in (k, v))
            alone[b:b + 1, :, s] = torch.nn.functional.scaled_dot_product_attention(q[b:b + 1, :, s], kk, vv,
                                                                                    is_causal=True)
            start += n
    for kernel in ("per_doc", "dense"):
        got = Documents(_docs(), "cpu", kernel).attend(q, k, v, 0.0, None, groups)
        torch.testing.assert_close(got, alone, atol=1e-6, rtol=0, msg=kernel)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                              v.repeat_interleave(groups, 1), is_causal=True)
    assert (causal - alone).abs().max() > 1e-2  # crossing documents would show


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_rows_equal_each_document_alone_logits_and_gradients(family: str, tmp_path: Path) -> None:
    """Logits of a packed row equal each document's alone (RoPE and learned positions restart); the gradients
    of the packed rows' summed loss equal the sum of the documents' own."""
    FAMILIES[family]().save_pretrained(tmp_path / "ck")
    model = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    packed = model(ids, docs=_docs())  # [2, 24, V]
    loss = torch.nn.functional.cross_entropy(packed.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    total = 0.0
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in (n for n in row if n):
            s = slice(start, start + n)
            alone = model(ids[b:b + 1, s])  # [1, n, V]
            torch.testing.assert_close(packed[b:b + 1, s], alone, atol=1e-5, rtol=0, msg=f"{family} row {b} {s}")
            total = total + torch.nn.functional.cross_entropy(alone[0], targets[b, s], reduction="sum")
            start += n
    total.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-5, rtol=1e-4, msg=f"{family} {n}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_equal_transformers_packed_sequences(family: str, tmp_path: Path) -> None:
    """transformers reads packed sequences from position ids that restart (block-diagonal causal masks), but for
    OPT and GPT-OSS, whose masks ignore them (GPT-OSS's eager attention with sinks and windows): there each
    document goes through transformers alone."""
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path / "ck")
    ours = load_checkpoint(tmp_path / "ck")
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        if family in ("opt", "gpt_oss"):
            ends = [torch.tensor([n for n in row if n]).cumsum(0).tolist() for row in LENGTHS]
            theirs = torch.stack([torch.cat([hf(ids[b:b + 1, s:e]).logits[0] for s, e in zip([0, *cuts], cuts)])
                                  for b, cuts in enumerate(ends)])
        else:
            theirs = hf(ids, position_ids=_positions(LENGTHS), use_cache=False).logits
        mine = ours(ids, docs=_docs())
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def _masked_batches() -> list[MicroBatch]:
    """Two micro-batches of very different target counts (a mean of their means weighs them equally)."""
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 300, (2, 2, 25), generator=g)
    few = tokens[0, :, 1:].clone()
    few[:, :20] = IGNORE  # 8 targets
    many = tokens[1, :, 1:].clone()
    many[0, :3] = IGNORE  # 45 targets
    return [MicroBatch(tokens[0, :, :-1], few, _docs()), MicroBatch(tokens[1, :, :-1], many, _docs())]


def test_single_engine_loss_and_gradients_equal_transformers_with_num_items_in_batch(tmp_path: Path) -> None:
    """The reference engine's step: transformers' loss with labels -100 outside the targets and
    ``num_items_in_batch`` = the step's target count, summed over the micro-batches (not their mean)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from mobius.config import config_from_dict
    from scheduler.single_engine import SingleEngine

    hf = make_hf_llama("llama").float()
    hf.save_pretrained(tmp_path / "ck")
    batches = _masked_batches()
    n = step_targets(batches)
    assert n == 8 + 45
    theirs = 0.0
    for b in batches:
        logits = hf(b.inputs, position_ids=_positions(LENGTHS), use_cache=False).logits
        loss = ForCausalLMLoss(logits, None, logits.shape[-1], num_items_in_batch=torch.tensor(n),
                               shift_labels=b.targets)
        loss.backward()
        theirs += float(loss.detach())
    mean_of_means = sum(float(ForCausalLMLoss(hf(b.inputs, position_ids=_positions(LENGTHS), use_cache=False).logits,
                                              None, 300,
                                              shift_labels=b.targets)) for b in batches) / 2
    assert abs(mean_of_means - theirs) > 1e-3  # the test tells the two apart
    cfg = config_from_dict({"model": {"checkpoint": str(tmp_path / "ck")}, "data": {"seq_len": 24},
                            "train": {"micro_batch_size": 2, "micro_batches": 2, "grad_clip": 0.0, "lr": 1e-3,
                                      "warmup_steps": 0}}, "test.yaml")
    model = load_checkpoint(tmp_path / "ck")
    engine = SingleEngine(model, cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine.optimizer.step = lambda lr: None  # keep the gradients to compare (no update, no zeroing)
    engine.optimizer.zero_grad = lambda: None
    stats = engine.train_step(0, batches, 1e-3)
    assert abs(stats.loss - theirs) < 1e-5, (stats.loss, theirs)
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    ours = dict(model.named_parameters())
    torch.testing.assert_close(ours["embed.embed_tokens.weight"].grad, hf_grads["model.embed_tokens.weight"],
                               atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(ours["blocks.1.mlp.down_proj.weight"].grad,
                               hf_grads["model.layers.1.mlp.down_proj.weight"], atol=1e-6, rtol=1e-4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert abs(engine.evaluate(batches) - theirs) < 1e-5


def test_the_plan_counts_attention_within_packed_documents(tmp_path: Path) -> None:
    """Estimated and measured profiles take the packed documents' length: attention's FLOPs are the documents'
    squares, not the row's; the profile cache tells the two apart."""
    from mobius.models import get_preset, unit_specs
    from mobius.models.packing import attended_pairs, even_documents
    from partition.estimate import estimate_units
    from partition.profile import get_profile, profile_key

    assert even_documents(8192, 3000) == [3000, 3000, 2192] and even_documents(512, None) == [512]
    assert attended_pairs(8192, 512) == 16 * 512**2
    specs = unit_specs(get_preset("llama-3.1-8b"))
    block = specs[1]
    q = 32 * 128
    assert block.fwd_flops(1, 8192) - block.fwd_flops(1, 8192, 512) == pytest.approx(2.0 * q * (8192**2 - 16 * 512**2))
    plain = estimate_units(specs, 1, 8192, "bf16", "rtx4090")
    packed = estimate_units(specs, 1, 8192, "bf16", "rtx4090", doc_tokens=512)
    assert packed.doc_tokens == 512 and packed.units[1].fwd_s < 0.9 * plain.units[1].fwd_s  # (12% less at 8192)
    assert packed.units[-1].fwd_s == plain.units[-1].fwd_s  # the head has no attention
    assert profile_key(specs, 1, 8192, "bf16", "cpu") != profile_key(specs, 1, 8192, "bf16", "cpu", 512)
    tiny = unit_specs(get_preset("llama-tiny"))
    measured = get_profile(tiny, 1, 256, "fp32", "measured", device="cpu", cache_dir=tmp_path, doc_tokens=32)
    assert measured.doc_tokens == 32 and len(list((tmp_path / "profiles").glob("*.json"))) == 1


def test_mobius_plan_profiles_the_chat_demo_within_its_documents(tmp_path: Path) -> None:
    """``mobius plan`` on packed conversations takes their mean length from the data, as ``mobius train`` does, and
    says so; ``partition.document_tokens`` overrides it; text plans one sequence per row."""
    from in_process import mobius

    common = [f"--data.cache_dir={tmp_path}", f"--partition.cache_dir={tmp_path}"]
    out = mobius(["plan", "configs/chat-demo.yaml", *common])
    assert out.returncode == 0, out.stderr
    doc = int(out.stdout.split("attention within documents of ")[1].split()[0])
    assert 100 < doc < 256
    out = mobius(["plan", "configs/chat-demo.yaml", *common, "--partition.document_tokens=64"])
    assert "attention within documents of 64 tokens" in out.stdout
    out = mobius(["plan", "configs/demo.yaml", *common])
    assert out.returncode == 0 and "attention within documents" not in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("groups", [1, 4])
def test_on_cuda_every_kernel_attends_within_documents(groups: int) -> None:
    """bf16 on the GPU: the kernel pick_kernel takes there (varlen where torch has it), the dense mask and one call
    per document agree, forward and backward, within bf16's rounding."""
    from mobius.models.packing import pick_kernel

    assert pick_kernel(torch.device("cuda"), torch.bfloat16, 0.0) in ("varlen", "per_doc")
    g = torch.Generator().manual_seed(0)
    make = lambda h: torch.randn(2, h, 24, 64, generator=g).cuda().bfloat16().requires_grad_()  # noqa: E731
    q, k, v = make(8), make(8 // groups), make(8 // groups)
    outs, grads = {}, {}
    for kernel in ("per_doc", "dense", pick_kernel(q.device, q.dtype, 0.0)):
        y = Documents(_docs(), "cuda", kernel).attend(q, k, v, 0.0, None, groups)
        (dq,) = torch.autograd.grad(y.float().square().sum(), q)
        outs[kernel], grads[kernel] = y.float(), dq.float()
    for kernel in outs:
        torch.testing.assert_close(outs[kernel], outs["per_doc"], atol=2e-2, rtol=2e-2, msg=kernel)
        torch.testing.assert_close(grads[kernel], grads["per_doc"], atol=5e-2, rtol=5e-2, msg=kernel)
