"""Drafts from the context (engine/decode/context.py) beside the MTP modules' (decode/
sources.py): the index, the choice between sources, and the contract that output is plain
decoding's whatever drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from engine.decode.context import BUCKETS, ContextIndex, bucket_of
from engine.decode.policy import KPolicy, TextKind
from engine.decode.sources import Proposal, propose
from tests.conftest import load_exact, require_exact
from training.synthetic import write_checkpoint

# Code whose continuation repeats what came before: the second of two similar methods.
EDIT = '''class Point:
    def __init__(self, x: float, y: float) -> None:
        self.x = x
        self.y = y

    def scaled(self, factor: float) -> "Point":
        return Point(self.x * factor, self.y * factor)

    def shifted(self, dx: float, dy: float) -> "Point":
        return Point(self.x + dx, self.y + dy)


class Vector:
    def __init__(self, x: float, y: float) -> None:
'''


def test_the_index_continues_the_latest_longest_match() -> None:
    seq = [1, 2, 3, 9, 5, 2, 3, 7, 1, 2, 3]
    found = ContextIndex().draft(seq, 4)
    assert found is not None
    # "1 2 3" occurred at 0 (followed by 9); "2 3" later at 5 (followed by 7): the longest wins
    assert found.tokens == [9, 5, 2, 3] and found.start == 3
    assert BUCKETS[found.bucket] == 3
    assert ContextIndex().draft([1, 2, 3, 4], 4) is None  # nothing of the end occurred before
    assert ContextIndex().draft(seq, 0) is None
    latest = ContextIndex().draft([5, 1, 5, 2, 5], 2)
    assert latest is not None and latest.tokens == [2, 5]  # the latest occurrence of "5"
    index = ContextIndex()  # drafts not yet kept are matched, never indexed
    ahead = index.draft([1, 2, 3, 4, 5, 9], 3, tail=[1, 2])
    assert ahead is not None and ahead.tokens == [3, 4, 5] and BUCKETS[ahead.bucket] == 2
    assert index.draft([1, 2, 3, 4, 5, 9], 3) is None


def test_the_index_catches_up_as_tokens_arrive() -> None:
    """Indexed a token at a time, it answers as one built over the whole sequence."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 6, (300,), generator=g).tolist()
    growing = ContextIndex()
    for n in range(1, len(seq) + 1):
        got = growing.draft(seq[:n], 5)
        fresh = ContextIndex().draft(seq[:n], 5)
        assert got == fresh
    assert bucket_of(1) == 0 and bucket_of(40) == len(BUCKETS) - 1


def test_an_index_moves_to_the_next_sequence_in_its_slot() -> None:
    """The next keystroke's prompt keeps the common prefix indexed; what the old tokens left
    is found and dropped, never drafted."""
    index = ContextIndex()
    first = [4, 5, 6, 1, 4, 5]
    found = index.draft(first, 3)
    assert found is not None and found.tokens == [6, 1, 4]
    assert index.draft([7, 7, 7, 7, 4, 5], 3) is None  # "4 5" at 0 was the old sequence's
    typed = [4, 5, 6, 1, 4, 5, 6, 1, 2, 4, 5]
    found = index.draft(typed, 3)  # the next one shares a prefix: the latest "4 5" wins
    assert found is not None and found.tokens == [6, 1, 2] and found.start == 6


def test_the_source_expected_to_yield_more_drafts() -> None:
    policy = KPolicy(4, [1.0, 1.01, 1.02, 1.03, 1.04])  # verifying costs little more
    seq = [7, 8, 9, 1, 2, 3, 4, 5, 7, 8, 9]  # "7 8 9" occurred: drafts 1 2 3 4
    index = ContextIndex()
    sure = Proposal([6, 6, 6, 6], [0.99] * 4)
    doubtful = Proposal([6, 6, 6, 6], [0.05] * 4)
    got = propose(policy, TextKind.CODE, seq, index, doubtful, 4, None, 1)
    assert got.bucket is not None and got.tokens == [1, 2, 3, 4]
    for _ in range(40):  # the modules' confident drafts are always kept
        policy.observe(TextKind.CODE, 4, 4, None, [0.99] * 4)
    assert propose(policy, TextKind.CODE, seq, index, sure, 4, None, 1) is sure
    assert propose(policy, TextKind.CODE, seq, None, doubtful, 4, None, 1) is doubtful
    # A fixed K takes the modules' drafts where they made any, else the context's.
    assert propose(policy, TextKind.CODE, seq, index, doubtful, 4, 2, 1) is doubtful
    assert propose(policy, TextKind.CODE, seq, index, Proposal([], []), 4, 2, 1).tokens == [1, 2]


def test_a_bucket_whose_drafts_fail_stops_drafting_but_is_probed() -> None:
    policy = KPolicy(4, [1.0, 1.5, 2.0, 2.5, 3.0])  # a draft costs half a step to verify
    seq = [1, 2, 3, 1, 2]  # a match of two tokens
    bucket = bucket_of(2)
    for _ in range(30):
        policy.context.observe(TextKind.CODE, bucket, 1, 0)
    lengths = [len(propose(policy, TextKind.CODE, seq, ContextIndex(), Proposal([], []), 4,
                           None, 1).tokens) for _ in range(64)]
    assert 0 < sum(1 for n in lengths if n) <= 8  # mostly none, now and then a probe


@pytest.fixture(scope="module")
def fp32_engine(trained_dir: Path) -> Engine:
    return load_exact(trained_dir, max_seq_len=512, k_max=8, slots=3)


@pytest.fixture(scope="module")
def bf16_engine(model_dir: Path) -> Engine:
    return require_exact(Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=1024, slots=3))


def _prompts(engine: Engine, chain: bool) -> list[list[int]]:
    """Prompts whose continuation partly repeats them: a text, what the model writes after
    it, and the text again (then code to write after code like it, for the bundled model)."""
    if chain:  # the trained checkpoint's chain tokens
        seeds = [[300, 301, 302], [340, 341], [310]]
    else:
        seeds = [engine.tokenizer.encode(t) for t in (EDIT, EDIT[:200], EDIT[:150])]
    out = []
    for seed in seeds:
        first = engine.generate(seed, GenParams(40, speculative=False), slot="seed").tokens
        out.append([*seed, *first, *seed] if len(seed) < 10 else seed)
    return out


def _batched(engine: Engine, prompts: list[list[int]], params: list[GenParams]) -> list:
    gens = [engine.start(p, pa, slot=("batch", i))
            for i, (p, pa) in enumerate(zip(prompts, params, strict=True))]
    while live := [g for g in gens if g.finish_reason is None]:
        engine.step(live)
    return gens


@pytest.mark.slow
@pytest.mark.parametrize(("which", "chain"), [("fp32_engine", True), ("bf16_engine", False)])
def test_every_source_gives_plain_decoding(which: str, chain: bool,
                                           request: pytest.FixtureRequest) -> None:
    """Context drafts alone, the modules' alone, and both chosen live, adaptive and at fixed
    K, one slot and three sharing steps: each row's tokens are its plain decoding's."""
    engine: Engine = request.getfixturevalue(which)
    prompts = _prompts(engine, chain)
    plain = [engine.generate(p, GenParams(48, speculative=False), slot="plain").tokens
             for p in prompts]
    drafted = {"context": 0, "mtp": 0}
    for drafts in ("context", "mtp", "both"):
        for k in (None, 3):
            for p, want in zip(prompts, plain, strict=True):
                gen = engine.generate(p, GenParams(48, k=k, drafts=drafts), slot="one")
                assert gen.tokens == want, (drafts, k)
                for source, (_, _, accepted) in gen.stats.by_source.items():
                    assert source in {"context", "mtp"} and drafts in (source, "both")
                    drafted[source] += accepted
            params = [GenParams(48, k=k, drafts=drafts), GenParams(30, drafts="both"),
                      GenParams(40, k=2, drafts="context")]
            assert [g.tokens for g in _batched(engine, prompts, params)] == \
                [w[:n] for w, n in zip(plain, (48, 30, 40), strict=True)]
    assert drafted["context"] > 0 and drafted["mtp"] > 0  # both sources had drafts kept


def test_the_engine_default_source_and_a_generation_own(trained_dir: Path) -> None:
    engine = Engine.load(trained_dir, max_seq_len=512, k_max=4, drafts="context")
    prompt = [300, 301, 302, 300, 301, 302, 300]
    assert set(engine.generate(prompt, GenParams(20)).stats.by_source) <= {"context"}
    assert set(engine.generate(prompt, GenParams(20, drafts="mtp")).stats.by_source) == {"mtp"}
    with pytest.raises(ValueError, match="drafts must be one of"):
        Engine.load(trained_dir, max_seq_len=512, drafts="ngram")
    with pytest.raises(ValueError, match="drafts must be one of"):
        GenParams(drafts="all")


def test_given_drafts_never_change_the_output(fp32_engine: Engine) -> None:
    prompt = _prompts(fp32_engine, True)[0]
    want = fp32_engine.generate(prompt, GenParams(24, speculative=False)).tokens
    gen = fp32_engine.start(prompt, GenParams(24, k=0))
    next(gen)
    for i, _ in enumerate(gen):
        if gen.finish_reason is None:
            fp32_engine.give_drafts(gen, [prompt[i % len(prompt)], 5, gen.sequence[-1]])
    assert gen.tokens == want
    assert gen.stats.by_source["given"][1] > 0
    with pytest.raises(ValueError, match="between its steps"):
        fp32_engine.give_drafts(fp32_engine.start(prompt), [1])


def test_a_model_without_modules_speculates_on_text_the_context_holds(tmp_path: Path) -> None:
    """A trunk with no MTP modules drafts from the context alone: on the second copy of a
    text it has seen, most steps commit several tokens, and the output is plain decoding's."""
    write_checkpoint(tmp_path, "tiny-qwen3", train_steps=150, seed=0, num_mtp_modules=0)
    engine = load_exact(tmp_path, max_seq_len=512, k_max=6)
    assert not engine.mtp
    first = engine.generate([300, 301, 302], GenParams(60, speculative=False)).tokens
    prompt = [300, 301, 302, *first, 300, 301, 302]  # the model will write `first` again
    plain = engine.generate(prompt, GenParams(60, speculative=False))
    gen = engine.generate(prompt, GenParams(60))
    assert gen.tokens == plain.tokens
    _, _, accepted = gen.stats.by_source["context"]
    assert set(gen.stats.by_source) == {"context"} and accepted >= 30
    assert gen.stats.steps < plain.stats.steps / 2
