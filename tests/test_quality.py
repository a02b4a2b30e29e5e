"""The degenerate-output rules and the confidence scores (engine/decode/quality.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from engine.decode import quality
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    """The bundled model's tokenizer: the pieces real loops are made of."""
    return Tokenizer.from_dir(model_dir)


def looped(tok: Tokenizer, text: str) -> int | None:
    """The index of the token that completes a loop in `text`'s tokens, or None."""
    watch = quality.LoopWatch(tok.piece)
    return next((i for i, t in enumerate(tok.encode(text)) if watch.push(t)), None)


@pytest.mark.parametrize("text", [
    '"""Return a list of a list of a list of a list of a list',
    "Return a broken of the croken of the croken of the croken of the",
    "x = foo(bar)\nx = foo(bar)\n",
    "    return self.value\n    pass\n    return self.value\n    x = 1\n"
    "    return self.value\n",
    "the the the the the the",
    'Return a ``(k``) = ``(k``) = ``(k``) = ``(k``) = ``(k``)',
])
def test_crafted_loops_stop(tok: Tokenizer, text: str) -> None:
    at = looped(tok, text)
    assert at is not None, text
    assert quality.loops(tok.encode(text), tok.piece)


@pytest.mark.parametrize("text", [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "table = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]\n",
    "point = (x, x, x, x)\n",
    "# ====================================================\n",
    "    }\n    }\n    }\n",
    "a = 1\nb = 2\na = 1\nc = 3\n",
    "if x:\n        return None\n    if y:\n        return None\n",
])
def test_ordinary_code_is_not_a_loop(tok: Tokenizer, text: str) -> None:
    assert looped(tok, text) is None, text


def test_a_loop_ends_the_generation_where_it_closes(trained_engine: Engine) -> None:
    """The synthetic chain's greedy output cycles: with the rule on, it stops after three
    turns of its unit, and the tokens up to there are those of the unruled output."""
    prompt = trained_engine.tokenizer.encode(" self self")
    free = trained_engine.generate(prompt, GenParams(max_new_tokens=96, stop_loops=False))
    watch = quality.LoopWatch(trained_engine.tokenizer.piece)
    cut = next((i for i, t in enumerate(free.tokens) if watch.push(t)), None)
    ruled = trained_engine.generate(prompt, GenParams(max_new_tokens=96))
    if cut is None:
        assert ruled.tokens == free.tokens and ruled.finish_reason != "repetition"
    else:
        assert ruled.tokens == free.tokens[:cut + 1]
        assert ruled.finish_reason == ruled.stats.finish_reason == "repetition"


def test_scores_equal_a_plain_log_softmax(trained_engine: Engine) -> None:
    engine = trained_engine
    for text in ("def fib(n):\n    ", " self self", "import os\n"):
        prompt = engine.tokenizer.encode(text)
        for params in (GenParams(max_new_tokens=24, stop_loops=False),
                       GenParams(max_new_tokens=24, stop_loops=False, speculative=False),
                       GenParams(max_new_tokens=24, stop_loops=False, k=3)):
            gen = engine.generate(prompt, params)
            seq = torch.tensor([prompt + gen.tokens])
            with torch.inference_mode():
                logits, _ = engine.model(seq)
            want = torch.log_softmax(logits[0].double(), -1)
            ref = [want[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen.tokens)]
            assert len(gen.logprobs) == len(gen.tokens)
            assert gen.logprobs == pytest.approx(ref, abs=2e-4)
            scores = gen.confidence
            assert scores is not None
            assert scores.mean_logprob == pytest.approx(sum(ref) / len(ref), abs=2e-4)
            assert scores.min_logprob == pytest.approx(min(ref), abs=2e-4)
            assert gen.stats.mean_logprob == scores.mean_logprob
            assert 0 < scores.score <= 1


def test_echo_of_the_text_around_the_cursor() -> None:
    prefix = "def area(w, h):\n    x = w * h\n    return "
    suffix = "x\n\n\ndef other():\n    pass\n"
    assert quality.echoes("x", prefix, suffix)  # the rest of the line, already there
    assert quality.echoes("x = w * h", "def area(w, h):\n    x = w * h\n    ", "\n")
    assert not quality.echoes("w * h", prefix, "\n")
    assert not quality.echoes("", prefix, suffix)


def test_verdict() -> None:
    sure = quality.confidence([-0.1, -0.2])
    unsure = quality.confidence([-3.0, -2.5])
    assert sure is not None and unsure is not None
    assert unsure.score == pytest.approx(math.exp(-2.75))
    assert quality.verdict("x + 1", "stop", sure, 0.5) is None
    assert quality.verdict("x + 1", "stop", unsure, 0.5) == quality.LOW_CONFIDENCE
    assert quality.verdict("x + 1", "stop", unsure, 0.0) is None  # threshold off
    assert quality.verdict("x + 1", "repetition", sure, 0.0) == quality.REPETITION
    assert quality.verdict("  \n", "stop", sure, 0.0) == quality.EMPTY
    assert quality.verdict("x + 1", "stop", None, 0.5) is None  # no scores: not judged
    assert quality.confidence([]) is None


def test_an_answer_that_loops_keeps_its_lines_before_the_loop() -> None:
    block = "def _is_real_2(x):\n    return isinstance(x, float)\n"
    looped = "    return a + b\n\n" + block * 3 + "def _is_re"
    assert quality.before_loop(looped) == "    return a + b"
    assert quality.judged(looped, quality.REPETITION, None, 0.3) == ("    return a + b", None)
    # A line repeated right after itself: the loop starts at its first copy.
    assert quality.before_loop("x = compute()\nprint(total)\nprint(total)\n") == \
        "x = compute()"
    # Caught within the first line: nothing before it, so nothing is shown.
    assert quality.judged("a list of a list of a list of", quality.REPETITION, None, 0.0) \
        == ("", quality.REPETITION)
    # The kept part is judged by the other rules too.
    low = quality.Confidence(math.log(0.1), math.log(0.01), 9)
    assert quality.judged(looped, quality.REPETITION, low, 0.3) == ("", quality.LOW_CONFIDENCE)
