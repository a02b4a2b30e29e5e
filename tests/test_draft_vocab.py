"""Drafts over a reduced vocabulary (engine/decode/draft_vocab.py): the most frequent tokens of
code in the model's tokenizer plus every special and stop token, kept on disk; drafts never
leave it, the verify still scores everything, and output stays that of plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from engine import Engine, GenParams, native
from engine.decode.draft_vocab import DraftHead, ranked_ids
from engine.model.codes import Packed, encode
from engine.model.quant import quantize_model
from engine.model.weights import load_model
from engine.native import pick
from engine.native.layout import TILE, pack
from engine.tokenizer import Tokenizer
from training.synthetic import write_checkpoint

SIZE = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("draft-vocab")
    write_checkpoint(path, "tiny-qwen3", seed=6)  # random: drafts rejected, verify everywhere
    return path


def test_the_ranking_keeps_specials_and_stops_and_is_read_back(model_dir: Path,
                                                               tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    ids = ranked_ids(tok, 512, SIZE, tmp_path)
    assert ids == sorted(set(ids)) and len(ids) == SIZE
    assert {*tok.special_ids, *tok.stop_ids} <= set(ids)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(json.dumps([1, 2, 3]))  # a second call reads what is stored
    assert ranked_ids(tok, 512, SIZE, tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("quant", ["none", "int4", "int8"])
def test_the_draft_head_is_the_heads_rows(model_dir: Path, tmp_path: Path, quant: str) -> None:
    """The head's rows for the ids; under int8 where our kernels run, those rows in int4
    (the drafts' precision, quant.draft_mode): int4's error, no more."""
    model = load_model(model_dir)
    model.fuse()
    ids = ranked_ids(Tokenizer.from_dir(model_dir), 512, SIZE, tmp_path)
    head = model.draft_head = DraftHead(model, ids)
    quantize_model(model, quant)  # the draft head's rows with the rest
    x = torch.randn(2, 3, model.cfg.hidden_size)
    full, drafted = model.head(x), head(x)
    inside = torch.zeros(512, dtype=torch.bool)
    inside[ids] = True
    assert torch.isinf(drafted[..., ~inside]).all()
    if model.draft_quant == model.quant:
        assert torch.allclose(drafted[..., inside], full[..., inside], atol=1e-5)
    else:
        assert isinstance(head.rows, Packed) and head.rows.mode == model.draft_quant == "int4"
        error = (drafted[..., inside] - full[..., inside]).abs().max().item()
        assert 0 < error < 0.1 * full[..., inside].abs().max().item()


def _decode_both_ways(engine: Engine) -> tuple[list[int], list[int]]:
    """Plain decoding's tokens of a prompt, and every draft made while speculative decoding
    at K=1, 4 and adaptive gives the same tokens."""
    prompt = list(range(300, 340))
    plain = engine.generate(prompt, GenParams(30, speculative=False, stop_loops=False)).tokens
    drafted: list[int] = []
    for k in (1, 4, None):
        gen = engine.generate(prompt, GenParams(30, k=k, stop_loops=False, drafts="mtp"),
                              on_step=lambda s: drafted.extend(engine.drafts()))
        assert gen.tokens == plain, f"k={k}"
    return plain, drafted


def test_drafts_stay_in_the_subset_and_output_is_plain_decoding(model_dir: Path) -> None:
    engine = Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=256, k_max=4, slots=1,
                         draft_vocab=SIZE // 2)  # 512 > 2 x 64: reduced
    assert engine.model.draft_head is not None
    allowed = set(engine.model.draft_head.ids.tolist())
    plain, drafted = _decode_both_ways(engine)
    assert not set(plain) <= allowed  # the verify emits tokens drafts cannot
    assert drafted and set(drafted) <= allowed


needs_vnni = pytest.mark.skipif(native.status() != "vnni",
                                reason=f"the kernels do not run here: {native.status()}")
LEVELS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3])


def _int4_rows(n: int, k: int, seed: int) -> tuple[Packed, Tensor, Tensor]:
    """An int4 head of n rows in our kernels' layout, with its codes [N, K] and scales."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    codes, scales, group = encode(w, "int4")
    rows = Packed.laid_out("int4", pack("int4", codes, scales, group), None, group, n)
    q = torch.stack([codes & 15, codes >> 4], dim=-1).view(n, -1)
    return rows, q, scales


def _coded(x: Tensor, group: int) -> Tensor:
    """x's rows as wq.c codes activations (int8 a group), in float64."""
    rows = x.float().view(x.shape[0], -1, group)
    amax = rows.abs().amax(-1, keepdim=True)
    qa = torch.round(rows * torch.where(amax > 0, 127 / amax, 0))
    return (qa.double() * (amax / 127).double()).view(x.shape[0], -1)


@needs_vnni
@pytest.mark.parametrize(("n", "k"), [(1000, 256), (48, 96)])  # a partial tile; groups of 32
def test_the_coarse_pass_multiplies_the_int4_codes_in_four_levels(n: int, k: int) -> None:
    rows, q, scales = _int4_rows(n, k, seed=1)
    group = rows.native_group
    coarse = pick.coarse_layout(rows.packed, group)
    s = scales[..., 0].half()
    s2 = (5 * s.float()).half().double()  # the coarse scale, as fp16
    m = (scales[..., 1] - 8 * scales[..., 0]).half().double()  # the value of code 0
    w2 = (LEVELS[q.long()].view(n, -1, group).double() * s2[..., None] + m[..., None])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
    want = _coded(x, group) @ w2.view(n, k).T
    got = native.linear(x, coarse, None, 2, n, group).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _expected_pick(rows: Packed, coarse: Tensor, x: Tensor, tiles: int) -> tuple[Tensor, Tensor]:
    """The reference of `wq_draft_pick`: per row, the `tiles` tiles of 16 with the largest
    coarse logits, and among their int4 logits (as the int4 product stores them) the first
    largest."""
    n, group = rows.out_features, rows.native_group
    rough = native.linear(x.float(), coarse, None, 2, n, group)
    exact = rows(x)  # the int4 product, stored in x's dtype
    pad = -n % TILE
    maxima = F.pad(rough, (0, pad), value=float("-inf")).view(x.shape[0], -1, TILE).amax(-1)
    index, top = [], []
    for r in range(x.shape[0]):
        chosen = maxima[r].topk(tiles).indices
        inside = torch.zeros(n, dtype=torch.bool)
        for t in chosen.tolist():
            inside[t * TILE:(t + 1) * TILE] = True
        values = exact[r].float().masked_fill(~inside, float("-inf"))
        index.append(int(values.argmax()))
        top.append(values.max())
    return torch.tensor(index), torch.stack(top)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_greedy_draft_is_the_best_int4_logit_of_the_coarse_pass_candidates(
        dtype: torch.dtype, threads: int) -> None:
    """The coarse pass's best tiles, then their int4 logits with the int4 product's bits;
    with every tile a candidate, the int4 head's own argmax, maximum and log-sum-exp. A row's
    answers are its own in any batch and on any number of threads."""
    rows, _, _ = _int4_rows(1000, 256, seed=3)
    head = DraftHead.__new__(DraftHead)
    head.rows, head.candidates, head._coarse = rows, 8, None
    coarse = head.coarse()
    assert coarse is not None
    x = torch.randn(48, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            picked = head.greedy(x, True)
            alone = [head.greedy(x[r:r + 1], True) for r in range(48)]
            want_index, want_top = _expected_pick(rows, coarse, x, 8)
            every = pick.draft_pick(x, coarse, rows.packed, 1000, rows.native_group, 63, True)
            full = rows.top(x)
    finally:
        torch.set_num_threads(before)
    assert picked is not None and full is not None
    index, top, lse = picked
    assert torch.equal(index, want_index) and torch.equal(top, want_top)
    assert lse is not None and (lse >= top).all()
    for r, one in enumerate(alone):
        assert one is not None and one[2] is not None
        assert (one[0].item(), one[1].item(), one[2].item()) == \
            (index[r].item(), top[r].item(), lse[r].item())
    assert torch.equal(every[0], full[1]) and torch.equal(every[1], full[2])
    assert every[2] is not None and torch.allclose(every[2], full[3], atol=1e-5)


@needs_vnni
def test_greedy_drafts_through_the_coarse_pass_leave_output_plain_decoding(
        model_dir: Path) -> None:
    engine = Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=256, k_max=4, slots=1,
                         draft_vocab=SIZE // 2, quant="int4")
    head = engine.model.draft_head
    assert head is not None
    head.candidates = 1  # one tile of 16 of the 64 rows: the coarse pass pays
    assert head.coarse() is not None
    _, drafted = _decode_both_ways(engine)
    assert drafted and set(drafted) <= set(head.ids.tolist())
