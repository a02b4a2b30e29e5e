"""Drafts over a reduced vocabulary (engine/decode/draft_vocab.py): the most frequent tokens of
code in the model's tokenizer plus every special and stop token, kept on disk; drafts never
leave it, the verify still scores everything, and output stays that of plain decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from engine.decode.draft_vocab import DraftHead, ranked_ids
from engine.model.codes import Packed
from engine.model.quant import quantize_model
from engine.model.weights import load_model
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


def test_drafts_stay_in_the_subset_and_output_is_plain_decoding(model_dir: Path) -> None:
    engine = Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=256, k_max=4, slots=1,
                         draft_vocab=SIZE // 2)  # 512 > 2 x 64: reduced
    assert engine.model.draft_head is not None
    allowed = set(engine.model.draft_head.ids.tolist())
    prompt = list(range(300, 340))
    plain = engine.generate(prompt, GenParams(30, speculative=False, stop_loops=False)).tokens
    assert not set(plain) <= allowed  # the verify emits tokens drafts cannot
    drafted: list[int] = []
    for k in (1, 4, None):
        gen = engine.generate(prompt, GenParams(30, k=k, stop_loops=False, drafts="mtp"),
                              on_step=lambda s: drafted.extend(engine.drafts()))
        assert gen.tokens == plain, f"k={k}"
    assert drafted and set(drafted) <= allowed
