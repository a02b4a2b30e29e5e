"""When to ask for several lines, and how a raw completion is cut (lsp/postprocess.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lsp.context import cursor_window
from lsp.postprocess import CursorLines, cursor_lines, postprocess, wants_multiline

FIXTURES = Path(__file__).parent / "fixtures" / "lsp"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def complete_after(text: str, anchor: str, completion: str) -> tuple[bool, str]:
    """Put the cursor just after `anchor` in `text`, as the server would, and post-process."""
    offset = text.index(anchor) + len(anchor)
    window = cursor_window(text, offset)
    around = cursor_lines(window.prefix, window.suffix)
    multiline = wants_multiline(
        around.before, around.after, around.next_line, prev_line=around.prev_line
    )
    shown = postprocess(
        completion,
        line_before_cursor=around.before,
        line_after_cursor=around.after,
        suffix=window.suffix,
        multiline=multiline,
    )
    return multiline, shown


def single(completion: str, before: str, after: str = "", suffix: str | None = None) -> str:
    suffix = after + "\n" if suffix is None else suffix
    return postprocess(
        completion,
        line_before_cursor=before,
        line_after_cursor=after,
        suffix=suffix,
        multiline=False,
    )


def multi(completion: str, before: str, suffix: str = "\n") -> str:
    after = suffix.partition("\n")[0]
    return postprocess(
        completion,
        line_before_cursor=before,
        line_after_cursor=after,
        suffix=suffix,
        multiline=True,
    )


# --- cursor_lines ------------------------------------------------------------------------


def test_cursor_lines_find_the_nearest_non_blank_neighbours() -> None:
    prefix = "def f():\r\n\r\n    "
    suffix = "\r\n  \r\n    return 1\r\n"
    assert cursor_lines(prefix, suffix) == CursorLines(
        before="    ", after="", prev_line="def f():", next_line="    return 1"
    )


def test_cursor_lines_at_the_edges_of_a_document() -> None:
    assert cursor_lines("", "") == CursorLines(before="", after="", prev_line=None, next_line=None)
    assert cursor_lines("x = 1", "") == CursorLines("x = 1", "", None, None)


# --- wants_multiline ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "next_line", "prev_line", "expected"),
    [
        # Real text to the right of the cursor: finish the line only.
        ("    x = foo(", "a, b)", None, None, False),
        ("    ", "return 1", None, "def f():", False),
        # Only closers to the right do not count as text.
        ("    x = foo(", ")", None, None, False),
        # Blank line under a block opener, empty block: the whole body.
        ("    ", "", None, "def f():", True),
        ("        ", "", "    }", "    if (a) {", True),
        ("\t", "", None, "for (;;) {", True),
        # Blank line under an ordinary statement.
        ("    ", "", None, "    x = 1", False),
        ("", "", None, None, False),
        # End of the opener's own line.
        ("def f():", "", "def g():", None, True),
        ("    if (a) {", "  ", "    }", None, True),
        ("export function f() {", "}", None, None, True),  # auto-paired brace
        ("export function f() {", "});", None, None, True),
        # A colon before closers is a dict key or a slice, not a block.
        ('    d = {"a":', "}", None, None, False),
        ("    y = x[1:", "]", None, None, False),
        # The block already has a body below: one line.
        ("    ", "", "        return x", "    def f(self):", False),
        ("def f():", "", "    return 1", None, False),
        # A comment that ends in a colon opens nothing.
        ("    # Note:", "", None, None, False),
        ("    ", "", None, "// TODO {", False),
    ],
)
def test_wants_multiline(
    before: str, after: str, next_line: str | None, prev_line: str | None, expected: bool
) -> None:
    assert wants_multiline(before, after, next_line, prev_line=prev_line) is expected


# --- (1) single line ---------------------------------------------------------------------


def test_single_line_cuts_at_the_first_newline() -> None:
    text = fixture("inventory.py").replace(
        "    return sum(item.price * item.quantity for item in items)", "    return sum("
    )
    multiline, shown = complete_after(
        text,
        "    return sum(",
        "item.price * item.quantity for item in items)\n\n\ndef restock(",
    )
    assert not multiline
    assert shown == "item.price * item.quantity for item in items)"


# --- (2) multi-line: end of the block ----------------------------------------------------


def test_python_block_stops_at_two_blank_lines() -> None:
    multiline, shown = complete_after(
        fixture("inventory.py"),
        "def restock(items: list[Item], amount: int) -> None:",
        "\n    for item in items:\n        item.quantity += amount\n\n\n"
        "def cheapest(items: list[Item]) -> Item | None:\n    if not items:",
    )
    assert multiline
    assert shown == "\n    for item in items:\n        item.quantity += amount"


def test_python_block_stops_before_a_dedented_line() -> None:
    _, shown = complete_after(
        fixture("inventory.py"),
        "def restock(items: list[Item], amount: int) -> None:",
        "\n    for item in items:\n        item.quantity += amount\n\n"
        "    return None\ndef cheapest(items",
    )
    assert shown == "\n    for item in items:\n        item.quantity += amount\n\n    return None"


def test_block_indent_counts_the_cursor_column() -> None:
    # Cursor on an indented blank line: the first generated line continues it.
    shown = multi(
        "for item in items:\n        item.quantity += amount\n    return None\nprint(items)",
        before="    ",
    )
    assert shown == "for item in items:\n        item.quantity += amount\n    return None"


def test_one_blank_line_inside_a_block_is_kept() -> None:
    assert multi("\n    a = 1\n\n    b = 2", before="def f():") == "\n    a = 1\n\n    b = 2"


def test_js_block_drops_a_closing_brace_already_below() -> None:
    multiline, shown = complete_after(
        fixture("cart.js"),
        "  add(item) {",
        "\n    this.items.push(item);\n  }\n\n  remove(item) {",
    )
    assert multiline
    assert shown == "\n    this.items.push(item);"


def test_js_block_drops_an_auto_paired_closing_brace() -> None:
    text = fixture("cart.js").replace("  add(item) {\n  }", "  add(item) {}")
    multiline, shown = complete_after(
        text, "  add(item) {", "\n    this.items.push(item);\n  }\n\n  remove(item) {"
    )
    assert multiline
    assert shown == "\n    this.items.push(item);"


def test_c_block_keeps_its_closing_brace_when_none_follows() -> None:
    text = fixture("ring.c")
    text = text[: text.rindex("}")]  # the user has not typed the closing brace yet
    body = (
        "\n    if (r->len == 0) {\n        return -1;\n    }\n"
        "    *out = r->data[r->head];\n    r->head = (r->head + 1) % r->cap;\n"
        "    r->len--;\n    return 0;\n"
    )
    multiline, shown = complete_after(
        text, "int ring_pop(struct ring *r, int *out) {", body + "}\n\nint ring_peek("
    )
    assert multiline
    assert shown == body + "}"


def test_inner_closing_brace_is_kept_when_the_suffix_closes_the_outer_block() -> None:
    assert multi("\n        x();\n    }\n}", before="    if (a) {", suffix="\n}\n") == (
        "\n        x();\n    }"
    )


def test_multi_line_with_nothing_generated() -> None:
    assert multi("\n\n\n", before="def f():") == ""


# --- (3) text the suffix already has -----------------------------------------------------


def test_completion_that_writes_the_next_line_again_is_dropped() -> None:
    text = fixture("inventory.py").replace("        return None\n", "        return None\n    \n")
    multiline, shown = complete_after(
        text, "        return None\n    ", "return min(items, key=lambda item: item.price)"
    )
    assert not multiline
    assert shown == ""


def test_multi_line_stops_where_the_suffix_lines_begin() -> None:
    suffix = "\n    if not items:\n        return None\n    return min(items)\n"
    completion = "\n    items = list(items)\n    if not items:\n        return None\n    return min"
    assert multi(completion, before="def f(items):", suffix=suffix) == "\n    items = list(items)"


def test_matching_one_line_then_diverging_is_not_a_repeat() -> None:
    suffix = "\n    if not items:\n        return None\n"
    completion = "\n    if not items:\n        raise ValueError(items)"
    assert multi(completion, before="def f(items):", suffix=suffix) == completion


def test_tail_repeating_the_suffix_start_by_eight_characters_is_removed() -> None:
    shown = multi("\n    x = 1\n    return x", before="def f():", suffix="\n    return x + 1\n")
    assert shown == "\n    x = 1"


def test_mid_line_repeat_of_the_suffix_is_removed() -> None:
    _, shown = complete_after(
        fixture("inventory.py"), "    return min(", "sorted(items, key=lambda"
    )
    assert shown == "sorted("


def test_repeat_of_the_whole_rest_of_the_line_is_removed_even_when_short() -> None:
    assert single("foo(x)", before="    y = bar(", after="x)") == "foo("


def test_short_overlap_with_the_suffix_is_kept() -> None:
    assert single("print(total", before="", after="total(items))") == "print(total"


# --- (4) closers already right of the cursor ---------------------------------------------


@pytest.mark.parametrize(
    ("before", "after", "completion", "expected"),
    [
        ("print(", ")", "len(x))", "len(x)"),
        ("print(", ")", "len(x)", "len(x)"),  # the `)` closes the completion's own call
        ('s = "', '"', 'hello"', "hello"),
        ("    if ok(", "):", "items):", "items"),
        ("    r->data[", "] = value;", "r->head]", "r->head"),
        ("    push(", ");", "a, b);", "a, b"),
        ("    if x > ", ":", "0:", "0"),
        ("f(x[", "])", "0])", "0"),
        ("f(x[", "])", "0]", "0"),
        ("print(", ")", r'"a\")")', r'"a\")"'),  # `\"` and `)` stay inside the string
    ],
)
def test_closers_right_of_the_cursor_are_not_doubled(
    before: str, after: str, completion: str, expected: str
) -> None:
    assert single(completion, before=before, after=after) == expected


# --- (5) trailing whitespace, (6) nothing to show ----------------------------------------


def test_trailing_whitespace_is_trimmed_on_every_line() -> None:
    assert multi("\n    a = 1   \n    b = 2  \t  \n", before="def f():") == "\n    a = 1\n    b = 2"
    assert single("x = 1   \t", before="") == "x = 1"


def test_leading_whitespace_is_kept() -> None:
    assert single(" 1", before="x =") == " 1"


def test_crlf_completion_comes_back_with_newlines() -> None:
    assert multi("\r\n    a = 1\r\n    b = 2\r\n", before="def f():") == "\n    a = 1\n    b = 2"


@pytest.mark.parametrize("completion", ["", "   ", "\t\n", "\n\n  \n"])
def test_blank_completions_show_nothing(completion: str) -> None:
    assert single(completion, before="x = ") == ""
    assert multi(completion, before="def f():") == ""


def test_non_ascii_completion() -> None:
    assert single("'中文 🙂 café')\nmore", before="print(", after=")") == "'中文 🙂 café'"


code_text = st.text(alphabet="ab (){}[]:;,\"'\\\n\r\t é中🙂", max_size=40)


@given(code_text, code_text, code_text, code_text, st.booleans())
def test_results_are_always_clean(
    completion: str, before: str, after: str, below: str, multiline: bool
) -> None:
    before, after = before.split("\n")[0], after.split("\n")[0].rstrip("\r")
    shown = postprocess(
        completion,
        line_before_cursor=before,
        line_after_cursor=after,
        suffix=after + "\n" + below,
        multiline=multiline,
    )
    assert shown == "" or shown.strip()
    assert all(line == line.rstrip() for line in shown.split("\n"))
    assert multiline or "\n" not in shown
