"""`ahead docstrings`: real files, a real model, the real daemon and the real pre-commit."""

from __future__ import annotations

import ast
import asyncio
import difflib
import io
import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from clients import docstrings
from clients.docstring_edit import NoCompletion, add_docstrings
from daemon.client import Client
from engine import Engine
from tests.conftest import load_exact
from training.synthetic import write_checkpoint

FAST = ["--max-seq-len", "512", "--k-max", "2"]  # small caches: quick to load and calibrate

SOURCE = '''\
"""A module with a docstring already."""

import functools


@functools.lru_cache(
    maxsize=None,
)
def decorated(a,
              b: int = (1, 2),
              ) -> dict[str, int]:  # a comment on the header
    # a comment before the body
    return {"a": a, "b": b}


class Shape:
    sides = 0

    def area(self):
        """Documented already: left alone."""
        return 0

    async def grow(self, by):
        def step(x):
            return lambda: x + by
        return step


def one_liner(): return 1
def another(x): pass
'''
# Everything that gets one, and the one that had one.
NAMES = {"decorated", "Shape", "grow", "step"}


def ahead(*args: str, cwd: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False, cwd=cwd, env=env)


def documented(text: str) -> dict[str, str | None]:
    tree = ast.parse(text)
    return {n.name: ast.get_docstring(n, clean=False) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def assert_only_insertions(old: str, new: str) -> list[str]:
    """`new` is `old` plus whole inserted lines that are docstrings; those lines."""
    a = io.StringIO(old, newline="").readlines()
    b = io.StringIO(new, newline="").readlines()
    inserted = []
    for tag, _, _, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        assert tag in ("equal", "insert"), (tag, b[j1:j2])
        if tag == "insert":
            assert b[j1].lstrip().startswith(('"""', 'r"""')), b[j1:j2]
            inserted += b[j1:j2]
    return inserted


def test_cli_documents_every_kind_of_definition_once(writer_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "shapes.py"
    path.write_text(SOURCE)
    path.chmod(0o640)
    proc = ahead("docstrings", "--no-daemon", "--model", str(writer_dir), *FAST,
                 "--min-confidence", "0", str(path))
    assert proc.returncode == 1, proc.stderr
    new = path.read_text()
    docs = documented(new)
    assert {name for name, doc in docs.items() if doc} == NAMES | {"area"}
    assert docs["area"] == "Documented already: left alone."
    assert docs["one_liner"] is None and docs["another"] is None
    assert len(assert_only_insertions(SOURCE, new)) >= len(NAMES)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temporary file left
    for qualname in ("decorated", "Shape", "Shape.grow", "Shape.grow.step"):
        assert f"added a docstring to {qualname}\n" in proc.stdout
    # A second run (and a check) finds nothing to do, without loading the model.
    again = ahead("docstrings", "--no-daemon", "--model", "/nonexistent", str(path))
    assert (again.returncode, again.stdout) == (0, ""), again.stderr
    check = ahead("docstrings", "--check", "--no-daemon", "--model", "/nonexistent", str(path))
    assert check.returncode == 0 and path.read_text() == new


def test_check_reports_and_leaves_the_file_untouched(writer_engine: Engine,
                                                     tmp_path: Path) -> None:
    path = tmp_path / "a.py"
    path.write_text(SOURCE)
    before = path.stat()
    out, err = io.StringIO(), io.StringIO()
    status = docstrings.run([str(path)], lambda: docstrings.engine_completer(writer_engine, 48),
                            check=True, out=out, err=err)
    assert status == 1
    assert path.read_text() == SOURCE and path.stat().st_mtime_ns == before.st_mtime_ns
    assert "would add a docstring to Shape.grow" in out.getvalue()


@pytest.mark.parametrize("eol", ["\r\n", "\r"])
def test_line_endings_bom_and_non_ascii_bytes_are_kept(writer_engine: Engine, tmp_path: Path,
                                                        eol: str) -> None:
    source = "# café ☕\nclass Café:\n\tdef ünïcode(self):\n\t\treturn 'é'\n".replace("\n", eol)
    path = tmp_path / "crlf.py"
    path.write_bytes(b"\xef\xbb\xbf" + source.encode())
    status = docstrings.run([str(path)], lambda: docstrings.engine_completer(writer_engine, 48),
                            out=io.StringIO(), err=io.StringIO())
    assert status == 1
    data = path.read_bytes()
    assert data.startswith(b"\xef\xbb\xbf")
    new = data[3:].decode()
    assert all(line.endswith(eol) and line.count("\r") + line.count("\n") == len(eol)
               for line in io.StringIO(new, newline="").readlines())
    inserted = assert_only_insertions(source, new)
    assert inserted[0].startswith('\t"""') and any(x.startswith('\t\t"""') for x in inserted)
    assert all(documented(new).values())


def test_unparsable_unreadable_and_other_files(writer_engine: Engine, tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n    return 1\n")
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"def f():\n    return '\xe9'\n")  # latin-1, not declared
    text = tmp_path / "notes.txt"
    text.write_text("def f():\n    pass\n")
    good = tmp_path / "good.py"
    good.write_text("def f(a, b):\n    return a + b\n")  # f(x) drew "Sayat" on a CPU without AMX
    originals = {p: p.read_bytes() for p in (broken, latin, text)}

    def run(*paths: Path) -> tuple[int, str]:
        err = io.StringIO()
        status = docstrings.run([str(p) for p in paths],
                                lambda: docstrings.engine_completer(writer_engine, 48),
                                out=io.StringIO(), err=err)
        return status, err.getvalue()

    status, err = run(broken, latin, text, tmp_path / "missing.py")
    assert status == 2
    assert f"{broken}: skipped: does not parse" in err and f"{latin}: skipped: is not UTF-8" in err
    assert f"{text}: skipped: not a .py file" in err
    assert "missing.py: skipped: cannot be read" in err
    assert run(text) == (0, f"{text}: skipped: not a .py file\n")
    status, err = run(broken, good)  # a changed file decides the status
    assert status == 1 and "does not parse" in err and documented(good.read_text())["f"]
    assert {p: p.read_bytes() for p in originals} == originals


@pytest.mark.parametrize(("middle", "expected"), [
    ('Add two numbers."""\n    return a + b\n', '    """Add two numbers."""\n'),
    ('Say "hi."\n""" + x', '    """Say "hi." """\n'),
    ('Say "hi."""" + x', '    """Say "hi."""\n'),
    ("Match \\d+ digits.\\", '    r"""Match \\d+ digits."""\n'),
    ("First line.\n\n        More.\n    \"\"\"\n", '    """First line.\n\n    More.\n    """\n'),
    ("\x00Odd\x1b chars\u2028here.", '    """Odd chars\n    here.\n    """\n'),
])
def test_garbage_is_cleaned_into_a_docstring_that_parses(middle: str, expected: str) -> None:
    source = "def f(a, b):\n    return a + b\n"
    new, outcome = docstrings.add_docstrings(source, lambda doc, pre, suf: middle, "m.py")
    assert new == source.replace("\n", "\n" + expected, 1)
    compile(new, "m.py", "exec")  # warnings are errors here: no invalid escapes either
    assert [t.qualname for t, _ in outcome.added] == ["f"]


@pytest.mark.parametrize("middle", ['"""', "  \n ", "\\\\"])
def test_nothing_usable_leaves_the_definition_alone(middle: str) -> None:
    source = "class A:\n    x = 1\n"
    new, outcome = docstrings.add_docstrings(source, lambda doc, pre, suf: middle, "m.py")
    assert new == source and not outcome.added
    assert [(t.qualname, why) for t, why in outcome.skipped] == [
        ("A", "the model wrote nothing usable")]


def test_a_verdict_that_depends_on_the_neighbours_is_reached_in_one_run() -> None:
    """A model that documents `first` always and any other definition only once the text
    above it holds a docstring (what a model reading its context may well do): the run asks
    again after writing, so a second run over its result has nothing left to do. Before,
    bottom-up, `second` saw `first` undocumented in the first run and documented in the next,
    which wrote it: pre-commit failed on every commit until the file settled."""
    source = "def first(a):\n    return a\n\n\ndef second(b):\n    return b\n"
    asked: list[str] = []

    def complete(document: str, prefix: str, suffix: str) -> str:
        asked.append(document.rpartition("#")[2])
        if document.endswith("#first") or prefix.count('"""') > 1:  # its own opening: one
            return "Say what it does.\"\"\""
        raise NoCompletion("nothing above to go by")

    text, outcome = add_docstrings(source, complete, "m.py")
    assert [t.qualname for t, _ in outcome.added] == ["first", "second"] and not outcome.skipped
    assert asked == ["first", "second", "second"]  # the second pass asks only what was left
    again, outcome = add_docstrings(text, complete, "m.py")
    assert again == text and not outcome.added


def test_the_bundled_models_second_run_changes_nothing(model_dir: Path) -> None:
    """The issue's sample (a function, a cached one, a class with a method and an async
    generator), at 0.25 (the default for a model `ahead bench quality` has not measured; the
    bundled model's own says it writes none): a second run over the first run's file adds
    nothing."""
    source = (
        "import functools\n\n\ndef add(a, b):\n    return a + b\n\n\n"
        "@functools.lru_cache(maxsize=None)\ndef fib(n):\n    if n < 2:\n        return n\n"
        "    return fib(n - 1) + fib(n - 2)\n\n\nclass Stack:\n    def __init__(self):\n"
        "        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    async def drain(self):\n"
        "        while self.items:\n            yield self.items.pop()\n")
    engine = load_exact(model_dir, max_seq_len=1024, k_max=4)
    complete = docstrings.engine_completer(engine, 48, 0.25)
    text, _ = add_docstrings(source, complete, "sample.py")
    again, outcome = add_docstrings(text, complete, "sample.py")
    assert again == text and not outcome.added


def test_the_request_is_fim_inside_the_body() -> None:
    seen = []

    def complete(document: str, prefix: str, suffix: str) -> str:
        seen.append((document, prefix, suffix))
        return "Doc."

    source = "class A:\n    def m(\n        self,\n    ):  # c\n        pass\n"
    docstrings.add_docstrings(source, complete, "pkg/a.py")
    (doc_a, pre_a, suf_a), (doc_m, pre_m, suf_m) = seen  # in file order, one pass
    assert doc_m == "pkg/a.py#A.m" and doc_a == "pkg/a.py#A"
    assert pre_m == "class A:\n    def m(\n        self,\n    ):  # c\n        \"\"\""
    assert suf_m == "\n        pass\n"
    assert pre_a == 'class A:\n    """' and suf_a.startswith('\n    def m(')
    assert "Doc." not in suf_a  # both asked about the same text: no verdict hangs on another


async def test_through_the_daemon(writer_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp_path / "rt"),
           "AHEAD_STATE_DIR": str(tmp_path / "st")}
    path = tmp_path / "code" / "b.py"
    path.parent.mkdir()
    path.write_text(SOURCE)
    try:
        proc = await asyncio.to_thread(ahead, "docstrings", "--model", str(writer_dir), *FAST,
                                       "--min-confidence", "0", str(path), env=env)
        assert proc.returncode == 1, proc.stderr
        assert {name for name, doc in documented(path.read_text()).items() if doc} == \
            NAMES | {"area"}
        assert_only_insertions(SOURCE, path.read_text())
    finally:
        client = Client(tmp_path / "rt" / "daemon.sock", autostart=False)
        await client.shutdown()
        await client.close()


HOOK_TOKENS = 24  # the test models' one sentence and its closing quotes
FROB = {  # the model writes "Return the frob." for both: a name of the first module only
    "frob.py": 'frob = object()\n\n\ndef get():\n    return frob\n',
    "other.py": 'def get(key):\n    return key\n',
}


@pytest.fixture(scope="module")
def frob_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Taught to write "Return the frob." as every docstring: the docstring gate passes it
    where the module has a `frob` and refuses it elsewhere ('frob' is no English word)."""
    path = tmp_path_factory.mktemp("frob")
    write_checkpoint(path, "tiny-qwen3", train_steps=600, seed=0, docstring="Return the frob.")
    return path


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_pre_commit_hook_writes_what_the_gate_passes_and_skips_the_rest(
        frob_dir: Path, tmp_path: Path) -> None:
    """The real pre-commit runs the hook on two files with a real model whose docstring is the
    same for both: written where it documents the function (the hook fails, as pre-commit
    wants when it changed a file), refused and reported where it is not a docstring of that
    module's code (an unknown word); the next run passes and changes nothing. A threshold
    above the model's confidence leaves a function alone, saying so."""
    pytest.importorskip("pre_commit")
    repo, run = hook_repo(tmp_path, frob_dir, verbose=True)
    for name, source in FROB.items():
        (repo / name).write_text(source)
    assert run("git", "init", "-q").returncode == 0
    assert run("git", "add", ".pre-commit-config.yaml", *FROB).returncode == 0
    first = run(sys.executable, "-m", "pre_commit", "run", "--files", *FROB)
    assert first.returncode == 1, first.stdout + first.stderr
    assert "Failed" in first.stdout and "files were modified by this hook" in first.stdout
    new = (repo / "frob.py").read_text()
    assert documented(new)["get"] == "Return the frob."
    assert assert_only_insertions(FROB["frob.py"], new)
    assert (repo / "other.py").read_text() == FROB["other.py"]
    assert "other.py:1: skipped get: not a docstring for it: an unknown word: 'frob'" in \
        first.stdout, first.stdout
    assert run("git", "add", "frob.py").returncode == 0
    second = run(sys.executable, "-m", "pre_commit", "run", "--files", *FROB)
    assert second.returncode == 0 and "Passed" in second.stdout, second.stdout
    assert (repo / "frob.py").read_text() == new
    (repo / "again.py").write_text(FROB["frob.py"])
    check = ahead("docstrings", "--check", "--no-daemon", "--model", str(frob_dir), *FAST,
                  "--max-tokens", str(HOOK_TOKENS), "--min-confidence", "0.9999",
                  str(repo / "again.py"))
    assert check.returncode == 0 and "skipped" in check.stderr and "not sure" in check.stderr


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Taught to write a summary and then a line of code as every docstring (#28's junk:
    code inside the docstring)."""
    path = tmp_path_factory.mktemp("coder")
    write_checkpoint(path, "tiny-qwen3", train_steps=1000, seed=0,
                     docstring="Get the key.\n\nreturn key\n")
    return path


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_pre_commit_leaves_a_file_alone_where_the_models_text_has_code(
        coder_dir: Path, tmp_path: Path) -> None:
    """The real pre-commit, a real model whose docstring has a line of code in it, no
    threshold: the file is left as it was, the hook passes, and it says why it wrote nothing."""
    pytest.importorskip("pre_commit")
    repo, run = hook_repo(tmp_path, coder_dir, "--max-tokens", "48", "--min-confidence", "0",
                          verbose=True)
    (repo / "other.py").write_text(FROB["other.py"])
    assert run("git", "init", "-q").returncode == 0
    assert run("git", "add", ".pre-commit-config.yaml", "other.py").returncode == 0
    first = run(sys.executable, "-m", "pre_commit", "run", "--files", "other.py")
    assert first.returncode == 0 and "Passed" in first.stdout, first.stdout + first.stderr
    assert (repo / "other.py").read_text() == FROB["other.py"]
    assert "other.py:1: skipped get: not a docstring for it: a line of code: 'return key'" \
        in first.stdout, first.stdout


def test_a_model_whose_docstrings_do_not_pass_writes_none_and_says_so(
        writer_dir: Path, tmp_path: Path) -> None:
    """`ahead bench quality --save` found no threshold for the model (quality.json beside it
    says so): the hook writes nothing and says why, exit 0 (pre-commit passes);
    --min-confidence overrides; a quality.json that cannot be read is an error naming it."""
    model = tmp_path / "model"
    shutil.copytree(writer_dir, model)
    path = tmp_path / "a.py"
    path.write_text(FROB["other.py"])
    (model / "quality.json").write_text('{"docstring_min_confidence": null}\n')
    env = {**os.environ, "AHEAD_CONFIG": str(tmp_path / "none.toml")}
    none = ahead("docstrings", "--no-daemon", "--model", str(model), *FAST, str(path), env=env)
    assert none.returncode == 0, none.stderr
    assert "this model's docstrings do not pass; nothing written" in none.stderr
    assert path.read_text() == FROB["other.py"]
    forced = ahead("docstrings", "--no-daemon", "--model", str(model), *FAST,
                   "--min-confidence", "0", str(path), env=env)
    assert forced.returncode == 1 and documented(path.read_text())["get"], forced.stderr
    (model / "quality.json").write_text('{"docstring_min_confidence": "high"}\n')
    path.write_text(FROB["other.py"])  # work to do: the model is needed
    bad = ahead("docstrings", "--no-daemon", "--model", str(model), *FAST, str(path), env=env)
    assert bad.returncode == 1 and "quality.json" in bad.stderr \
        and "docstring_min_confidence must be" in bad.stderr, bad.stderr


def test_hook_manifest_names_the_command() -> None:
    pytest.importorskip("pre_commit")
    import yaml  # pre-commit's own dependency

    manifest = Path(__file__).parent.parent / ".pre-commit-hooks.yaml"
    check = subprocess.run([sys.executable, "-m", "pre_commit", "validate-manifest",
                            str(manifest)], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    (hook,) = yaml.safe_load(manifest.read_text())
    assert {k: hook[k] for k in ("id", "name", "entry", "language", "types")} == {
        "id": "ahead-docstrings", "name": "ahead docstrings", "entry": "ahead docstrings",
        "language": "python", "types": ["python"]}


Run = Callable[..., subprocess.CompletedProcess[str]]


def hook_repo(tmp_path: Path, model_dir: Path, *args: str,
              verbose: bool = False) -> tuple[Path, Run]:
    """A repository whose .pre-commit-config.yaml runs `ahead docstrings` on the model (short
    docstrings, small caches, plus `args`), and a function running commands in it with a
    private pre-commit home and no user git config."""
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
           "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}

    def run(*cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=300, check=False)

    entry = shlex.join([sys.executable, "-m", "clients.cli", "docstrings", "--no-daemon",
                        "--model", str(model_dir), *FAST, "--max-tokens", str(HOOK_TOKENS),
                        *args])
    (repo / ".pre-commit-config.yaml").write_text(
        "repos:\n- repo: local\n  hooks:\n  - id: ahead-docstrings\n    name: ahead docstrings\n"
        f"    entry: {entry}\n    language: system\n    types: [python]\n"
        "    require_serial: true\n" + ("    verbose: true\n" if verbose else ""))
    return repo, run
