"""The end of a block by indentation (llama-server's `n_indent`): the rule on crafted
streams split every way, a generation that stops there, and the same through the daemon's
HTTP /infill in llama.vim's shape."""

from __future__ import annotations

import itertools
from pathlib import Path

import aiohttp
import pytest

from daemon.backends.local import LocalBackend
from daemon.http import HttpEndpoint
from engine import Engine, GenParams
from engine.decode.indent import IndentFloor
from lsp.postprocess import indent_floor
from tests.test_daemon import serving

CASES = [  # text, floor, what passes, whether the block ended there
    ("x = 1\n    y = 2\nz = 3\n", 1, "x = 1\n    y = 2", True),
    ("def g():\n    pass", 4, "def g():\n    pass", False),  # the first line is not judged
    ("a\n\n    \n  b\nc", 2, "a\n\n    \n  b", True),  # blank lines are not either
    ("a\n\t\tb\n\tc", 2, "a\n\t\tb", True),  # a tab counts one
    ("a\r\n    b\r\nc\r\n", 1, "a\r\n    b", True),
    ("a\r\n    b\r", 1, "a\r\n    b\r", False),
    ("a\n    b\n", 1, "a\n    b\n", False),
    ("a\n  ", 1, "a\n  ", False),  # held back until the end, then passed on
    ("a\nb\n", 0, "a\nb\n", False),  # 0: no floor
]


@pytest.mark.parametrize("text,floor,passed,ended", CASES)
def test_the_floor_cuts_a_stream_the_same_wherever_it_is_split(
        text: str, floor: int, passed: str, ended: bool) -> None:
    for cuts in itertools.combinations(range(1, len(text)), 2):
        chunks = [text[i:j] for i, j in zip((0, *cuts), (*cuts, len(text)), strict=True)]
        rule = IndentFloor(floor)
        out = "".join(rule.push(c) for c in chunks) + rule.push("", final=True)
        assert (out, rule.ended) == (passed, ended), chunks
    with pytest.raises(ValueError, match=">= 0"):
        IndentFloor(-1)
    with pytest.raises(ValueError, match=">= 0"):
        GenParams(indent_floor=-1)


def test_the_editor_sets_the_floor_for_blocks_that_end_by_indentation() -> None:
    assert indent_floor("", "", "    def close(self):") == 5  # a blank line under the opener
    assert indent_floor("\tif x:", "", None) == 2  # at the end of the opener's line
    assert indent_floor("int f() {", "}", None) == 0  # its closing line is kept instead
    assert indent_floor("x = ", "", "def f():") == 0  # not the start of a block


PROMPTS = ["class Stack:\n    def __init__(self):\n        ", "def fibonacci(n):\n    ",
           "def main():\n    parser = argparse.ArgumentParser()\n    ",
           "import os\n\n\ndef read(path):\n    "]


def test_a_generation_stops_at_the_end_of_the_block(model_dir: Path) -> None:
    """Greedy output with a floor is the free output cut where the rule says, and the model
    stops writing there."""
    engine = Engine.load(model_dir, max_seq_len=1024)
    saved = 0
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        free = engine.generate(ids, GenParams(96, stop_loops=False))
        floor = len(prompt.rsplit("\n", 1)[-1])  # the cursor line's indentation, as
        #                                           llama.vim sends it
        rule = IndentFloor(floor)
        cut = rule.push(free.text, final=True)
        ended = engine.generate(ids, GenParams(96, stop_loops=False, indent_floor=floor))
        assert ended.text == cut
        if rule.ended:
            assert ended.finish_reason == "stop" and len(ended.tokens) < len(free.tokens)
            saved += len(free.tokens) - len(ended.tokens)
    assert saved > 0  # some prompt's block ended before the token limit


async def test_infill_takes_llama_vims_n_indent(model_dir: Path, tmp_path: Path) -> None:
    engine = Engine.load(model_dir, max_seq_len=1024)
    http = HttpEndpoint("127.0.0.1", 0, "t")
    body = {"input_prefix": "class Stack:\n    def __init__(self):\n", "prompt": "        ",
            "input_suffix": "\n", "n_predict": 96, "samplers": ["top_k", "infill"],
            "cache_prompt": True}
    async with serving(LocalBackend(engine), tmp_path / "rt", http=http), \
            aiohttp.ClientSession(headers={"Authorization": "Bearer t"}) as session:
        answers = []
        for n_indent in (0, 5):
            async with session.post(http.address + "/infill",
                                    json={**body, "n_indent": n_indent}) as resp:
                assert resp.status == 200
                answers.append(await resp.json())
    rule = IndentFloor(5)
    assert answers[1]["content"] == rule.push(answers[0]["content"], final=True)
    assert rule.ended and answers[1]["tokens_predicted"] < answers[0]["tokens_predicted"]
