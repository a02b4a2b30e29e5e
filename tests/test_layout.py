"""The packages' one direction of imports, and no import cycles inside the engine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the first-party packages it may import
ALLOWED = {
    "engine": {"engine"},
    "training": {"engine", "training"},
    "daemon": {"engine", "daemon"},
    "lsp": {"daemon", "lsp"},
    "clients": {"engine", "training", "daemon", "lsp", "clients"},
}


def runtime_imports(path: Path) -> set[str]:
    """Modules imported when the file runs: `if TYPE_CHECKING:` blocks left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                out.add(child.module)
                out.update(f"{child.module}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return out


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / package).rglob("*.py")}


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_one_way(package: str) -> None:
    for name, path in modules(package).items():
        for imported in runtime_imports(path):
            top = imported.split(".")[0]
            if top in ALLOWED:
                assert top in ALLOWED[package], f"{name} imports {imported}"


def test_the_engine_has_no_import_cycles() -> None:
    mods = modules("engine")
    graph = {name: {m for m in runtime_imports(path) if m in mods and m != name}
             for name, path in mods.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])


def test_no_engine_file_is_long() -> None:
    long = {name: n for name, path in modules("engine").items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 400}
    assert not long


def test_the_bundled_model_path_imports_no_torch() -> None:
    """`ahead docstrings` and `generate --model` resolve the bundled model's path before
    talking to the daemon: that must not cost a torch import."""
    code = ("import sys, engine.bundled; engine.bundled.bundled_model_dir(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_the_public_api_names_what_it_exports() -> None:
    import engine

    for name in engine.__all__:
        assert getattr(engine, name) is not None
    with pytest.raises(AttributeError):
        engine.NoSuchThing  # noqa: B018


def test_a_daemon_in_front_of_a_remote_server_imports_no_torch() -> None:
    """Only the local backend loads the model: the server, the HTTP endpoint and the openai
    backend (tokenizer and prompt recipe included) start without torch."""
    code = ("import sys, daemon.server, daemon.http, daemon.backends.openai; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
