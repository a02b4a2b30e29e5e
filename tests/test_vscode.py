"""The VS Code extension (clients/vscode): its node tests, which drive the real `ahead lsp`
through vscode-jsonrpc, and its packaging into a .vsix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

EXTENSION = Path(__file__).parent.parent / "clients" / "vscode"
NODE, NPM = shutil.which("node"), shutil.which("npm")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(NODE is None or NPM is None,
                       reason="Node.js and npm are not installed (the VS Code extension's "
                              "tests and packaging need them)"),
]


def npm(*args: str, timeout: float, env: dict[str, str] | None = None) -> None:
    assert NPM is not None
    proc = subprocess.run([NPM, *args], cwd=EXTENSION, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, (f"npm {' '.join(args)} exited {proc.returncode}\n"
                                  f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")


@pytest.fixture(scope="module")
def compiled() -> None:
    """Dependencies as locked (fetched once: a clean clone has none), then the TypeScript."""
    if not (EXTENSION / "node_modules").is_dir():
        npm("ci", timeout=600)
    npm("run", "compile", timeout=300)


@pytest.mark.usefixtures("compiled")
def test_node_suite_gets_an_inline_completion_from_the_language_server() -> None:
    # This interpreter's server, so the test runs against the code under test.
    env = {**os.environ,
           "AHEAD_LSP_CMD": json.dumps([sys.executable, "-m", "clients.cli", "lsp"])}
    npm("test", env=env, timeout=600)


@pytest.mark.usefixtures("compiled")
def test_vsce_packages_the_extension(tmp_path: Path) -> None:
    out = tmp_path / "ahead.vsix"
    npm("run", "package", "--", "--out", str(out), timeout=300)
    with zipfile.ZipFile(out) as vsix:
        names = set(vsix.namelist())
        manifest = json.loads(vsix.read("extension/package.json"))
    assert manifest["name"] == "ahead" and manifest["main"] == "./out/extension.js"
    assert {"extension/out/extension.js", "extension/out/options.js"} <= names
    assert "extension/node_modules/vscode-languageclient/package.json" in names
    assert not any(name.startswith(("extension/src/", "extension/out/test/")) for name in names)
