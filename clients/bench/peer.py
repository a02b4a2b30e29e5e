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
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any


class PeerError(RuntimeError):
    """The peer could not be started or answered something unusable."""


class LlamaServer:
    """`binary` serving `gguf` on 127.0.0.1 while the `with` block runs."""

    def __init__(self, binary: Path, gguf: Path, *, threads: int, context: int,
                 start_timeout: float = 120.0, extra: Sequence[str] = ()) -> None:
        for path, what in ((binary, "llama-server binary"), (gguf, "GGUF model")):
            if not path.is_file():
                raise PeerError(f"{what} {path} does not exist")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                     str(self.port), "-c", str(context), "-np", "1", "-t", str(threads),
                     "-tb", str(threads), "--no-webui", *extra]
        self.start_timeout = start_timeout
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> LlamaServer:
        self._proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True)
        self._reader.start()
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

    def _exited(self) -> str:
        """Where the server has exited (it may listen before it loads the model, then fail
        to): its last lines, which say why; else nothing. A request it refused may come just
        before its exit (its socket closed first): it is given a few seconds to end."""
        if self._proc is None:
            return ""
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return ""
        if self._reader is not None:
            self._reader.join(10)  # its output read to the end
        return "; it exited:\n" + "\n".join(self.lines[-15:])

    def complete(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, int]:
        """Greedy tokens after `ids`, the server's decode rate (tokens/s) and its decode
        steps (fewer than tokens where it drafts: `--spec-type`)."""
        tokens, timings = self.complete_timed(ids, max_tokens)
        made = int(timings.get("predicted_n", len(tokens)))
        steps = made - int(timings.get("draft_n_accepted") or 0)
        return tokens, float(timings["predicted_per_second"]), max(steps, 1)

    def complete_timed(self, ids: list[int], max_tokens: int) -> tuple[list[int], dict[str, Any]]:
        """Greedy tokens after `ids` and the server's `timings` (decode rate, drafts)."""
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
            raise PeerError(f"llama-server failed a completion: {e}{self._exited()}") from None
        try:
            float(answer["timings"]["predicted_per_second"])
            return list(answer["tokens"]), dict(answer["timings"])
        except (KeyError, TypeError, ValueError):
            raise PeerError(f"llama-server's answer has no tokens or timings: "
                            f"{sorted(answer)}") from None


def peer_steps(binary: Path, gguf: Path, prompt: list[int], new_tokens: int, *, threads: int,
               k_max: int, synthetic: list[float] | None) -> dict[str, Any]:
    """llama.cpp on the same shapes, as it runs best (step timings mode of the bench):
    - `plain_tokens_per_s`: `llama-bench -p 0 -d <prompt length>` beside the server
      (batch-1 decode after as many tokens of context as ours, `plain_depth`, with its
      default weight repacking: decode from an empty context skips the attention over the
      prompt that ours pays, 1.5x as fast at 2,000 tokens on Qwen2-1.5B's shapes);
    - `plain_no_repack_tokens_per_s`: llama-server decoding after `prompt`, `--no-repack`
      (on AMX CPUs the repacked weights crash on any batch of more than one token: the
      prompt, a verify);
    - `mtp_tokens_per_s`, `mtp_tokens_per_step`: llama-server with `--spec-type draft-mtp`,
      K up to `k_max`, drafts kept at the `synthetic` rates (when given), as it runs best
      (`_drafting`): `mtp_repack` says whether with its weights repacked, and where not,
      `mtp_repack_error` why; or `mtp_error` where the server refuses (a GGUF without an
      MTP module)."""
    out: dict[str, Any] = {"binary": str(binary), "model": str(gguf)}
    bench = binary.with_name("llama-bench")
    if bench.is_file():
        done = subprocess.run([str(bench), "-m", str(gguf), "-p", "0", "-n", str(new_tokens),
                               "-d", str(len(prompt)), "-t", str(threads), "-r", "3",
                               "-o", "json"], capture_output=True, text=True, timeout=1800)
        try:
            run = json.loads(done.stdout)[0]
            out["plain_tokens_per_s"] = float(run["avg_ts"])
            out["plain_depth"] = int(run["n_depth"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise PeerError(f"llama-bench failed: {done.stderr.strip()[-500:]}") from None
    context = len(prompt) + new_tokens + 16
    with LlamaServer(binary, gguf, threads=threads, context=context,
                     extra=["--no-repack"]) as server:
        _, timings = server.complete_timed(prompt, new_tokens)
        out["plain_no_repack_tokens_per_s"] = float(timings["predicted_per_second"])
    if synthetic is None:
        return out
    spec = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k_max),
            "--spec-synth-rates", ",".join(f"{p:g}" for p in synthetic)]
    try:
        timings, repack_error = _drafting(binary, gguf, prompt, new_tokens, threads=threads,
                                          context=context, spec=spec)
    except PeerError as e:
        out["mtp_error"] = _first_complaint(str(e).splitlines(), "MTP")
        return out
    out["mtp_repack"] = repack_error is None
    if repack_error is not None:
        out["mtp_repack_error"] = repack_error
    out["mtp_tokens_per_s"] = float(timings["predicted_per_second"])
    drafted, kept = timings.get("draft_n"), timings.get("draft_n_accepted")
    if drafted is not None and kept is not None:
        steps = max(int(timings.get("predicted_n", new_tokens)) - int(kept), 1)
        out["mtp_tokens_per_step"] = int(timings.get("predicted_n", new_tokens)) / steps
    return out


def _drafting(binary: Path, gguf: Path, prompt: list[int], new_tokens: int, *, threads: int,
              context: int, spec: list[str]) -> tuple[dict[str, Any], str | None]:
    """llama-server's timings drafting as `spec` says, as a user would run it: with its
    default weight repacking, else with `--no-repack` where the repacked weights fail (on
    AMX CPUs they crash on any batch of more than one token). The timings, and why the
    repacked run failed (None where it ran). A model that cannot draft (no MTP module)
    raises PeerError."""
    try:
        with LlamaServer(binary, gguf, threads=threads, context=context, extra=spec) as server:
            return server.complete_timed(prompt, new_tokens)[1], None
    except PeerError as e:
        why = _first_complaint(str(e).splitlines(), "MTP")
        if "MTP" in why:  # no module to draft with, repacked or not
            raise
    with LlamaServer(binary, gguf, threads=threads, context=context,
                     extra=["--no-repack", *spec]) as server:
        return server.complete_timed(prompt, new_tokens)[1], why


def _first_complaint(lines: list[str], topic: str) -> str:
    """The first warning or error of a llama.cpp log about `topic` (else its last line),
    without the timestamp: "llama_init_from_model: context type MTP requested but model
    doesn't contain MTP layers"."""
    said = [ln.split(" ", 2)[-1].strip() for ln in lines
            if len(ln.split(" ", 2)) == 3 and ln.split(" ", 2)[1] in ("W", "E")]
    return next((ln for ln in said if topic in ln), said[-1] if said else
                (lines[-1] if lines else "llama-server refused"))
