"""The editing workload of `ahead bench engine --workload edit` (clients/bench/edits.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients.bench.edits import _rename, edit_prompts
from engine import Engine

SOURCE = '''import os


def join_all(parts, sep="/"):
    """Join the parts with sep."""
    out = []
    for part in parts:
        out.append(part.strip(sep))  # each part without sep
    return sep.join(out)


def short():
    return 1
'''


def test_names_are_renamed_in_code_only() -> None:
    code = 'x = "x"  # x stays in comments\nreturn f(x, xs)\n'
    assert _rename(code, {"x": "y"}) == 'y = "x"  # x stays in comments\nreturn f(y, xs)\n'


def test_the_cursor_is_in_a_renamed_copy_after_the_original(tmp_path: Path,
                                                             model_dir: Path) -> None:
    f = tmp_path / "mod.py"
    f.write_text(SOURCE, encoding="utf-8")
    engine = Engine.load(model_dir, max_seq_len=1024, slots=1)
    prompts = edit_prompts(engine, [f], 4, seed=0, max_new_tokens=32)
    assert len(prompts) == 4 and {p.source for p in prompts} == {"mod.py:4+copy"}
    for p in prompts:  # only join_all has a body of 3 lines or more
        text = engine.tokenizer.decode(p.ids)
        original = SOURCE.index("def join_all")
        assert SOURCE[original:SOURCE.index("def short")].rstrip() in text
        assert "def join_all_other(parts_new, sep=" in text or \
            "def join_all_other(parts, sep_new=" in text
        assert p.line == '"""Join the parts with sep."""'
    flat = tmp_path / "flat.py"
    flat.write_text("x = 1\ny = 2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no function of"):
        edit_prompts(engine, [flat], 1, seed=0, max_new_tokens=32)
