"""Speculative sampling preserves the target distribution (chi-square tests, fixed seeds).

Threshold: a test fails when the chi-square p-value is below 1e-3. The seeds are fixed, so
the outcome is deterministic; the negative controls show the same test catches a biased rule.
"""

from __future__ import annotations

import itertools

import pytest
import tokenizers
import torch
from scipy.stats import chisquare
from tokenizers import models

from engine import Engine, GenParams
from engine.decode.accept import accept_sampled
from engine.decode.random import DRAFT, uniform
from engine.decode.sampling import probs_from_logits, sample
from engine.model.config import ModelConfig
from engine.model.transformer import Transformer
from engine.tokenizer import Tokenizer

P_MIN = 1e-3


def gof(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value, pooling cells expected below 5."""
    expected = probs * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().view(1)]).double()
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]).double()
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def run_rule(rule, n: int = 200_000, vocab: int = 6, k: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)  # target, per position
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)  # draft
    seed = torch.arange(n)  # every trial its own seed
    pos = torch.arange(1, k + 2).expand(n, k + 1)  # the positions the tokens are for
    drafts = sample(q.expand(n, k, vocab), seed[:, None], pos[:, :k], DRAFT)  # [n, K]
    tokens, accepted = rule(drafts, p.expand(n, k + 1, vocab), q.expand(n, k, vocab),
                            torch.full((n,), k), seed, pos)
    return p, tokens, accepted


def emitted_position_pvalues(p: torch.Tensor, tokens: torch.Tensor,
                             accepted: torch.Tensor) -> list[float]:
    """The target here ignores context, so token i of the output must follow p_i."""
    out = []
    for i in range(p.shape[0]):
        reached = accepted >= i  # token i is emitted when drafts < i were all kept
        counts = torch.bincount(tokens[reached, i], minlength=p.shape[1])
        out.append(gof(counts, p[i]))
    return out


def test_acceptance_rule_preserves_each_position() -> None:
    p, tokens, accepted = run_rule(accept_sampled)
    assert 0 < accepted.float().mean() < 3  # both acceptances and rejections happen
    assert min(emitted_position_pvalues(p, tokens, accepted)) > P_MIN


def test_negative_control_accepting_every_draft_is_caught() -> None:
    def biased(drafts, p, q, nd, seed, pos):
        tokens, n = accept_sampled(drafts, p, q, nd, seed, pos)
        return torch.cat([drafts, tokens[..., -1:]], -1), torch.full_like(n, drafts.shape[-1])
    p, tokens, accepted = run_rule(biased)
    assert min(emitted_position_pvalues(p, tokens, accepted)) < 1e-10


def test_counter_draws_are_uniform_and_differ_by_seed_position_and_purpose() -> None:
    seed, pos = torch.arange(4000), torch.arange(4000) % 7
    u = uniform(seed, pos, DRAFT)
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert gof(counts, torch.full((20,), 0.05)) > P_MIN
    assert not torch.equal(u, uniform(seed, pos + 1, DRAFT))
    assert not torch.equal(u, uniform(seed, pos, DRAFT + 1))
    assert torch.equal(u, uniform(seed, pos, DRAFT))  # a pure function of its inputs


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probs_from_logits(logits, 1.0, top_p=0.8)
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    assert probs_from_logits(logits, 1.0, top_p=0.1)[0] == 1.0


TINY = ModelConfig(family="qwen3", vocab_size=5, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=2, num_kv_heads=1, qk_norm=True, num_mtp_modules=1,
                   max_position_embeddings=64)


def exact_continuations(model: Transformer, prompt: list[int], length: int,
                        temperature: float, top_p: float) -> torch.Tensor:
    """P(continuation) for every continuation of `length` tokens, by enumeration."""
    vocab = model.cfg.vocab_size
    probs = torch.ones(vocab ** length)
    with torch.inference_mode():
        for i, cont in enumerate(itertools.product(range(vocab), repeat=length)):
            logits, _ = model(torch.tensor([prompt + list(cont[:-1])]))
            step = probs_from_logits(logits[0, len(prompt) - 1:], temperature, top_p)
            probs[i] = step[torch.arange(length), torch.tensor(cont)].prod()
    return probs


def tiny_engine(model: Transformer, slots: int) -> Engine:
    vocab = {chr(97 + i): i for i in range(model.cfg.vocab_size)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="a"))
    return Engine(model, Tokenizer(tok), max_seq_len=32, k_max=2, slots=slots)


def sample_continuations(engine: Engine, prompt: list[int], length: int, k: int,
                         temperature: float, top_p: float, n: int,
                         drafts: str = "both") -> torch.Tensor:
    """Counts of each continuation over n seeded generations, run `slots` at a time."""
    vocab = engine.model.cfg.vocab_size
    counts = torch.zeros(vocab ** length)
    for first in range(0, n, engine.max_slots):
        gens = [engine.start(prompt, GenParams(length, temperature=temperature, top_p=top_p,
                                               seed=seed, k=k, speculative=k > 0,
                                               drafts=drafts), slot=i)
                for i, seed in enumerate(range(first, min(first + engine.max_slots, n)))]
        while live := [g for g in gens if g.finish_reason is None]:
            engine.step(live)
        for g in gens:
            counts[sum(t * vocab ** (length - 1 - j) for j, t in enumerate(g.tokens))] += 1
    return counts


@pytest.mark.parametrize(("temperature", "top_p", "drafts"),
                         [(1.0, 1.0, "mtp"), (0.7, 0.9, "mtp"), (1.0, 1.0, "context")])
def test_engine_sampling_matches_exact_distribution(temperature: float, top_p: float,
                                                    drafts: str) -> None:
    """The modules' drafts are samples of q; the context's are point masses (q(d) = 1),
    accepted with probability p(d): either way the output follows the target."""
    torch.manual_seed(3)
    model = Transformer(TINY).eval()
    prompt, length = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3  # the context has drafts for each step
    exact = exact_continuations(model, prompt, length, temperature, top_p)
    engine = tiny_engine(model, slots=16)
    spec = sample_continuations(engine, prompt, length, 2, temperature, top_p, n=1500,
                                drafts=drafts)
    ar = sample_continuations(engine, prompt, length, 0, temperature, top_p, n=1500)
    assert gof(spec, exact) > P_MIN
    assert gof(ar, exact) > P_MIN
