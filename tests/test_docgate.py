"""The docstring gate (engine/decode/docgate.py): each rule on crafted docstrings that pass and
that fail, the junk the issue found among them, and the context taken from a module."""

from __future__ import annotations

import ast

import pytest

from clients.docstring_edit import find_targets, module_names, split_lines
from engine.decode.docgate import DocContext, english, problem

MODULE = "import functools\n\n\n@functools.lru_cache(maxsize=None)\ndef fib(n):\n" \
         "    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
FIB = DocContext("fib", ("n",), *module_names(ast.parse(MODULE)))
NUMPY = "Return the n-th number.\n\n    Parameters\n    ----------\n    n : int\n" \
        "        Which number.\n\n    Examples\n    --------\n    >>> fib(10)\n    55\n"


@pytest.mark.parametrize("text", [
    "Return the n-th number of the sequence.",
    "Return the n-th number, cached.",
    NUMPY,
    "Compute it.\n\n    Args:\n        n: which one.\n",
    "Return it (see ``functools.lru_cache``).",
    "Return it.\n\n    A literal block::\n\n        fib(n - 1) + fib(n - 2)\n",
    'Return the "n-th" number.',
    "Return the n-th number.\n\n    Raise ValueError if n is negative.",  # a builtin name
    # reST fields and Sphinx references to what the module names
    "Return the n-th number.\n\n    :param n: which number.\n    :rtype: int\n"
    "    :raises ValueError: if n is negative.",
    "Return the n-th number, as :func:`functools.lru_cache` keeps it (see :pep:`8`).",
    "Return it.\n\n    Note: the numbers are cached.",
    "Return the n-th number,\n    if it was asked for before, from the cache.",
])
def test_documentation_passes(text: str) -> None:
    assert problem(text, FIB) is None


@pytest.mark.parametrize(("text", "why"), [
    # what the issue saw the hook write
    ("Return the number of nodes in the same.\n\n    Parameters\n    ----------\n"
     "    x : array_like\n        The number of nodes in the same.\n",
     "a parameter 'x' that it does not have"),
    ("Return the sum.\n\n    Examples\n    --------\n    >>> from sympy.polys import g\n",
     "imports sympy.polys"),
    ("Returns the number of the gh-atteristics.", "unknown word: 'atteristics'"),
    ("Return a basic of the given basic.", "says a word twice"),
    # seen on held-out standard-library code, below the default threshold
    ("Read up to be a basic object.\n\n    Parameters\n    ----------\n    n : NetworkX graph\n"
     "        The number.", "unknown word: 'NetworkX'"),
    ("Read the value.\n\n    It is a basic object, as a basic object is.", "repeats itself"),
    ("Return the value.\n\n    return self.dropout(x)", "a line of code"),
    ("Return the value.\n\n    def __init__(): return x", "a line of code"),
    ("Return the value.\n\n    if not isinstance(n, int):", "a line of code"),
    ("Return the value.\n\n    @property", "a line of code"),
    ("Return the value.\n\n    total = n + 1", "a line of code"),
    ("Return the value.\n\n    fib(n)", "a line of code"),
    # lines of code that do not parse alone (a test model's text)
    ("Get the key.\n\n    key\n    return self.write(key\n    if key) -> key in key.",
     "a line of code: 'return self.write(key'"),
    ("Return it.\n\n    if n_max", "a line of code"),
    # seen on held-out standard-library code at threshold 0
    ("The name of the file.\n\n    # https://github.com/python/issues/2.1.1.1.1.",
     "a comment: '# https://github.com"),
    ("Return the number, see https://example.org/fib.", "a link: 'https://example.org/fib.'"),
    ("Return the number.\n\n    Parameters\n    ----------", "an empty Parameters section"),
    ("Return the number.\n\n    Returns:\n    Raises:\n        ValueError: if n < 0.",
     "an empty Returns section"),
    # the summary
    ("Return", "not a sentence"),
    ("Return the value of", "not a sentence"),
    ("Return a ``a`` and ``a`` is a ``a`` and", "not a sentence"),
    ("Return the number.\n\n    The number of it is the number of it is.", "repeats itself"),
    # sections and examples
    ("Return it.\n\n    Parameters\n    ----------\n", None),  # checked below: no parameters
    ("Return the number.\n\n    >>> len([1])\n    1\n", "does not use it"),
    ("Return the number.\n\n    >>>", "an empty example"),
    # seen on outside code (pygls) at threshold 0: references to nothing, role junk
    ("If the server is not a :class:`get_run` request.",
     "a reference to 'get_run', which the module does not name"),
    ("Make a :wrong-chunks.", "a role marker with no reference: ':wrong-chunks.'"),
    ("Make a :py:class:`~docs.aws.amazon.com/resources.html` of n.",
     "which the module does not name"),
    ("Return the :foo:`bar` of n.", "an unknown role: 'foo'"),
    ("Return it.\n\n    :param int x: the number.", "a parameter 'x' that it does not have"),
    ("Return it.\n\n    :frob n: the number.", "an unknown field: 'frob'"),
])
def test_junk_fails(text: str, why: str | None) -> None:
    if why is None:  # a parameters section on a function that takes none
        got = problem(text, DocContext("f", (), frozenset(), frozenset()))
        assert got is not None and "takes no parameters" in got
        return
    got = problem(text, FIB)
    assert got is not None and why in got, got


def test_names_from_the_module_and_the_signature_are_words() -> None:
    ctx = DocContext("frobnicate", ("widget",), frozenset({"Gizmo"}), frozenset())
    assert problem("Frobnicate the widget of a Gizmo.", ctx) is not None  # capitalised
    assert problem("Call frobnicate on the widget of a Gizmo.", ctx) is None
    assert "unknown word: 'gadget'" in (problem("Call frobnicate on a gadget.", ctx) or "")


def test_the_words_are_the_standard_librarys() -> None:
    words = english()
    assert len(words) > 5000 and {"return", "the", "value", "iterable"} <= words
    assert not {"atteristics", "croken", "gilen"} & words


def test_the_hooks_targets_carry_their_parameters() -> None:
    source = "class Stack:\n    def __init__(self, size):\n        self.size = size\n\n" \
             "    async def drain(self, *rest, limit=1, **kw):\n        yield 1\n"
    targets = {t.qualname: t.params for t in find_targets(source, split_lines(source))}
    assert targets == {"Stack": ("size",), "Stack.__init__": ("size",),
                       "Stack.drain": ("limit", "rest", "kw")}
    names, imports = module_names(ast.parse("import os.path as p\nfrom a.b import c\nx = p\n"))
    assert {"os", "path", "p", "c", "x"} <= names and imports == {"os", "a"}
