"""Completion prompts fit the token budget, cut at line boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.prompt import completion_prompt, continuation, fill_in
from engine.tokenizer import Tokenizer

SOURCE = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))


@pytest.fixture(scope="module")
def tok(random_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(random_dir)


def split(tok: Tokenizer, ids: list[int]) -> tuple[str, str]:
    fim = tok.fim
    assert fim is not None
    p, s, m = ids.index(fim.prefix), ids.index(fim.suffix), ids.index(fim.middle)
    return tok.decode(ids[p + 1:s]), tok.decode(ids[s + 1:m])


@pytest.mark.parametrize("budget", [64, 200, 1000])
def test_prompt_fits_and_cuts_at_lines(tok: Tokenizer, budget: int) -> None:
    cut = SOURCE.index("def f100") + len("def f100(x):\n    ret")
    prefix, suffix = SOURCE[:cut], SOURCE[cut:]
    ids = completion_prompt(tok, prefix, suffix, max_tokens=budget).ids
    assert len(ids) <= budget
    kept_prefix, kept_suffix = split(tok, ids)
    assert prefix.endswith(kept_prefix) and kept_prefix.endswith("    ret")
    assert kept_prefix == "" or prefix[: len(prefix) - len(kept_prefix)].endswith("\n")
    assert suffix.startswith(kept_suffix) and (kept_suffix == "" or kept_suffix.endswith("\n"))
    assert len(kept_prefix) > len(kept_suffix)


def test_small_inputs_are_kept_whole_with_context(tok: Tokenizer) -> None:
    ids = completion_prompt(tok, "import os\nx = ", "\nprint(x)\n", max_tokens=512,
                            extra=[("util.py", "def helper():\n    pass\n")]).ids
    assert split(tok, ids) == ("import os\nx = ", "\nprint(x)\n")
    assert "util.py\ndef helper()" in tok.decode(ids)


def test_context_chunks_that_do_not_fit_are_left_out(tok: Tokenizer) -> None:
    ids = completion_prompt(tok, "x = ", "", max_tokens=128, extra=[("big.py", SOURCE)]).ids
    assert "big.py" not in tok.decode(ids) and len(ids) <= 128


def test_one_enormous_line_is_cut_from_its_start(tok: Tokenizer) -> None:
    line = "x = [" + ", ".join(map(str, range(3000)))
    ids = completion_prompt(tok, line, "]\n", max_tokens=100).ids
    assert len(ids) <= 100
    assert line.endswith(split(tok, ids)[0])


def test_tiny_budget_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError):
        completion_prompt(tok, "x", "", max_tokens=4)


def test_the_prompt_start_stays_put_while_the_user_types(tok: Tokenizer) -> None:
    cut = SOURCE.index("def f100")

    def starts(anchor: int) -> set[str]:
        return {split(tok, completion_prompt(tok, SOURCE[:cut + n], "", max_tokens=300,
                                             anchor_lines=anchor).ids)[0][:30]
                for n in range(0, 400, 4)}

    assert len(starts(16)) * 4 <= len(starts(1))


def test_the_stable_part_ends_where_typing_moves_the_prompt(tok: Tokenizer) -> None:
    fim = tok.fim
    assert fim is not None and tok.fim_order == "psm"
    before = fill_in(tok, "import os\nx = os.pa", "\nprint(x)\n", budget=512)
    after = fill_in(tok, "import os\nx = os.path.jo", "\nprint(x)\n", budget=512)
    assert before.ids[before.stable] == fim.suffix and after.ids[after.stable] == fim.suffix
    assert before.ids[:before.stable - 1] == after.ids[:before.stable - 1]
    text = continuation(tok, "import os\nx = ")
    assert text.forced == " " and text.stable == len(text.ids)
