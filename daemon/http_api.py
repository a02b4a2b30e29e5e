"""What the HTTP endpoint reads and writes: OpenAI's completions and llama-server's infill.

Requests are `msgspec` structs that ignore fields they do not know (OpenAI clients send
many), with the limits as constraints, so that a bad value's error names its field. Replies
are plain dicts in the shapes those clients parse.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import msgspec

from daemon import protocol as p

MAX_TOKENS = 2048  # the most tokens one answer may ask for
MAX_CHOICES = 8  # prompts x n, each a job of its own
MAX_STOPS = 16

Tokens = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Stops = Annotated[list[str], msgspec.Meta(max_length=MAX_STOPS)]


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct):
    """POST /v1/completions; a `suffix` makes it fill-in-the-middle."""

    prompt: str | list[str]
    model: str | None = None
    suffix: str | None = None
    max_tokens: Tokens | None = None  # OpenAI's default: 16
    temperature: Temperature | None = None  # OpenAI's default: 1
    top_p: TopP | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stop: str | Stops | None = None
    seed: int | None = None
    stream_options: StreamOptions | None = None

    def __post_init__(self) -> None:  # msgspec reports a ValueError here as invalid
        if not self.prompts() or len(self.prompts()) * (self.n or 1) > MAX_CHOICES:
            raise ValueError(f"prompt must be a text or 1 to {MAX_CHOICES} texts "
                             f"(times n: at most {MAX_CHOICES} choices)")
        p.check_sampling(1.0 if self.temperature is None else self.temperature,
                         self.top_p or 1.0)  # the socket's rule: subnormals are refused too

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else self.prompt

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class ExtraChunk(msgspec.Struct):
    text: str = ""
    filename: str = ""


class InfillRequest(msgspec.Struct):
    """POST /infill, as llama-server takes it (llama.vim, llama.vscode): the answer fills
    in after `input_prefix` + `prompt` and before `input_suffix`."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: Annotated[list[ExtraChunk], msgspec.Meta(max_length=256)] = []
    prompt: str = ""
    n_predict: int = -1  # -1: as many as allowed; 0: none (llama.vim warms a cache so)
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    stop: Stops = []
    seed: int = -1  # -1: any
    stream: bool = False
    t_max_predict_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    response_fields: list[str] | None = None
    # The answer ends before a line (after its first) indented less than this (0: never);
    # llama.vim sends the cursor line's indentation (engine/decode/indent.py).
    n_indent: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.n_predict > MAX_TOKENS:
            raise ValueError(f"n_predict must be at most {MAX_TOKENS}")
        p.check_sampling(self.temperature, self.top_p)

    def max_tokens(self) -> int:
        return self.n_predict if self.n_predict > 0 else MAX_TOKENS // 16


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """The request in `body`; a ValueError says what is wrong with it."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed JSON: {e}") from None


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def finish_reason(done: p.Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


class Completion:
    """The pieces of one /v1/completions answer, whole or streamed."""

    def __init__(self, model: str) -> None:
        self.id, self.model, self.created = f"cmpl-{uuid.uuid4().hex}", model, int(time.time())

    def chunk(self, index: int, text: str, reason: str | None = None) -> dict[str, Any]:
        return self._wrap([{"text": text, "index": index, "logprobs": None,
                            "finish_reason": reason}])

    def whole(self, dones: list[p.Done]) -> dict[str, Any]:
        return {**self._wrap([{"text": d.text, "index": i, "logprobs": None,
                               "finish_reason": finish_reason(d)} for i, d in enumerate(dones)]),
                "usage": usage(dones)}

    def usage_chunk(self, dones: list[p.Done]) -> dict[str, Any]:
        return {**self._wrap([]), "usage": usage(dones)}

    def _wrap(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices}


def usage(dones: list[p.Done]) -> dict[str, int]:
    prompt = sum(d.stats.prefill_tokens + d.stats.reused_tokens for d in dones)
    completion = sum(d.stats.tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def infill_answer(done: p.Done, model: str, fields: list[str] | None) -> dict[str, Any]:
    """llama-server's final /infill object (and `response_fields`' selection of it, keyed
    by path as llama-server does)."""
    s = done.stats
    answer: dict[str, Any] = {
        "content": done.text, "stop": True, "model": model,
        "stop_type": "limit" if done.finish_reason == "length" else "eos",
        "tokens_predicted": s.tokens, "tokens_evaluated": s.prefill_tokens + s.reused_tokens,
        "tokens_cached": s.reused_tokens, "truncated": False,
        "timings": {"prompt_n": s.prefill_tokens, "predicted_n": s.tokens,
                    "predicted_ms": s.engine_ms,
                    "predicted_per_second": s.tokens / (s.engine_ms / 1000)
                    if s.engine_ms else 0.0}}
    if fields is None:
        return answer
    picked = {}
    for path in fields:
        value: Any = answer
        for part in path.split("/"):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            picked[path] = value
    return picked
