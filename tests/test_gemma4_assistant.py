"""Gemma 4's assistant drafter against transformers' `Gemma4AssistantForCausalLM` in fp32:
its drafts' logits given the same target state (dense and clustered heads, the target's
sliding window crossed), and the drafts the engine's step makes against those the reference
makes from the same sequence. Then through the engine: speculative output with the
assistant drafting equals plain decoding for every K, alone and with three slots, in fp32
and bf16 (where the exactness probe holds), with drafts both kept and rejected, and in
fixed shapes; sampled output follows the target's exact distribution; a mismatched
assistant is refused by name; and `<name>-assistant` beside the model in the HF
cache is found by itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.decode.assist import assist, assist_at
from engine.model.assistant import AssistantConfig
from engine.model.config import ConfigError
from engine.model.weights import load_assistant, load_model
from tests.conftest import load_exact
from tests.gemma4 import WINDOW, F, S, write, write_assistant, write_tokenizer
from tests.test_identity import run_batched
from training import synthetic

TOL = 2e-5
TARGET = [S, S, F, S, F]
# Per-layer inputs, keys as values (one full kv head), soft cap, two KV-shared layers: the
# assistant reads layers 1 (sliding) and 2 (full), not the last ones.
TARGET_SETTINGS = {"num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
                   "attention_k_eq_v": True, "num_global_key_value_heads": 1,
                   "final_logit_softcapping": 10.0}


def reference_drafts(target: torch.nn.Module, assistant: torch.nn.Module, seq: list[int],
                     count: int, attention_mask: bool = True) -> tuple[list[int], list]:
    """transformers' chain (generation's SinglePositionMultiTokenCandidateGenerator): the
    target over seq[:-1], then `count` drafts after seq[-1], all queried from its
    position; the drafts and their logits [1, 1, V] each."""
    prompt = torch.tensor([seq[:-1]])
    with torch.no_grad():
        out = target(input_ids=prompt, use_cache=False, output_hidden_states=True,
                     return_shared_kv_states=True)
        h, token = out.hidden_states[-1][:, -1:], torch.tensor([[seq[-1]]])
        mask = torch.ones(1, len(seq), dtype=torch.long) if attention_mask else None
        drafts, logits = [], []
        for _ in range(count):
            emb = torch.cat([target.get_input_embeddings()(token), h], dim=-1)
            step = assistant(inputs_embeds=emb, position_ids=torch.tensor([[len(seq) - 1]]),
                             shared_kv_states=out.shared_kv_states, attention_mask=mask)
            token, h = step.logits.argmax(-1), step.last_hidden_state
            drafts.append(int(token))
            logits.append(step.logits)
    return drafts, logits


def prefilled(ours: torch.nn.Module, seq: list[int], slot: int = 1) -> Caches:
    """The target's caches with seq[:-1] cached in `slot` (one pass)."""
    caches = Caches(ours, 3, 256, 8, widest=4)
    pos = torch.arange(len(seq) - 1)[None]
    with torch.no_grad():
        h = ours.trunk(torch.tensor([seq[:-1]]), caches.rope(pos),
                       CacheBatch(torch.tensor([slot]), pos, caches.length), caches.trunk)
    caches.hidden[slot, :len(seq) - 1] = h[0]
    return caches


def our_drafts(ours: torch.nn.Module, caches: Caches, seq: list[int], count: int,
               slot: int = 1) -> tuple[list[int], list]:
    """Our chain over the same: the first output from the cached h, then chained."""
    end, slots = len(seq) - 1, torch.tensor([slot])
    drafts, logits = [], []
    with torch.no_grad():
        out = assist_at(ours, caches, slot, seq, end)
        for _ in range(count):
            logits.append(ours.mtp_logits(0, out))
            token = logits[-1].argmax(-1)
            drafts.append(int(token))
            out = assist(ours, caches, slots, ours.chain_hidden(0, out), token,
                         torch.tensor([end]), caches.length)
    return drafts, logits


@pytest.mark.parametrize("head", ["dense", "clustered"])
@pytest.mark.parametrize("length", [7, 3 * WINDOW + 4])
def test_drafts_logits_match_transformers(tmp_path: Path, head: str, length: int) -> None:
    """Three chained drafts from a prompt inside the window and one well past it."""
    target = write(tmp_path / "t", TARGET, seed=1, **TARGET_SETTINGS)
    helper = write_assistant(tmp_path / "a", [S, F, S], seed=2,
                             centroids=8 if head == "clustered" else 0)
    ours = load_model(tmp_path / "t")
    ours.assistant = load_assistant(tmp_path / "a", ours.cfg)
    ours.fuse()
    seq = torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(5)).tolist()
    want_drafts, want = reference_drafts(target, helper, seq, 3)
    got_drafts, got = our_drafts(ours, prefilled(ours, seq), seq, 3)
    assert got_drafts == want_drafts
    for i, (g, w) in enumerate(zip(got, want, strict=True)):  # each draft starts from the
        torch.testing.assert_close(g, w, rtol=0, atol=TOL * 5 ** i)  # last's rounding
    if head == "clustered":  # tokens outside the chosen clusters: the floor, the same
        floor = want[0].min()
        assert (want[0] == floor).sum() == 512 - 2 * 512 // 8


def test_the_pair_new_model_writes_is_transformers_own(tmp_path: Path) -> None:
    """`ahead new-model --preset tiny-gemma4`'s model and assistant (written by us, not by
    transformers) load in transformers with every tensor named, and its drafts are ours."""
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    cfg = synthetic.write_checkpoint(tmp_path / "t", "tiny-gemma4", seed=3)
    written = synthetic.write_assistant(tmp_path / "a", "tiny-gemma4", cfg, seed=3)
    assert AssistantConfig.from_file(tmp_path / "a" / "config.json") == written
    target, info = Gemma4ForCausalLM.from_pretrained(tmp_path / "t", output_loading_info=True)
    helper, helper_info = Gemma4AssistantForCausalLM.from_pretrained(
        tmp_path / "a", output_loading_info=True)
    assert not any(info.values()) and not any(helper_info.values()), (info, helper_info)
    ours = load_model(tmp_path / "t")
    ours.assistant = load_assistant(tmp_path / "a", ours.cfg)
    seq = torch.randint(0, cfg.vocab_size, (2 * cfg.sliding_window + 5,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    want_drafts, want = reference_drafts(target.eval(), helper.eval(), seq, 3)
    got_drafts, got = our_drafts(ours, prefilled(ours, seq), seq, 3)
    assert got_drafts == want_drafts
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=TOL * 5 ** i)


# The engine

K_MAX = 4
VOCAB = 384  # tests/gemma4.py's tokenizer's


def bigram_pair(path: Path, *, mix: float = 0.05, wrong: float = 0.25,
                centroids: int = 0) -> tuple[Path, Path]:
    """A target that mostly continues token x with table[x] (its embedding dominates the
    residual stream: the sublayers' output norms scaled by `mix`; its head's row table[x]
    is x's embedding) and an assistant that predicts table'[x], table' being table with a
    `wrong` share of its successors shuffled: drafts it makes are kept where the target
    follows the table and the assistant knows it, and rejected elsewhere."""
    gen = torch.Generator().manual_seed(17)
    table = torch.randperm(VOCAB, generator=gen)
    target = write(path / "target", TARGET, seed=3, vocab=VOCAB, eos_token_id=1,
                   tie_word_embeddings=False, num_kv_shared_layers=2)
    helper = write_assistant(path / "assistant", [S, F], seed=4, vocab=VOCAB,
                             centroids=centroids, top_k=2)
    emb = target.model.embed_tokens.weight  # [V, H]
    theirs = table.clone()
    moved = torch.randperm(VOCAB, generator=gen)[:int(wrong * VOCAB)]
    theirs[moved] = table[moved[torch.randperm(len(moved), generator=gen)]]
    with torch.no_grad():
        for model in (target, helper):
            for name, p in model.named_parameters():
                if name.endswith(("post_attention_layernorm.weight",
                                  "post_feedforward_layernorm.weight")):
                    p.mul_(mix)
        target.lm_head.weight[table] = emb  # row table[x] = emb[x]
        proj = torch.randn(32, 48, generator=gen) / 48 ** 0.5
        helper.pre_projection.weight.copy_(torch.cat([proj, 0.01 * torch.randn(
            32, 48, generator=gen)], dim=1))  # [emb; h] -> the embedding's projection
        helper.model.embed_tokens.weight[theirs] = emb @ proj.T  # tied head: row table'[x]
    for model, where in ((target, "target"), (helper, "assistant")):
        model.save_pretrained(path / where)
    write_tokenizer(path / "target")
    return path / "target", path / "assistant"


def prompts(count: int) -> list[list[int]]:
    """Past the window's edge, and inside it."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (40, 9, 23)][:count]


def params(n: int, k: int | None = None, **kw: object) -> GenParams:
    return GenParams(n, k=k, ignore_eos=True, stop_loops=False, **kw)  # type: ignore[arg-type]


def test_the_steps_drafts_are_the_references(tmp_path: Path) -> None:
    """A random pair (drafts nearly all rejected: the keys the verify wrote past the
    pending token must not be seen): after every step, the drafts waiting are those
    transformers' chain makes from the same sequence, also once the target's sliding-window
    rings have wrapped (cache/ring.py)."""
    from transformers import Gemma4ForCausalLM
    from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

    write(tmp_path / "t", TARGET, seed=5, vocab=VOCAB, eos_token_id=1, **TARGET_SETTINGS)
    write_tokenizer(tmp_path / "t")
    write_assistant(tmp_path / "a", [S, F], seed=6, vocab=VOCAB)
    target = Gemma4ForCausalLM.from_pretrained(tmp_path / "t").eval()
    helper = Gemma4AssistantForCausalLM.from_pretrained(tmp_path / "a").eval()
    engine = Engine.load(tmp_path / "t", draft_model=tmp_path / "a", k_max=K_MAX, slots=2,
                         drafts="mtp", max_seq_len=256)
    ring = engine.caches.ring
    assert ring is not None and ring.size < 40 + 48
    checked = 0
    for prompt in prompts(2):
        gen = engine.start(prompt, params(48, K_MAX))
        for _ in gen:
            drafts = engine.drafts(gen.slot)
            if drafts and gen.finish_reason is None:
                assert drafts == reference_drafts(target, helper, gen.sequence,
                                                  len(drafts))[0], len(gen.sequence)
                checked += len(drafts)
        assert gen.stats.drafted > gen.stats.accepted  # rejections happened
    assert checked > 20


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    path = tmp_path_factory.mktemp("pairs")
    return {"dense": bigram_pair(path / "dense"),
            "clustered": bigram_pair(path / "clustered", centroids=8)}


@pytest.fixture(scope="module", params=[("dense", torch.float32), ("dense", torch.bfloat16),
                                        ("clustered", torch.float32)],
                ids=["dense-fp32", "dense-bf16", "clustered-fp32"])
def engine(request: pytest.FixtureRequest, pairs: dict[str, tuple[Path, Path]]) -> Engine:
    head, dtype = request.param
    target, assistant = pairs[head]
    engine = load_exact(target, draft_model=assistant, dtype=dtype, max_seq_len=256,
                        k_max=K_MAX, slots=3, drafts="mtp")
    assert engine.model.assistant is not None and engine.model.num_mtp == 0
    return engine


def plain(engine: Engine, prompt: list[int], n: int, slot: object = None) -> list[int]:
    return engine.generate(prompt, params(n, speculative=False), slot=slot).tokens


def test_speculative_equals_plain_decoding_for_every_k(engine: Engine) -> None:
    kept = rejected = 0
    for prompt in prompts(3):
        want = plain(engine, prompt, 40)
        for k in [*range(1, K_MAX + 1), None]:
            gen = engine.generate(prompt, params(40, k))
            assert gen.tokens == want, f"k={k}"
            kept += gen.stats.accepted
            rejected += gen.stats.drafted - gen.stats.accepted
    assert kept > 0 and rejected > 0  # the assistant drafted, some kept and some not
    assert engine.drafting.report()["mtp"]["accepted"] > 0


def test_three_slots_equal_each_ones_plain_decoding(engine: Engine) -> None:
    ps, lengths = prompts(3), (30, 18, 25)
    alone = [plain(engine, p, n, "alone") for p, n in zip(ps, lengths, strict=True)]
    for ks in ((1, K_MAX, None), (None, 3, 2)):
        batch = [params(n, k, speculative=k != 2) for n, k in zip(lengths, ks, strict=True)]
        assert run_batched(engine, ps, batch) == alone, ks


def test_fixed_shapes_keep_it_too(pairs: dict[str, tuple[Path, Path]]) -> None:
    """The step's fixed shape (as compiled and captured steps run it): every slot, padding
    rows in the spare one at position 0, the whole cache's keys."""
    for head in ("dense", "clustered"):
        target, assistant = pairs[head]
        engine = Engine.load(target, draft_model=assistant, max_seq_len=128, k_max=K_MAX,
                             slots=2, drafts="mtp", fixed_shapes=True)
        assert engine.static
        drafted = 0
        for prompt in prompts(2):
            want = plain(engine, prompt, 24)
            for k in (K_MAX, None):
                gen = engine.generate(prompt, params(24, k))
                assert gen.tokens == want, (head, k)
                drafted += gen.stats.drafted
        assert drafted > 0


@pytest.mark.parametrize(("change", "message"), [
    ({"backbone": 64}, r"its hidden size is 64, the target's 48"),
    ({"global_head_dim": 16}, r"its full_attention head size is 16, the target's 32"),
    ({"vocab": 512}, r"its vocabulary is 512, the target's 384"),
    ({"num_attention_heads": 3, "num_key_value_heads": 1},
     r"3 query heads do not group over the target's 2 full_attention kv heads"),
])
def test_a_mismatched_assistant_is_refused_by_name(pairs: dict[str, tuple[Path, Path]],
                                                   tmp_path: Path, change: dict,
                                                   message: str) -> None:
    target, _ = pairs["dense"]
    write_assistant(tmp_path / "a", [S, F], **{"vocab": VOCAB, **change})
    with pytest.raises(ConfigError, match=message) as e:
        Engine.load(target, draft_model=tmp_path / "a", max_seq_len=256)
    assert str(tmp_path / "a") in str(e.value)


def test_the_assistant_beside_the_model_in_the_hf_cache_is_found(
        pairs: dict[str, tuple[Path, Path]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """org/tiny-gemma finds org/tiny-gemma-assistant by itself (by name and by its snapshot
    directory); without it, or with mtp off, there is none; a name given is looked up."""
    target, assistant = pairs["dense"]
    commit = "c" * 40
    for name, source in (("tiny-gemma", target), ("tiny-gemma-assistant", assistant)):
        repo = tmp_path / "hub" / f"models--org--{name}"
        shutil.copytree(source, repo / "snapshots" / commit)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = tmp_path / "hub" / "models--org--tiny-gemma" / "snapshots" / commit
    for model in ("org/tiny-gemma", snap):
        engine = Engine.load(model, max_seq_len=128, k_max=2, slots=1, drafts="mtp")
        assert engine.model.assistant is not None and engine.mtp
        gen = engine.generate(prompts(1)[0], params(12, 2))
        assert gen.stats.drafted > 0
    assert Engine.load("org/tiny-gemma", max_seq_len=128, mtp=False).model.assistant is None
    shutil.rmtree(tmp_path / "hub" / "models--org--tiny-gemma-assistant")
    assert Engine.load("org/tiny-gemma", max_seq_len=128).model.assistant is None
    shutil.copytree(assistant, tmp_path / "hub" / "models--other--drafter" / "snapshots" /
                    commit)
    (tmp_path / "hub" / "models--other--drafter" / "refs").mkdir()
    (tmp_path / "hub" / "models--other--drafter" / "refs" / "main").write_text(commit)
    engine = Engine.load("org/tiny-gemma", draft_model="other/drafter", max_seq_len=128)
    assert engine.model.assistant is not None


def test_the_flag_and_the_config_key_reach_the_engine_and_status_shows_its_memory(
        pairs: dict[str, tuple[Path, Path]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--draft-model` (as `ahead serve` and the CLI take it), else the config key
    `draft_model` (here through AHEAD_DRAFT_MODEL); the flag is passed on to a daemon the
    command starts; `ahead status` shows the assistant's parameter memory, and the target's
    sliding-window rings'."""
    import argparse

    from clients.common import add_model_args, load_engine, serve_args
    from daemon.backends.local import LocalBackend

    target, assistant = pairs["dense"]
    monkeypatch.setenv("AHEAD_CONFIG", str(tmp_path / "none.toml"))
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    flags = ["--model", str(target), "--max-seq-len", "128", "--k-max", "2"]
    args = parser.parse_args([*flags, "--draft-model", str(assistant)])
    assert serve_args(args)[2:4] == ["--draft-model", str(assistant)]
    engine = load_engine(args)
    assert engine.model.assistant is not None
    status = LocalBackend(engine).status()
    assert status["draft_model_mib"] == round(engine.model.assistant.nbytes() / (1 << 20), 1) \
        and engine.model.assistant.nbytes() > 4 * VOCAB * 32  # its tied head, at least
    ring = engine.caches.ring
    assert ring is not None and status["ring_entries"] == ring.size
    assert status["ring_mib"] == round(engine.caches.ring_nbytes() / (1 << 20), 2) and \
        status["ring_checkpoints_per_slot"] == 4
    assert load_engine(parser.parse_args(flags)).model.assistant is None
    monkeypatch.setenv("AHEAD_DRAFT_MODEL", str(assistant))
    assert load_engine(parser.parse_args(flags)).model.assistant is not None
    assert "draft_model_mib" not in LocalBackend(
        load_engine(parser.parse_args(flags), mtp=False)).status()


@pytest.mark.parametrize("centroids", [0, 3])
def test_sampled_output_follows_the_target_with_the_assistant_drafting(
        tmp_path: Path, centroids: int) -> None:
    """Temperature 1, six tokens: the assistant's drafts are samples of its q (the clustered
    head's too, the tokens it does not score at its floor), and the continuations' counts
    over seeded generations follow the target's exact distribution."""
    from tests.test_sampling import (
        P_MIN,
        exact_continuations,
        gof,
        sample_continuations,
        tiny_engine,
    )

    write(tmp_path / "t", [S, F], seed=8, vocab=6, eos_token_id=None)  # no end
    write_assistant(tmp_path / "a", [F], seed=9, vocab=6, centroids=centroids, top_k=1)
    model = load_model(tmp_path / "t")
    model.assistant = load_assistant(tmp_path / "a", model.cfg)
    prompt, length = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3  # past the window
    exact = exact_continuations(model, prompt, length, 1.0, 1.0)
    engine = tiny_engine(model, slots=16)
    spec = sample_continuations(engine, prompt, length, 2, 1.0, 1.0, n=1500, drafts="mtp")
    assert engine.drafting.report()["mtp"]["accepted"] > 0
    assert gof(spec, exact) > P_MIN
