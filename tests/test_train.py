"""Training: the loss falls, checkpoints resume and load back; heads-only training works."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine import Engine, GenParams
from engine.model.weights import HEADS_FILE, CheckpointError, load_model
from tests.conftest import CHAIN_VOCAB
from training.corpus import collect, is_heldout, source_roots
from training.heads import heads_for, save_heads, with_new_heads
from training.synthetic import markov_batch, write_checkpoint
from training.train import Batches, TrainConfig, prepare_data, train


def micro(out: Path, steps: int) -> TrainConfig:
    return TrainConfig(out=str(out), preset="tiny-qwen3", steps=steps, batch_size=4, seq_len=64,
                       lr=3e-3, warmup=5, vocab_size=600, corpus_chars=400_000,
                       tokenizer_chars=200_000, save_every=10, eval_batches=2)


def test_micro_training_lowers_the_loss_resumes_and_loads_back(tmp_path: Path) -> None:
    logs: list[str] = []
    train(micro(tmp_path, 10), logs.append)
    first = json.loads((tmp_path / "model" / "training.json").read_text())["history"]
    # Resuming continues from the checkpoint instead of starting over.
    train(micro(tmp_path, 40), logs.append)
    assert any("resuming from step 10" in line for line in logs)
    history = json.loads((tmp_path / "model" / "training.json").read_text())["history"]
    assert [h["step"] for h in history] == [10, 20, 30, 40]
    assert history[-1]["heldout_loss"] < first[0]["heldout_loss"] - 0.2
    assert history[-1]["heldout_loss"] < np.log(600) - 0.8  # well below a uniform guess
    model = load_model(tmp_path / "model")
    assert model.num_mtp == 2  # as in the tiny-qwen3 preset
    manifest = (tmp_path / "model" / "corpus-manifest.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in manifest]
    assert {r["split"] for r in rows} == {"train", "heldout"}
    assert all((r["split"] == "heldout") == is_heldout(r["sha256"]) for r in rows)
    engine = Engine.load(tmp_path / "model", max_seq_len=256)
    assert engine.tokenizer.fim_order == "spm"  # trained on both orders, prompts use SPM
    fim = engine.tokenizer.fim_prompt("def add(a, b):\n    return ", "\n")
    assert engine.generate(fim, GenParams(max_new_tokens=5)).tokens


@pytest.mark.parametrize("spm_rate", [0.0, 1.0])
def test_fim_samples_have_the_fim_layout(tmp_path: Path, spm_rate: float) -> None:
    cfg = micro(tmp_path, 1)
    tok = prepare_data(cfg, lambda _: None)
    tokens = np.load(tmp_path / "data" / "train.npy")
    fim = tok.fim
    assert fim is not None
    batches = Batches(tokens, tok, replace(cfg, fim_rate=1.0, spm_rate=spm_rate, batch_size=32),
                      np.random.default_rng(0))
    rows = batches()
    assert rows.shape == (32, cfg.seq_len)
    stream = tokens.astype("<u2").tobytes()
    for row in rows.tolist():
        assert row[0] == fim.prefix and row[-1] == tok.token_to_id("<|endoftext|>")
        s, m = row.index(fim.suffix), row.index(fim.middle)
        assert s < m
        if spm_rate:  # <pre> <suf> S <mid> P M <eot>: P M S is the window
            assert s == 1
            window = row[m + 1:-1] + row[s + 1:m]
        else:  # <pre> P <suf> S <mid> M <eot>: P M S is the window
            window = row[1:s] + row[m + 1:-1] + row[s + 1:m]
        assert len(window) == cfg.seq_len - 4
        at = stream.find(np.asarray(window, dtype="<u2").tobytes())
        assert at >= 0 and at % 2 == 0  # a contiguous stretch of the token stream


def test_corpus_is_deduplicated_and_split_by_content() -> None:
    files, texts = collect(source_roots()[:1], max_chars=2_000_000)
    assert len({f.sha256 for f in files}) == len(files) == len(texts)
    assert sum(f.chars for f in files) <= 2_000_000
    share = sum(f.split == "heldout" for f in files) / len(files)
    assert 0.03 < share < 0.2
    assert not any("ahead" in Path(f.path).parts for f in files)


def test_heads_only_training_makes_drafts_accepted(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "tiny-qwen3", num_mtp_modules=0, train_steps=150)
    gen = torch.Generator().manual_seed(7)
    vocab = list(CHAIN_VOCAB)
    table = torch.randperm(len(vocab), generator=torch.Generator().manual_seed(0))
    prompts = [markov_batch(vocab, 1, 12, gen, table, 0.85)[0].tolist() for _ in range(6)]

    def acceptance() -> float:
        engine = Engine.load(tmp_path, max_seq_len=256)
        steps = accepted = 0
        for p in prompts:
            s = engine.generate(p, GenParams(max_new_tokens=32, k=4)).stats
            steps, accepted = steps + s.steps, accepted + s.accepted
        return accepted / steps

    # Untrained heads (the trunk's last layer copied, random projection) draft poorly.
    save_heads(with_new_heads(load_model(tmp_path)), tmp_path)
    before = acceptance()
    path = heads_for(tmp_path, lambda: markov_batch(vocab, 8, 48, gen, table, 0.85), steps=120,
                     lr=3e-3, log=lambda _: None)
    assert path == tmp_path / HEADS_FILE
    after = acceptance()
    assert after > before + 1.5, (before, after)
    assert load_model(tmp_path, heads=False).num_mtp == 0


def test_a_heads_file_beside_a_model_with_heads_is_refused(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "tiny-llama")  # one MTP module of its own
    save_heads(with_new_heads(load_model(tmp_path, heads=False)), tmp_path)
    with pytest.raises(CheckpointError, match="MTP modules of its own"):
        load_model(tmp_path)


def test_head_tuning_phase_runs_after_training(tmp_path: Path) -> None:
    cfg = replace(micro(tmp_path, 5), preset="tiny-llama", head_steps=15, head_lr=3e-3)
    logs: list[str] = []
    train(cfg, logs.append)
    kls = [float(line.split("distillation ")[1].split()[0]) for line in logs
           if line.startswith("head step")]
    assert len(kls) == 2 and kls[-1] < kls[0]
    history = json.loads((tmp_path / "model" / "training.json").read_text())["history"]
    assert history[-1]["head_steps"] == 15
    assert load_model(tmp_path / "model").num_mtp == 1


def test_the_trained_trunk_loads_in_transformers(tmp_path: Path) -> None:
    """The shipped layout is a Qwen3 checkpoint plus MTP tensors transformers ignores."""
    train(micro(tmp_path, 2), lambda _: None)
    ours = load_model(tmp_path / "model")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.cfg.vocab_size, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], theirs(tokens).logits, atol=1e-4, rtol=1e-4)
