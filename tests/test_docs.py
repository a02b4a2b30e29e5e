"""The README and docs/: every relative link resolves (a file, and a heading where it names
one), and every `ahead ...` command they show parses with the real command line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from clients.cli import build_parser

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^#+ (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_the_readme_is_a_front_door() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert len(PAGES) >= 8


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    for target in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: {target} does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.name}: no heading #{anchor} in {dest.name}"


def commands(page: Path) -> list[str]:
    """The `ahead ...` commands in the page's code blocks (prompts `$ ` taken off, lines
    joined at a trailing backslash, `VAR=value` prefixes, comments, pipes, chains and a
    trailing `&` taken off)."""
    out = []
    for block in _FENCE.findall(page.read_text(encoding="utf-8")):
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.strip().removeprefix("$ ")
            for part in re.split(r"&&|\|\||\||;", line):
                part = part.split(" #")[0].strip().removesuffix("&")
                words = part.split()
                while words and re.match(r"^[A-Z_]+=", words[0]):
                    words.pop(0)
                if words[:1] == ["ahead"] and len(words) > 1:
                    out.append(" ".join(words))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page: Path) -> None:
    parser = build_parser()
    for command in commands(page):
        if re.search(r"\[|\.\.\.|[A-Z]{3,}\b", command):  # a synopsis: [--flag X], FILE...
            continue
        try:
            parser.parse_args(shlex.split(command)[1:])
        except SystemExit as e:
            raise AssertionError(f"{page.name}: `{command}` does not parse") from e


def test_the_command_check_sees_the_commands() -> None:
    """The extraction finds the pages' commands (a check that sees none would pass anything)."""
    shown = [c for page in PAGES for c in commands(page)]
    assert len(shown) >= 20 and 'ahead generate "def fibonacci(n):" --stats' in shown
    assert any(c.startswith("ahead models") for c in shown)
