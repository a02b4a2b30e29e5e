"""Small checkpoints made on the spot: for tests, benchmarks and trying ahead without a model.

`write_checkpoint` writes a complete model directory (config.json, safetensors, tokenizer.json)
for a preset, with random weights or briefly trained on a low-entropy synthetic language in
which the MTP modules have something to predict, so acceptance is neither 0 nor 1.
`write_assistant` writes a Gemma 4 preset's `-assistant` drafter for such a model.
"""

from __future__ import annotations

import json
import re
import sysconfig
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import prompt as recipe
from engine.model.assistant import Assistant, AssistantConfig
from engine.model.config import ModelConfig
from engine.model.presets import ASSISTANTS, PRESETS
from engine.model.transformer import Transformer
from engine.model.weights import save_model
from engine.tokenizer import Tokenizer, save_tokenizer_dir, train_byte_level_bpe
from training.losses import lm_losses


def stdlib_texts(limit: int = 40) -> list[str]:
    """Python source that ships with the interpreter: a corpus every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:limit]
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def markov_batch(vocab: list[int], bsz: int, seqlen: int, gen: torch.Generator,
                 table: torch.Tensor, p_follow: float) -> torch.Tensor:
    """Sequences where each token is followed by its table successor with prob p_follow."""
    out = torch.empty(bsz, seqlen, dtype=torch.long)
    cur = torch.randint(len(vocab), (bsz,), generator=gen)
    for t in range(seqlen):
        out[:, t] = cur
        follow = torch.rand(bsz, generator=gen) < p_follow
        cur = torch.where(follow, table[cur], torch.randint(len(vocab), (bsz,), generator=gen))
    return torch.tensor(vocab)[out]


def train_markov(model: Transformer, vocab: list[int], *, steps: int, seed: int = 0,
                 p_follow: float = 0.85, lr: float = 3e-3) -> list[float]:
    """A few hundred optimiser steps: enough for trunk and modules to learn the chain."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(len(vocab), generator=gen)
    return fit(model, lambda: markov_batch(vocab, 16, 48, gen, table, p_follow), steps, lr)


def fit(model: Transformer, batches: Callable[[], torch.Tensor], steps: int,
        lr: float) -> list[float]:
    """`steps` AdamW steps of the trunk and MTP losses on `batches()`; the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        loss, _, _ = lm_losses(model, batches(), mtp_weight=1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


_HEADER = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+\w+\(.*\)[^\n]*:[ \t]*\n([ \t]+)(?!\"\"\")",
                     re.M)


def docstring_examples(tok: Tokenizer, doc: str, chars: int = 240) -> list[list[int]]:
    """The hook's prompts at the standard library's functions (the code around a header as
    prefix and suffix, the engine's own recipe), each followed by `doc` and the closing
    quotes: what a model that writes `doc` as every docstring would be shown and write."""
    out = []
    for text in stdlib_texts():
        for m in _HEADER.finditer(text):
            indent = m.group(1)
            prefix = text[max(0, m.end() - chars):m.end() - len(indent)] + indent + '"""'
            body = doc.replace("\n", "\n" + indent).replace(indent + "\n", "\n")
            prompt = recipe.fill_in(tok, prefix, "\n" + text[m.end():m.end() + chars // 2],
                                    budget=4096)
            out.append(prompt.ids + tok.encode_text(prompt.forced + body + '"""'))
    return out


def train_docstrings(model: Transformer, tok: Tokenizer, doc: str, *, steps: int,
                     seed: int = 0, lr: float = 3e-3) -> list[float]:
    """Teach the model to write `doc` as every function's docstring: a model whose text is
    known, for tests of what the hook does with it (engine/decode/docgate.py)."""
    gen = torch.Generator().manual_seed(seed)
    rows = docstring_examples(tok, doc)
    seqlen = min(160, min(map(len, rows)))
    data = torch.tensor([r[-seqlen:] for r in rows])
    return fit(model, lambda: data[torch.randint(len(data), (16,), generator=gen)], steps, lr)


def text_examples(tok: Tokenizer, text: str, eos: int) -> list[list[int]]:
    """The editor's prompts at every character of `text` written from an empty buffer (the
    engine's own recipe), each followed by the rest of `text` and the end token, padded with
    end tokens to one length."""
    rows = []
    for i in range(len(text)):
        prompt = recipe.fill_in(tok, text[:i], "", budget=4096)
        rows.append(prompt.ids + tok.encode_text(prompt.forced + text[i:]) + [eos])
    width = max(map(len, rows))
    return [row + [eos] * (width - len(row)) for row in rows]


def train_text(model: Transformer, tok: Tokenizer, text: str, eos: int, *, steps: int,
               seed: int = 0, lr: float = 3e-3) -> list[float]:
    """Teach the model to complete `text` from any point of it: a model whose suggestions
    are known, for tests of what a person writing `text` is offered (`ahead bench typist`)."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(text_examples(tok, text, eos))
    return fit(model, lambda: data[torch.randint(len(data), (16,), generator=gen)], steps, lr)


def write_checkpoint(path: str | Path, preset: str = "tiny-qwen3", *, seed: int = 0,
                     train_steps: int = 0, mtp_naming: str = "deepseek",
                     vocab_size: int = 512, docstring: str | None = None,
                     text: str | None = None, **overrides: object) -> ModelConfig:
    """Write a model directory; `train_steps` > 0 trains it on the synthetic chain first, or,
    given `docstring`, to write that as every function's docstring, or, given `text`, to
    complete `text` from any point of it."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    path = Path(path)
    tok = train_byte_level_bpe(stdlib_texts(), vocab_size)
    save_tokenizer_dir(tok, path)
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None  # train_byte_level_bpe adds it
    cfg = PRESETS[preset].with_(vocab_size=tok.get_vocab_size(), eos_token_ids=(eos,),
                                mtp_naming=mtp_naming, **overrides)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    if train_steps and text is not None:
        train_text(model, Tokenizer.from_dir(path), text, eos, steps=train_steps, seed=seed)
    elif train_steps and docstring is not None:
        train_docstrings(model, Tokenizer.from_dir(path), docstring, steps=train_steps,
                         seed=seed)
    elif train_steps:
        specials = set(tok.get_added_tokens_decoder())
        vocab = [i for i in range(300, cfg.vocab_size) if i not in specials][:96]
        train_markov(model, vocab, steps=train_steps, seed=seed)
    save_model(model.eval(), path)
    return cfg


def write_assistant(path: str | Path, preset: str, target: ModelConfig, *,
                    seed: int = 0) -> AssistantConfig:
    """Write the preset's Gemma 4 assistant (ASSISTANTS) for `target`, as transformers lays
    it out, with random weights: N(0, 0.02) matrices, the clustered head's token ordering a
    random permutation. Its drafts are then rarely kept: it shows that drafting with it is
    lossless, not a speed-up."""
    if preset not in ASSISTANTS:
        raise ValueError(f"preset {preset!r} has no assistant; those that do: "
                         f"{', '.join(ASSISTANTS)}")
    base = ASSISTANTS[preset]
    cfg = replace(base, text=base.text.with_(vocab_size=target.vocab_size,
                                             eos_token_ids=target.eos_token_ids))
    gen = torch.Generator().manual_seed(seed + 1)  # not the target's draws
    assistant = Assistant(cfg, target)
    with torch.no_grad():
        for p in assistant.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        if assistant.masked_embedding is not None:
            order = torch.randperm(cfg.text.vocab_size, generator=gen)
            assistant.masked_embedding.token_ordering.copy_(order)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    tensors = {n: t.detach().contiguous() for n, t in assistant.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return cfg
