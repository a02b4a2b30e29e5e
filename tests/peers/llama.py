"""llama.cpp's llama-server as a peer for tests and benchmarks: a serving engine nobody here
wrote, built by `tests/peers/install_llama_server.sh` into `.peers/llama`.

`to_gguf` converts one of our checkpoints with the converter from llama.cpp's own sources;
`LlamaServer` runs the server on a free port, keeps its log lines (to see aborts: `cancel
task`), and can be killed and started again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LLAMA_DIR = Path(os.environ.get("AHEAD_PEERS_DIR") or ROOT / ".peers") / "llama"
INSTALL = "tests/peers/install_llama_server.sh"
SERVER = LLAMA_DIR / "llama-server"

# Our byte-level BPE tokenizer's pre-tokenizer hash is one the converter does not know; it
# splits as GPT-2 does, which the converter then writes into the GGUF.
_CONVERT = """
import runpy, sys
convert = sys.argv[1]
sys.path[:0] = [convert, convert + "/gguf-py", convert + "/../pylib"]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def gpt2_when_unknown(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
TextModel.get_vocab_base_pre = gpt2_when_unknown
sys.argv = [convert + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def installed() -> bool:
    return (LLAMA_DIR / "installed").is_file() and SERVER.is_file()


def to_gguf(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` (ours) as an f32 GGUF file, without its MTP modules (llama.cpp serves the
    trunk; a converter that met them would refuse)."""
    from safetensors.torch import load_file, save_file

    trunk = out.parent / f"{out.stem}-trunk"
    trunk.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    layers = config["num_hidden_layers"]
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        config.pop(key, None)
    (trunk / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, trunk / name)
    tensors = {}
    for file in checkpoint.glob("model*.safetensors"):
        tensors.update(load_file(file))
    save_file({k: v for k, v in tensors.items() if not _mtp(k, layers)},
              trunk / "model.safetensors")
    subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_DIR / "convert"), str(trunk),
                    "--outfile", str(out), "--outtype", "f32"],
                   check=True, capture_output=True, timeout=300)
    return out


def _mtp(name: str, layers: int) -> bool:
    if name.startswith(("mtp.", "model.mtp_layers.")):
        return True
    parts = name.split(".")
    return parts[:2] == ["model", "layers"] and int(parts[2]) >= layers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """llama-server serving `gguf` on 127.0.0.1; `start`, `kill`, and `start` again."""

    def __init__(self, gguf: Path, *, context: int = 1024, parallel: int = 2,
                 threads: int = 1, extra: tuple[str, ...] = ()) -> None:
        self.gguf, self.port = gguf, free_port()
        self.args = ["-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                     "-c", str(context * parallel), "-np", str(parallel), "-t", str(threads),
                     "--metrics", "--no-webui", *extra]
        self.lines: list[str] = []
        self._changed = asyncio.Condition()
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self, timeout: float = 60.0) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            str(SERVER), *self.args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        self._reader = asyncio.create_task(self._read(self._proc))
        await self.wait_for_log("listening on", timeout, since=len(self.lines))

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        if self._reader is not None:
            await self._reader
        self._proc = self._reader = None

    async def wait_for_log(self, text: str, timeout: float = 30.0, *, since: int = 0) -> str:
        """The first log line from line `since` on that contains `text`, as it arrives."""
        async with asyncio.timeout(timeout), self._changed:
            while True:
                found = next((ln for ln in self.lines[since:] if text in ln), None)
                if found is not None:
                    return found
                if self._proc is None or self._proc.returncode is not None:
                    raise RuntimeError("llama-server exited:\n" + "\n".join(self.lines[-20:]))
                await self._changed.wait()

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            async with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip())
                self._changed.notify_all()
        await proc.wait()
        async with self._changed:
            self._changed.notify_all()

    async def __aenter__(self) -> LlamaServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            await self.kill()


def main() -> None:
    """Serve a checkpoint (default: the bundled model) with llama-server, in the foreground:

        python -m tests.peers.llama [--model DIR] [--port 8080] [-- llama-server flags]

    for `ahead bench pipeline --backend openai --url http://127.0.0.1:8080/v1` and for
    trying the openai backend by hand. The GGUF is kept in .peers/llama/models/."""
    import argparse

    from engine.bundled import bundled_model_dir

    parser = argparse.ArgumentParser(prog="python -m tests.peers.llama")
    parser.add_argument("--model", type=Path, default=bundled_model_dir())
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("flags", nargs="*", help="more llama-server flags (after --)")
    args = parser.parse_args()
    if not installed():
        sys.exit(f"llama-server is not installed: run {INSTALL}")
    out = LLAMA_DIR / "models" / f"{args.model.resolve().name}.gguf"
    if not out.exists() or out.stat().st_mtime < (args.model / "config.json").stat().st_mtime:
        print(f"converting {args.model} to {out}", file=sys.stderr)
        to_gguf(args.model, out)
    cmd = [str(SERVER), "-m", str(out), "--host", "127.0.0.1", "--port", str(args.port),
           "--metrics", "--no-webui", *args.flags]
    print(" ".join(cmd), file=sys.stderr)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main()
