"""Tiny Gemma 4 checkpoints written with transformers' own classes (the reference): the text
model (`Gemma4ForCausalLM`) or the multimodal wrapper with a vision tower, fp32, random
weights with the norms, layer scalars and per-layer parts off their initial values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
)

S, F = "sliding_attention", "full_attention"
WINDOW = 12  # keys a sliding layer sees: prompts in the tests run well past it


def text_config(layers: list[str], *, vocab: int = 512, **overrides: Any) -> Gemma4TextConfig:
    """Sliding layers with 16-wide heads, full layers with 32-wide (global_head_dim)."""
    settings: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=len(layers),
        layer_types=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, sliding_window=WINDOW, max_position_embeddings=1024,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=vocab, pad_token_id=0,
        eos_token_id=vocab - 1, bos_token_id=2, tie_word_embeddings=True)
    settings.update(overrides)
    return Gemma4TextConfig(**settings)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and layer scalars away from 1, so that a norm scaling by (1 + w) instead
    of w, or a scalar left out, shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "language_model" not in name and name.startswith("model.") and \
                    not name.startswith("model.layers") and "embed_tokens" not in name \
                    and not name.startswith(("model.norm", "model.per_layer")):
                continue  # the vision tower keeps its own
            if name.endswith("layer_scalar"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "norm" in name and p.dim() == 1:
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.3)


def write(path: Path, layers: list[str], *, wrapper: bool = False, seed: int = 0,
          **overrides: Any) -> torch.nn.Module:
    """Save a random model with transformers; return the HF model (eval mode, fp32)."""
    torch.manual_seed(seed)
    text = text_config(layers, **overrides)
    model: torch.nn.Module
    if wrapper:
        vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                  "patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 64}
        model = Gemma4ForConditionalGeneration(Gemma4Config(
            text_config=text.to_dict(), vision_config=vision,
            tie_word_embeddings=text.tie_word_embeddings))
    else:
        model = Gemma4ForCausalLM(text)
    _randomise(model, seed)
    model.eval().save_pretrained(path)
    return model


SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>")


def write_tokenizer(path: Path) -> None:
    """A tokenizer.json in Gemma's layout: SentencePiece-style BPE over "▁"-joined text with
    byte fallback, <bos> put before every text, Gemma's special tokens (no FIM tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in ["▁", *map(chr, range(33, 127))]:
        vocab[ch] = len(vocab)
    merges = [("▁", "▁"), ("d", "e"), ("de", "f"), ("▁", "d")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)])
    tok.save(str(path / "tokenizer.json"))


def write_assistant(path: Path, layers: list[str], *, backbone: int = 48, seed: int = 0,
                    centroids: int = 0, top_k: int = 2, **overrides: Any) -> torch.nn.Module:
    """Save a random Gemma 4 assistant (transformers' Gemma4AssistantForCausalLM) 32 wide,
    drafting for a target `backbone` wide; `centroids` > 0: the clustered head, its token
    ordering a random permutation. Return the HF model (eval mode, fp32)."""
    from transformers.models.gemma4_assistant import (
        Gemma4AssistantConfig,
        Gemma4AssistantForCausalLM,
    )

    torch.manual_seed(seed)
    text = text_config(layers, **{"hidden_size": 32, "intermediate_size": 64,
                                  "vocab_size_per_layer_input": 0, **overrides})
    cfg = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=backbone,
                                use_ordered_embeddings=centroids > 0,
                                num_centroids=max(centroids, 1), centroid_intermediate_top_k=top_k)
    model = Gemma4AssistantForCausalLM(cfg)
    _randomise(model, seed)
    if centroids:
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(text.vocab_size, generator=gen)
        model.masked_embedding.token_ordering.copy_(order)
    model.eval().save_pretrained(path)
    return model
