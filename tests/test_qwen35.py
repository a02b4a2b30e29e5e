"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, its own MTP module) against
transformers' `qwen3_5` classes in fp32: prefill logits, token-by-token decoding through the
slots' caches and recurrent states, the multimodal wrapper's naming, tied and untied heads,
greedy output; the MTP module against a reference written from the checkpoint format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.model.config import ModelConfig
from engine.model.weights import CheckpointError, load_model
from tests.qwen35 import F, L, text_config, write

MIXES = {"3:1": [L, L, L, F], "1:1": [F, L, L, F], "linear only": [L, L]}
TOL = 2e-5


def ids(n: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mix", list(MIXES))
def test_prefill_logits_match_transformers(tmp_path: Path, mix: str, tied: bool) -> None:
    ref = write(tmp_path, MIXES[mix], tied=tied)
    ours = load_model(tmp_path)
    assert ours.cfg.family == "qwen3_5" and ours.cfg.tie_word_embeddings == tied
    assert ours.cfg.layer_types == tuple(MIXES[mix]) and ours.num_mtp == 1
    tokens = ids(150)  # past two chunks of the chunked delta rule
    with torch.no_grad():
        want = ref(tokens, use_cache=False).logits
        got, _ = ours(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("dims", [(8, 12), (16, 32)], ids=["torch", "kernels"])
@pytest.mark.parametrize("window", [1, 3])
def test_cached_decoding_matches_transformers(tmp_path: Path, window: int,
                                              dims: tuple[int, int]) -> None:
    """A chunked prefill, then windows of `window` tokens through the recurrent form (the
    verify pass), each committing its state after the last position; with head sizes our
    CPU kernels take (engine/native: gdn.c, deltanet.c), and others."""
    ref = write(tmp_path, MIXES["3:1"], dims=dims)
    ours = load_model(tmp_path)
    ours.fuse()
    caches = Caches(ours, 2, 256, 8, widest=4)
    slots, tokens, prompt = torch.tensor([1]), ids(100, 1), 70
    with torch.no_grad():
        want = ref(tokens).logits
        pos = torch.arange(prompt)[None]
        h = ours.trunk(tokens[:, :prompt], caches.rope(pos), CacheBatch(slots, pos, 256),
                       caches.trunk)
        caches.commit(slots, torch.tensor([0]))
        got = [ours.head(h)]
        for t in range(prompt, 100, window):
            w = min(window, 100 - t)
            pos = torch.arange(t, t + w)[None]
            h = ours.trunk(tokens[:, t:t + w], caches.rope(pos),
                           CacheBatch(slots, pos, 256, per_position=True), caches.trunk)
            caches.commit(slots, torch.tensor([w - 1]))
            got.append(ours.head(h))
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=0, atol=TOL)


def test_a_verify_commits_the_state_of_the_accepted_position(tmp_path: Path) -> None:
    """Verify 4 tokens, keep 2 (commit n = 1): the next token's logits are those of the
    sequence without the rejected ones."""
    ref = write(tmp_path, MIXES["3:1"])
    ours = load_model(tmp_path)
    caches = Caches(ours, 1, 128, 8, widest=4)
    slots, tokens = torch.tensor([0]), ids(40, 2)
    with torch.no_grad():
        pos = torch.arange(30)[None]
        ours.trunk(tokens[:, :30], caches.rope(pos), CacheBatch(slots, pos, 128), caches.trunk)
        caches.commit(slots, torch.tensor([0]))
        window = torch.cat([tokens[:, 30:32], ids(2, 9)], 1)  # 2 right, 2 rejected
        pos = torch.arange(30, 34)[None]
        ours.trunk(window, caches.rope(pos), CacheBatch(slots, pos, 128, per_position=True),
                   caches.trunk)
        caches.commit(slots, torch.tensor([1]))
        pos = torch.arange(32, 33)[None]
        h = ours.trunk(tokens[:, 32:33], caches.rope(pos),
                       CacheBatch(slots, pos, 128, per_position=True), caches.trunk)
        want = ref(tokens[:, :33]).logits[:, -1:]
    torch.testing.assert_close(ours.head(h), want, rtol=0, atol=TOL)


def test_the_multimodal_wrappers_text_model_loads(tmp_path: Path) -> None:
    """Weights under model.language_model., the vision tower's skipped, the head's tying
    at the top level."""
    ref = write(tmp_path, MIXES["3:1"], wrapper=True, tied=True)
    ours = load_model(tmp_path)
    assert ours.cfg.tie_word_embeddings and ours.num_mtp == 1
    tokens = ids(80, 3)
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        got, _ = ours(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_unknown_tensors_are_an_error_that_names_them(tmp_path: Path) -> None:
    write(tmp_path, MIXES["1:1"])
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.1.linear_attn.D"] = torch.zeros(4)
    tensors["mtp.layers.0.extra.weight"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.linear_attn\.D'.*"
                                              r"'mtp\.layers\.0\.extra\.weight'"):
        load_model(tmp_path)


def test_config_reads_the_hybrid_settings() -> None:
    raw = {"model_type": "qwen3_5", "tie_word_embeddings": True,
           "text_config": {**text_config([L, L, L, F]).to_dict(), "layer_types": None,
                           "full_attention_interval": 2, "tie_word_embeddings": False}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.layer_types == (L, F, L, F) and cfg.tie_word_embeddings
    assert cfg.rotary_dim == 8 and cfg.attn_output_gate and cfg.norm_offset
    assert (cfg.num_mtp_modules, cfg.mtp_naming) == (1, "mtp")
    back = ModelConfig.from_hf(cfg.to_hf())
    assert back == cfg


class ReferenceMTP(torch.nn.Module):
    """The MTP module straight from the checkpoint format, with transformers' own layer:
    x = fc([pre_fc_norm_embedding(emb(x_{t+1})); pre_fc_norm_hidden(h_t)]),
    logits = head(norm(layer(x))), at rotary positions t."""

    def __init__(self, cfg: object, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        layer_cfg = text_config([F], mtp=False)
        self.layer = Qwen3_5DecoderLayer(layer_cfg, 0)
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in tensors.items()
                                    if k.startswith("mtp.layers.0.")})
        self.rope = Qwen3_5TextRotaryEmbedding(layer_cfg)
        hidden = layer_cfg.hidden_size
        self.norms = {name: Qwen3_5RMSNorm(hidden, layer_cfg.rms_norm_eps)
                      for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        for name, norm in self.norms.items():
            norm.weight.data = tensors[f"mtp.{name}.weight"]
        self.fc = tensors["mtp.fc.weight"]

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.norms["pre_fc_norm_embedding"](emb),
                       self.norms["pre_fc_norm_hidden"](hidden)], -1) @ self.fc.T
        pos = torch.arange(x.shape[1])[None]
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        x = self.layer(x, position_embeddings=self.rope(x, pos), attention_mask=mask)
        return self.norms["norm"](x) @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_logits_match_a_reference_from_the_checkpoint_format(tmp_path: Path,
                                                                 tied: bool) -> None:
    ref = write(tmp_path, MIXES["3:1"], tied=tied)
    ours = load_model(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    mtp = ReferenceMTP(ref.config, tensors)
    tokens = ids(60, 4)
    with torch.no_grad():
        hidden = ref.model(tokens).last_hidden_state  # final-normed, as the module reads it
        emb = ref.model.embed_tokens(tokens)
        want = mtp(emb[:, 1:], hidden[:, :-1], ref.lm_head.weight)
        _, got = ours(tokens)
    torch.testing.assert_close(got[0], want, rtol=0, atol=TOL)


def test_greedy_output_equals_transformers_greedy(tmp_path: Path) -> None:
    ref = write(tmp_path, MIXES["3:1"])
    ours = load_model(tmp_path)
    prompt = ids(20, 5)
    with torch.no_grad():
        want = ref.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24,
                            eos_token_id=None, pad_token_id=0)[0, 20:].tolist()
    caches = Caches(ours, 1, 128, 8)
    slots, got = torch.tensor([0]), []
    with torch.no_grad():
        pos = torch.arange(20)[None]
        h = ours.trunk(prompt, caches.rope(pos), CacheBatch(slots, pos, 128), caches.trunk)
        caches.commit(slots, torch.tensor([0]))
        for t in range(20, 44):
            got.append(int(ours.head(h[:, -1]).argmax()))
            pos = torch.tensor([[t]])
            h = ours.trunk(torch.tensor([[got[-1]]]), caches.rope(pos),
                           CacheBatch(slots, pos, 128, per_position=True), caches.trunk)
            caches.commit(slots, torch.tensor([0]))
    assert got == want
