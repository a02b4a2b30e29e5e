"""Whether a docstring the model wrote reads as documentation of its function: the gate of
every path that writes documentation (the pre-commit hook), beside quality.py's rules for
any text. A hook that writes into people's files may write nothing; it must never write
text that is not a docstring for that function. The rules, each a reason when it fails:

- prose, not code: no line parses as a statement, a definition, a decorator, an assignment
  or a call, outside a doctest (`>>>`) or a literal block (after `::`);
- words are English (engine/decode/words.txt: the standard library's own prose, see
  training/wordlist.py) or names the module, the function or its signature use;
- a section of parameters names only the function's real parameters, and has some;
- a doctest calls the function and imports only what the module imports;
- Sphinx references use roles Sphinx knows and name what the module names;
- no comment lines, no links (the model cannot know where they lead), no empty sections;
- the summary (the first paragraph) is a sentence of a few words that says no word of four
  letters or more twice, and nothing repeats itself (a run of three words, one of four
  letters or more, said twice).
"""

from __future__ import annotations

import ast
import builtins
import functools
import re
from dataclasses import dataclass
from pathlib import Path

WORDS_FILE = Path(__file__).with_name("words.txt")
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
BUILTINS = frozenset(dir(builtins))
_DASHES = re.compile(r"^\s*(-{3,}|={3,})\s*$")
PARAM_SECTIONS = frozenset({"parameters", "params", "args", "arguments", "keyword arguments",
                            "other parameters"})
SECTIONS = PARAM_SECTIONS | {"returns", "return", "yields", "yield", "raises", "examples",
                             "example", "notes", "note", "see also", "attributes",
                             "warnings", "references"}
# Sphinx roles; references of the first kind must name something the module knows.
OBJECT_ROLES = frozenset({"class", "func", "meth", "attr", "mod", "data", "obj", "exc",
                          "const", "any"})
ROLES = OBJECT_ROLES | {"ref", "doc", "term", "pep", "rfc", "envvar", "option", "program",
                        "keyword", "kbd", "file", "samp", "code", "math", "abbr", "dfn"}
PARAM_FIELDS = frozenset({"param", "parameter", "arg", "argument", "key", "keyword", "type"})
FIELDS = PARAM_FIELDS | {"returns", "return", "rtype", "raises", "raise", "except", "exception",
                         "yields", "yield", "ytype", "var", "ivar", "cvar", "vartype", "meta"}
_ROLE = re.compile(r"(?<![\w:]):((?:py:)?[a-z]+):`([^`]+)`")
_FIELD = re.compile(r"^:[a-z]+(?:\s+[\w.\[\], |]+)?:(?=\s|$)")  # `:param x:`, `:rtype:`
_STRAY_ROLE = re.compile(r"(?:^|(?<=[\s(])):[A-Za-z][\w.+-]*:?")
# A line that starts as a statement does and has a dotted name, an identifier with an
# underscore or a bracket or `=` in it is code even where it does not parse on its own.
_KEYWORD_LINE = re.compile(r"(return|yield|raise|if|elif|else|for|while|with|try|except|"
                           r"import|from|del|assert|def|class|async|await|lambda)\b")
_LINK = re.compile(r"\b(?:https?|ftp)://\S+|\bwww\.\w\S*")
_CODE_MARK = re.compile(r"\w\.\w|\w_\w|[()=\[\]{}]")
_CODE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Return, ast.Delete,
         ast.Assign, ast.AugAssign, ast.For, ast.AsyncFor, ast.While, ast.If, ast.With,
         ast.AsyncWith, ast.Raise, ast.Try, ast.Assert, ast.Import, ast.ImportFrom, ast.Global,
         ast.Nonlocal, ast.Pass, ast.Break, ast.Continue)
_CODE_EXPR = (ast.Call, ast.Attribute, ast.Subscript, ast.Await, ast.Yield, ast.YieldFrom,
              ast.Lambda)


@dataclass(frozen=True, slots=True)
class DocContext:
    """What a docstring may name."""

    name: str  # the function's or class's own name
    params: tuple[str, ...]  # its parameters, self and cls left out (a class: its __init__'s)
    names: frozenset[str]  # every identifier the module defines, uses or imports
    imports: frozenset[str]  # the top-level names of the modules it imports


@functools.cache
def english() -> frozenset[str]:
    return frozenset(WORDS_FILE.read_text(encoding="utf-8").split())


def problem(text: str, ctx: DocContext) -> str | None:
    """Why `text` (a docstring's contents, as written between the quotes) is not a docstring
    for the function `ctx` describes, or None when it reads as one."""
    lines = _dedent(text)
    summary = " ".join(ln.strip() for ln in _first_paragraph(lines))
    if len(_TOKEN.findall(summary)) < 2 or not summary.rstrip("\"')]").endswith((".", "!", "?")):
        return "its first line is not a sentence"
    long = [w.lower() for w in _TOKEN.findall(summary) if len(w) > 3]
    if len(set(long)) < len(long):  # "Return a basic of the given basic."
        return "its first line says a word twice"
    section, literal, doctest = "", False, False
    for i, line in enumerate(lines):
        s = line.strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if not s:
            doctest = False
            continue
        if s.startswith((">>>", "...")):
            doctest = True
            if why := _doctest_line(s, ctx):
                return why
            continue
        if doctest:  # a doctest's expected output
            continue
        if literal and line[:1].isspace():
            continue
        literal = s.endswith("::")
        heading = s.rstrip(":").lower()
        if heading in SECTIONS and (_DASHES.match(nxt) or s.endswith(":") or i == 0):
            section = heading
            if heading in PARAM_SECTIONS and not ctx.params:
                return f"a {s.rstrip(':')} section, and it takes no parameters"
            after = [ln for ln in lines[i + 1:] if ln.strip() and not _DASHES.match(ln)]
            if not after or after[0].strip().rstrip(":").lower() in SECTIONS:
                return f"an empty {s.rstrip(':')} section"
            continue
        if _DASHES.match(s):
            continue
        if section in PARAM_SECTIONS and (name := _param_entry(s)) is not None:
            if name not in ctx.params:
                return f"it documents a parameter {name!r} that it does not have"
            if word := _unknown_word(s.partition(":")[2], ctx):  # its type
                return f"an unknown word: {word!r}"
            continue
        if field := _FIELD.match(s):  # a reST field: `:param n: the number`
            kind, *named = field.group(0).strip(":").split()
            if kind not in FIELDS:
                return f"an unknown field: {kind!r}"
            if kind in PARAM_FIELDS and named and named[-1] not in ctx.params:
                return f"it documents a parameter {named[-1]!r} that it does not have"
            s = s[field.end():].strip()
            if not s:
                continue
        if why := _roles(s, ctx):
            return why
        if s.startswith("#"):
            return f"a comment: {s[:60]!r}"
        if link := _LINK.search(s):  # the model cannot know that it leads anywhere
            return f"a link: {link.group(0)[:60]!r}"
        if _is_code(s):
            return f"a line of code: {s[:60]!r}"
        if word := _unknown_word(s, ctx):
            return f"an unknown word: {word!r}"
    examples = [ln for ln in lines if ln.strip().startswith(">>>")]
    if examples and not any(re.search(rf"\b{re.escape(ctx.name)}\b", ln) for ln in examples):
        return "its example does not use it"
    return _repeats(text)


def _dedent(text: str) -> list[str]:
    lines = text.expandtabs().split("\n")
    rest = [ln for ln in lines[1:] if ln.strip()]
    cut = min((len(ln) - len(ln.lstrip()) for ln in rest), default=0)
    return [lines[0].strip(), *(ln[cut:].rstrip() for ln in lines[1:])]


def _first_paragraph(lines: list[str]) -> list[str]:
    end = next((i for i, ln in enumerate(lines) if not ln.strip()), len(lines))
    return lines[:end]


def _param_entry(s: str) -> str | None:
    """The parameter a numpydoc (`name : type`) or Google (`name (type): text`) entry names."""
    m = re.match(r"^\*{0,2}([A-Za-z_]\w*)\s*(?::|\(.*?\)\s*:|$)", s)
    return m.group(1) if m and (":" in s or s.lstrip("*").isidentifier()) else None


def _is_code(s: str) -> bool:
    if _KEYWORD_LINE.match(s) and _CODE_MARK.search(s):  # `return self.write(key` unclosed
        return True
    if s.startswith("@"):
        return _parses(s + "\ndef _(): pass") is not None
    for src in (s, s + "\n    pass"):
        node = _parses(src)
        if node is not None:
            return isinstance(node, _CODE) or (isinstance(node, ast.Expr)
                                                and isinstance(node.value, _CODE_EXPR))
    return False


def _parses(src: str) -> ast.stmt | None:
    try:
        body = ast.parse(src).body
    except (SyntaxError, ValueError):
        return None
    return body[0] if body else None


def _unknown_word(s: str, ctx: DocContext) -> str | None:
    """A word that is neither English nor a name the module, the signature or Python's
    builtins give (a name's parts count as words: `read_all`, not `NetworkX`)."""
    known = english()
    for token in _TOKEN.findall(s):
        if token in ctx.names or token in ctx.params or token == ctx.name or token in BUILTINS:
            continue
        parts = [p.lower() for p in token.split("_") if p]
        if not parts or not all(p in known or p.removesuffix("s") in known for p in parts):
            return token
    return None


def _roles(s: str, ctx: DocContext) -> str | None:
    """Sphinx cross-references name what the module names (`:class:`Server``), with a role
    Sphinx knows; a role marker with no reference after it (`a :wrong-chunks.`) is junk."""
    for m in _ROLE.finditer(s):
        role, target = m.group(1).removeprefix("py:"), m.group(2)
        if role not in ROLES:
            return f"an unknown role: {m.group(1)!r}"
        name = target.lstrip("~!").removesuffix("()").split(".")[-1]
        if role in OBJECT_ROLES and not (name in ctx.names or name in ctx.params or
                                         name == ctx.name or name in BUILTINS
                                         or name in ctx.imports):
            return f"a reference to {target!r}, which the module does not name"
    if stray := _STRAY_ROLE.search(_ROLE.sub("", s)):
        return f"a role marker with no reference: {stray.group(0).strip()!r}"
    return None


def _doctest_line(s: str, ctx: DocContext) -> str | None:
    code = s[3:].strip()
    if s.startswith(">>>") and not code:
        return "an empty example"
    for m in re.finditer(r"\b(?:from|import)\s+([A-Za-z_][\w.]*)", code):
        top = m.group(1).split(".")[0]
        if top not in ctx.imports and top not in ctx.names:
            return f"its example imports {m.group(1)}, which the module does not"
    return None


def _repeats(text: str) -> str | None:
    """A run of three words said twice, one of them of four letters or more ("a basic
    object ... a basic object"; "of the" and "it is a" may come back)."""
    words = [w.lower() for w in _TOKEN.findall(text)]
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - 2):
        gram = tuple(words[i:i + 3])
        if gram in seen and max(map(len, gram)) >= 4:
            return f"it repeats itself ({' '.join(gram)!r})"
        seen.add(gram)
    return None
