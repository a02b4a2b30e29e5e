"""Cursor windows and the ring of extra chunks (lsp/context.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lsp.context import ExtraContext, Window, cursor_window

FIXTURES = Path(__file__).parent / "fixtures" / "lsp"


def numbered(count: int, width: int = 9, end: str = "\n") -> str:
    """`count` lines of exactly `width` characters plus `end`: easy budget arithmetic."""
    return "".join(f"line{i:0{width - 4}d}{end}" for i in range(count))


# --- cursor_window ----------------------------------------------------------------------


def test_small_document_is_kept_whole() -> None:
    text = (FIXTURES / "inventory.py").read_text()
    offset = text.index("def total")
    assert cursor_window(text, offset) == Window(text[:offset], text[offset:])


def test_prefix_keeps_whole_lines_back_from_the_cursor() -> None:
    text = numbered(10)  # lines of 10 characters with the newline
    offset = 50 + 4  # inside line 5, after "line"
    window = cursor_window(text, offset, max_prefix_chars=30, max_suffix_chars=1000)
    # 4 characters of the cursor line, then two whole lines (24); a third would make 34.
    assert window.prefix == "line00003\nline00004\nline"
    assert window.suffix == text[offset:]


def test_suffix_keeps_whole_lines_forward_from_the_cursor() -> None:
    text = numbered(10)
    offset = 54
    window = cursor_window(text, offset, max_prefix_chars=1000, max_suffix_chars=30)
    # Rest of the cursor line (6 with its newline), then two whole lines (26); a third is 36.
    assert window.suffix == "00005\nline00006\nline00007\n"
    assert window.prefix == text[:offset]


def test_budget_exactly_fitting_a_line_takes_it() -> None:
    text = numbered(3)
    window = cursor_window(text, 20, max_prefix_chars=20, max_suffix_chars=10)
    assert window == Window(text[:20], text[20:])


def test_long_cursor_line_is_cut_keeping_the_text_nearest_the_cursor() -> None:
    text = "short\n" + "x" * 50 + "y" * 50 + "\nafter\n"
    offset = len("short\n") + 50
    window = cursor_window(text, offset, max_prefix_chars=20, max_suffix_chars=20)
    assert window.prefix == "x" * 20
    assert window.suffix == "y" * 20


def test_rest_of_cursor_line_always_included_even_when_budget_allows_nothing_more() -> None:
    text = "ab\ncd\nef\n"
    window = cursor_window(text, 4, max_prefix_chars=1, max_suffix_chars=2)
    assert window == Window("c", "d\n")


def test_zero_budgets_give_empty_window() -> None:
    assert cursor_window("abc\ndef", 5, max_prefix_chars=0, max_suffix_chars=0) == Window("", "")


def test_empty_document() -> None:
    assert cursor_window("", 0) == Window("", "")


def test_cursor_at_start_and_end() -> None:
    text = numbered(5)
    assert cursor_window(text, 0, max_suffix_chars=25) == Window("", text[:20])
    assert cursor_window(text, len(text), max_prefix_chars=25) == Window(text[-20:], "")


def test_non_ascii_offsets_are_characters_not_bytes() -> None:
    text = "café = 1\n名前 = '中文'\nface = '🙂🙂'\n"
    offset = text.index("🙂") + 1  # between the two emoji
    window = cursor_window(text, offset, max_prefix_chars=12, max_suffix_chars=100)
    # The cursor line's part before the cursor is 9 characters; the line above (10) won't fit.
    assert window.prefix == "face = '🙂"
    assert window.suffix == "🙂'\n"
    wide = cursor_window(text, offset, max_prefix_chars=20)
    assert wide.prefix == "名前 = '中文'\nface = '🙂"


def test_crlf_line_endings_are_preserved() -> None:
    text = "one\r\ntwo\r\nthree\r\nfour\r\n"
    offset = text.index("three") + 2
    window = cursor_window(text, offset, max_prefix_chars=8, max_suffix_chars=11)
    assert window.prefix == "two\r\nth"
    assert window.suffix == "ree\r\nfour\r\n"


def test_the_window_start_stays_put_while_the_user_types() -> None:
    text = "".join(f"value_{i} = {i * 7}\n" for i in range(400))
    offset = text.index("value_300")

    def starts(anchor: int) -> set[int]:
        return {o - len(cursor_window(text, o, max_prefix_chars=2000, anchor_lines=anchor).prefix)
                for o in range(offset, offset + 600)}

    assert len(starts(16)) <= 4 < 30 < len(starts(1))
    with pytest.raises(ValueError, match="anchor_lines"):
        cursor_window(text, offset, anchor_lines=0)


@pytest.mark.parametrize("offset", [-1, 4])
def test_offset_outside_document_is_refused(offset: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        cursor_window("abc", offset)


def test_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        cursor_window("abc", 1, max_prefix_chars=-1)


@st.composite
def documents(draw: st.DrawFn) -> tuple[str, int, int, int, int]:
    text = draw(st.text(alphabet="ab \n\ré中🙂", max_size=80))
    offset = draw(st.integers(0, len(text)))
    return (text, offset, draw(st.integers(0, 40)), draw(st.integers(0, 40)),
            draw(st.integers(1, 3)))


@given(documents())
def test_window_is_the_text_around_the_offset(case: tuple[str, int, int, int, int]) -> None:
    text, offset, max_prefix, max_suffix, anchor = case
    window = cursor_window(text, offset, max_prefix_chars=max_prefix, max_suffix_chars=max_suffix,
                           anchor_lines=anchor)
    prefix, suffix = window.prefix, window.suffix
    assert text[offset - len(prefix) : offset] == prefix
    assert text[offset : offset + len(suffix)] == suffix
    # Budgets always hold: a cursor line longer than its budget is cut inside.
    assert len(prefix) <= max_prefix
    assert len(suffix) <= max_suffix

    start, end = offset - len(prefix), offset + len(suffix)
    line_start = text.rfind("\n", 0, offset) + 1
    if offset - line_start > max_prefix:
        assert len(prefix) == max_prefix
    else:
        # Starts on a line boundary, and the whole line before it would not have fitted;
        # or on an anchor line, having left out at most a quarter of the lines that fit.
        assert start == 0 or text[start - 1] == "\n"
        widest = cursor_window(text, offset, max_prefix_chars=max_prefix, anchor_lines=1)
        if start > 0 and len(prefix) < len(widest.prefix):
            assert text.count("\n", 0, start) % anchor == 0
            left_out = widest.prefix.count("\n") - prefix.count("\n")
            assert left_out <= widest.prefix.count("\n") // 4
        elif start > 0:
            assert offset - (text.rfind("\n", 0, start - 1) + 1) > max_prefix
    line_end = text.find("\n", offset)
    line_end = len(text) if line_end < 0 else line_end + 1
    if line_end - offset > max_suffix:
        assert len(suffix) == max_suffix
    else:
        assert end == len(text) or text[end - 1] == "\n"
        if end < len(text):
            next_end = text.find("\n", end)
            assert (len(text) if next_end < 0 else next_end + 1) - offset > max_suffix


# --- ExtraContext ------------------------------------------------------------------------


def test_note_without_line_takes_the_start_of_the_file() -> None:
    ring = ExtraContext(chunk_lines=3)
    ring.note("a.py", numbered(10))
    assert ring.chunks() == [("a.py", numbered(3))]


@pytest.mark.parametrize(("line", "first"), [(10, 8), (19, 16), (500, 16), (0, 0), (-3, 0)])
def test_note_centres_the_chunk_on_the_line_and_clamps_at_the_ends(line: int, first: int) -> None:
    text = numbered(20)
    ring = ExtraContext(chunk_lines=4)
    ring.note("a.py", text, line=line)
    assert ring.chunks() == [("a.py", "".join(text.splitlines(keepends=True)[first : first + 4]))]


def test_chunks_are_most_recent_first_and_skip_the_current_document() -> None:
    ring = ExtraContext()
    for name in ("a.py", "b.js", "c.c"):
        ring.note(name, f"// file {name}\n")
    assert [path for path, _ in ring.chunks()] == ["c.c", "b.js", "a.py"]
    assert [path for path, _ in ring.chunks(exclude="b.js")] == ["c.c", "a.py"]


def test_noting_again_moves_a_file_to_the_front() -> None:
    ring = ExtraContext()
    ring.note("a.py", "x = 1\n")
    ring.note("b.py", "y = 2\n")
    ring.note("a.py", "x = 1\n")
    assert ring.chunks() == [("a.py", "x = 1\n"), ("b.py", "y = 2\n")]


def test_budget_takes_chunks_whole_or_not_at_all() -> None:
    ring = ExtraContext()
    ring.note("small_old.py", "s = 1\n")  # 6 characters
    ring.note("big.py", "b" * 50 + "\n")  # 51
    ring.note("new.py", "n = 22\n")  # 7
    assert ring.chunks(max_chars=20) == [("new.py", "n = 22\n"), ("small_old.py", "s = 1\n")]
    assert ring.chunks(max_chars=58) == [("new.py", "n = 22\n"), ("big.py", "b" * 50 + "\n")]
    assert ring.chunks(max_chars=0) == []


def test_identical_text_from_another_file_replaces_the_old_chunk() -> None:
    text = (FIXTURES / "ring.c").read_text()
    ring = ExtraContext()
    ring.note("ring.c", text)
    ring.note("copy/ring.c", text)
    assert ring.chunks(max_chars=10_000) == [("copy/ring.c", text)]


def test_heavily_overlapping_chunk_replaces_but_a_different_one_is_kept() -> None:
    base = numbered(40)
    edited = base.replace("line00007\n", "changed!!\n")  # 39 of 40 lines equal
    half = numbered(20) + numbered(20, end="!\n")  # 20 of 40 lines equal
    ring = ExtraContext(chunk_lines=64)
    ring.note("a.py", base)
    ring.note("b.py", edited)
    assert ring.chunks(max_chars=10_000) == [("b.py", edited)]
    ring.note("c.py", half)
    assert [path for path, _ in ring.chunks(max_chars=10_000)] == ["c.py", "b.py"]


def test_changed_file_keeps_only_its_fresh_chunk() -> None:
    js = (FIXTURES / "cart.js").read_text()
    ring = ExtraContext(chunk_lines=8)
    ring.note("cart.js", js, line=6)
    edited = js.replace("  add(item) {\n", "  add(item) {\n    this.items.push(item);\n")
    ring.note("cart.js", edited, line=7)
    assert len(ring) == 1
    assert "this.items.push(item);" in ring.chunks()[0][1]


def test_distant_parts_of_one_file_are_separate_chunks() -> None:
    text = numbered(100)
    ring = ExtraContext(chunk_lines=10)
    ring.note("big.py", text, line=5)
    ring.note("big.py", text, line=80)
    assert len(ring) == 2


def test_forget_drops_every_chunk_of_a_file() -> None:
    text = numbered(100)
    ring = ExtraContext(chunk_lines=10)
    ring.note("big.py", text, line=5)
    ring.note("other.py", "z = 0\n")
    ring.note("big.py", text, line=80)
    ring.forget("big.py")
    ring.forget("never-noted.py")
    assert ring.chunks() == [("other.py", "z = 0\n")]


def test_ring_keeps_only_the_newest_chunks() -> None:
    ring = ExtraContext(max_chunks=3)
    for i in range(5):
        ring.note(f"f{i}.py", f"value_{i} = {i}\n")
    assert [path for path, _ in ring.chunks()] == ["f4.py", "f3.py", "f2.py"]


def test_blank_files_are_not_recorded() -> None:
    ring = ExtraContext()
    ring.note("empty.py", "")
    ring.note("blank.py", "\n   \n\t\n")
    assert len(ring) == 0


def test_chunks_keep_crlf_and_non_ascii_text() -> None:
    text = "naïve = '中文'\r\nmood = '🙂'\r\nend\r\n"
    ring = ExtraContext(chunk_lines=2)
    ring.note("w.py", text, line=0)
    assert ring.chunks() == [("w.py", "naïve = '中文'\r\nmood = '🙂'\r\n")]


def test_lines_split_on_newline_only() -> None:
    # A form feed or U+2028 is not a line break to an editor; the chunk keeps them inline.
    text = "a\x0cb\u2028c\nsecond\n"
    ring = ExtraContext(chunk_lines=1)
    ring.note("odd.py", text)
    assert ring.chunks() == [("odd.py", "a\x0cb\u2028c\n")]


@pytest.mark.parametrize("kwargs", [{"max_chunks": 0}, {"chunk_lines": 0}])
def test_ring_sizes_must_be_positive(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ExtraContext(**kwargs)
