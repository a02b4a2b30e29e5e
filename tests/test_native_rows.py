"""The small row-wise kernels of a bf16 step (engine/native/rows.c): what they compute against
torch's operators, that a row's bits are its own, and that the engine's drafts and verify
give what the torch path gives through them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, native
from engine.model.layers import RMSNorm, apply_rope
from engine.native import rows
from training.synthetic import write_checkpoint

pytestmark = pytest.mark.skipif(native.status() != "vnni",
                                reason=f"the kernels do not run here: {native.status()}")


def _torch_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.upcast:
        return (xf * (norm.weight.float() + float(norm.offset))).to(x.dtype)
    return norm.weight * xf.to(x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place."""
    ia, ib = (t.view(torch.int16).int() for t in (a, b))
    return int((ia - ib).abs().max())


@pytest.mark.parametrize(("dim", "offset", "upcast"),
                         [(1536, False, False), (64, True, True), (100, False, True),
                          (24, False, False)])
def test_the_norm_and_the_residual_add_are_torchs_within_a_bit_and_each_row_its_own(
        dim: int, offset: bool, upcast: bool) -> None:
    gen = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6, offset=offset, upcast=upcast).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=gen))
    x = (torch.randn(3, 5, dim, generator=gen) * 3).bfloat16()
    res = torch.randn(3, 5, dim, generator=gen).bfloat16()
    with torch.inference_mode():
        got = norm(x)
        h, after = norm.residual(x, res)
        alone = torch.stack([torch.stack([norm(x[b, s:s + 1])[0] for s in range(5)])
                             for b in range(3)])
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert _ulps(got, _torch_norm(x, norm)) <= 1
    assert torch.equal(h, x + res)  # the add rounds as torch's
    assert _ulps(after, _torch_norm(h, norm)) <= 1
    assert torch.equal(alone, got)
    with torch.inference_mode():  # rows not dim apart, a residual broadcast: the views' path
        assert torch.equal(norm(x.transpose(0, 1)), got.transpose(0, 1))
        wide = norm.residual(x, res[:, :1])
        assert all(torch.equal(a, b) for a, b in
                   zip(wide, norm.residual(x, res[:, :1].expand_as(x).contiguous()), strict=True))
    with torch.enable_grad():  # training: torch's operators, exactly
        assert torch.equal(norm(x), _torch_norm(x, norm))


def test_the_swiglu_gate_is_torchs_within_a_bit_and_each_row_its_own() -> None:
    gu = (torch.randn(4, 2 * 200, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    gate, up = gu.chunk(2, dim=-1)
    with torch.inference_mode():
        got = rows.silu_mul(gu)
        alone = torch.cat([rows.silu_mul(gu[i:i + 1]) for i in range(4)])
    assert _ulps(got, F.silu(gate) * up) <= 1
    assert torch.equal(got, alone)
    padded = torch.cat([gu, gu[:, :8]], dim=-1)[:, :400]  # rows 408 apart
    with torch.inference_mode():
        assert torch.equal(rows.silu_mul(padded), got)


@pytest.mark.parametrize(("bsz", "seqlen", "heads", "dim"), [(1, 1, 8, 256), (2, 3, 4, 24)])
def test_the_output_gate_is_torchs_within_a_bit_and_each_row_its_own(
        bsz: int, seqlen: int, heads: int, dim: int) -> None:
    """y * sigmoid(gate) with the gate a view of QKV's rows (each head's query, then its
    gate's logits: Qwen3.5), as attention.py calls it."""
    gen = torch.Generator().manual_seed(dim)
    qkv = (torch.randn(bsz, seqlen, heads * 2 * dim + 32, generator=gen) * 4).bfloat16()
    gate = qkv[..., :heads * 2 * dim].view(bsz, seqlen, heads, 2 * dim)[..., dim:]
    y = torch.randn(bsz, seqlen, heads * dim, generator=gen).bfloat16()

    def row(b: int, s: int) -> torch.Tensor:  # row (b, s) alone
        out = rows.sigmoid_mul(y[b:b + 1, s:s + 1], gate[b:b + 1, s:s + 1])
        assert out is not None
        return out[0, 0]

    with torch.inference_mode():
        got = rows.sigmoid_mul(y, gate)
        alone = torch.stack([torch.stack([row(b, s) for s in range(seqlen)])
                             for b in range(bsz)])
    assert got is not None
    assert _ulps(got, y * torch.sigmoid(gate.reshape(bsz, seqlen, heads * dim))) <= 1
    assert torch.equal(got, alone)


@pytest.mark.parametrize(("bsz", "seqlen", "heads", "dim", "rot"),
                         [(1, 4, 12, 128, 128), (2, 3, 4, 16, 4), (1, 1, 8, 256, 64),
                          (3, 7, 2, 40, 40)])
@pytest.mark.parametrize("per_row", [True, False], ids=["per-row-tables", "shared-tables"])
def test_rotary_embeddings_give_torchs_bits(bsz: int, seqlen: int, heads: int, dim: int,
                                            rot: int, per_row: bool) -> None:
    """Strided views as the fused QKV projection's split gives them, partial rotary, and
    tables per row (a cached forward's) or shared by the batch (a whole sequence's)."""
    gen = torch.Generator().manual_seed(rot)
    fused = torch.randn(bsz, seqlen, 2 * heads * dim, generator=gen).bfloat16()
    x = fused[..., :heads * dim].view(bsz, seqlen, heads, dim)
    shape = (bsz, seqlen, 1, rot) if per_row else (seqlen, 1, rot)
    cos, sin = (torch.randn(shape, generator=gen).bfloat16() for _ in range(2))
    with torch.enable_grad():
        want = apply_rope(x, cos, sin)  # torch's operators
    with torch.inference_mode():
        got = apply_rope(x, cos, sin)
        assert rows.rope(x, cos, sin) is not None
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [151936, 1000, 17])
def test_argmax_and_log_sum_exp_of_logits(dtype: torch.dtype, vocab: int) -> None:
    logits = (torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)) * 5)
    # ties, in one vector lane and in another: the first index, as torch's argmax
    logits[1, 0] = logits[1, 16] = logits[1, vocab - 1] = 100.0
    logits[3] = float("-inf")
    logits[3, vocab // 2] = 1.0
    # a later index of the maximum in the first of the kernel's four vectors, an earlier one
    # in the second: still the first index
    logits[4, min(70, vocab - 1)] = logits[4, 4 if vocab < 64 else 20] = 100.0
    logits = logits.to(dtype)
    index, lse = rows.argmax_lse(logits)
    assert torch.equal(index, logits.float().argmax(-1)) and index[1] == 0
    assert index[4] == (4 if vocab < 64 else 20)
    assert torch.allclose(lse, logits.float().logsumexp(-1), rtol=1e-6, atol=1e-6)
    same, top, same_lse = rows.argmax_max_lse(logits[None])  # with the maximum itself
    assert torch.equal(same[0], index) and torch.equal(same_lse[0], lse)
    assert torch.equal(top[0], logits.float().amax(-1)) and top.shape == (1, 5)
    logits[2, 7] = logits[2, 9] = float("nan")  # torch's argmax: the first NaN
    index, lse = rows.argmax_lse(logits)
    assert index[2] == 7 and torch.isnan(lse[2])
    assert torch.isnan(rows.argmax_max_lse(logits)[1][2])


@pytest.mark.parametrize("draft_vocab", [64, 0], ids=["reduced-vocabulary", "whole"])
def test_a_greedy_draft_in_one_pass_is_the_argmax_and_softmax_of_its_logits(
        tmp_path: Path, draft_vocab: int) -> None:
    write_checkpoint(tmp_path, "tiny-qwen3", seed=6)
    engine = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=64, k_max=2, slots=1,
                         draft_vocab=draft_vocab)
    model = engine.model
    assert (model.draft_head is not None) == bool(draft_vocab)
    out = torch.randn(3, 1, model.cfg.hidden_size,
                      generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        got = model.mtp_greedy(0, out)
        logits = model.mtp_logits(0, out).float()
    assert got is not None
    tok, prob = got
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(prob, torch.softmax(logits, -1).amax(-1), rtol=1e-5, atol=1e-6)
