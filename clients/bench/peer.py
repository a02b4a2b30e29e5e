"""A peer engine in `ahead bench engine`: llama.cpp's llama-server decoding the same prompts
(as token ids) greedily, on the same number of threads, in the same run as ours.

The server runs as a child process on a free loopback port, one prompt at a time, without its
prompt cache, and is asked for exactly as many tokens as our runs may make (end of text
ignored), so its decode rate is timed over as many tokens. Its rate is its own figure
(`timings.predicted_per_second`: decoding only, as ours is).
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


class PeerError(RuntimeError):
    """The peer could not be started or answered something unusable."""


class LlamaServer:
    """`binary` serving `gguf` on 127.0.0.1 while the `with` block runs."""

    def __init__(self, binary: Path, gguf: Path, *, threads: int, context: int,
                 start_timeout: float = 120.0) -> None:
        for path, what in ((binary, "llama-server binary"), (gguf, "GGUF model")):
            if not path.is_file():
                raise PeerError(f"{what} {path} does not exist")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                     str(self.port), "-c", str(context), "-np", "1", "-t", str(threads),
                     "-tb", str(threads), "--no-webui"]
        self.start_timeout = start_timeout
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self._proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=self._read, args=(self._proc,), daemon=True).start()
        if not self._ready.wait(self.start_timeout) or self._proc.poll() is not None:
            self.__exit__(None, None, None)
            raise PeerError("llama-server did not start:\n" + "\n".join(self.lines[-15:]))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            self.lines.append(line)
            if "listening on" in line:
                self._ready.set()
        self._ready.set()  # it exited: `__enter__` sees that

    def complete(self, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens after `ids` and the server's decode rate (tokens/s)."""
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "cache_prompt": False, "return_tokens": True,
                "stream": False}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as resp:
                answer: dict[str, Any] = json.load(resp)
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise PeerError(f"llama-server failed a completion: {e}") from None
        try:
            return list(answer["tokens"]), float(answer["timings"]["predicted_per_second"])
        except (KeyError, TypeError, ValueError):
            raise PeerError(f"llama-server's answer has no tokens or timings: "
                            f"{sorted(answer)}") from None
