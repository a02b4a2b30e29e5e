"""Prompts for a remote server. The daemon builds them itself: servers differ in what they
accept (vLLM rejects `suffix`), and this way a remote model gets the prompt the local engine
would build.

Three ways, chosen by `prompt_builder`:
- the served model's own tokenizer (the `tokenizer` setting, else the served model's name as
  a directory, else its entry in the Hugging Face cache): token ids from the engine's one
  prompt recipe (`engine.prompt`), FIM order and token healing included;
- a named FIM template (qwen, deepseek, starcoder, codellama): text in that model family's
  layout, cut to the budget at an estimated 3 characters per token. The server reads special
  tokens in a text prompt as markers, so the template's markers are taken out of the editor's
  text (the tokenizer way encodes them as the characters they are);
- "infill": llama-server's /infill gets the prefix, suffix and other files as they are, and
  builds the prompt with the model's own tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from daemon.fim import LAYOUTS
from daemon.scheduler import Work
from engine.model.hub import ModelNotFound, hf_hub_cache, snapshot
from engine.prompt import continuation, fill_in
from engine.tokenizer import Tokenizer

PROMPT_SPARE = 8  # tokens a prompt leaves beyond the answer: markers, slack
CHARS_PER_TOKEN = 3  # a cautious estimate for code, where no tokenizer counts

@dataclass(frozen=True, slots=True)
class RemotePrompt:
    endpoint: str  # "completions" (OpenAI /v1/completions) or "infill" (llama-server)
    body: dict[str, Any] = field(default_factory=dict)  # the prompt's fields of the request
    forced: str = ""  # what the answer starts with (token healing): not part of the answer


class PromptBuilder(Protocol):
    description: str  # for `ahead status`

    def build(self, work: Work) -> RemotePrompt: ...


class TokenizerPrompts:
    def __init__(self, tokenizer_dir: Path, context: int) -> None:
        self.tok, self.context = Tokenizer.from_dir(tokenizer_dir), context
        self.description = f"tokenizer {tokenizer_dir}"

    def build(self, work: Work) -> RemotePrompt:
        if work.suffix is None:
            prompt = continuation(self.tok, work.prefix)
        else:
            prompt = fill_in(self.tok, work.prefix, work.suffix, extra=work.extra,
                             budget=self.context - work.max_tokens - PROMPT_SPARE)
        return RemotePrompt("completions", {"prompt": prompt.ids}, prompt.forced)


class TemplatePrompts:
    def __init__(self, name: str, context: int) -> None:
        self.layout, self.context = LAYOUTS[name], context
        self.description = f"template {name}"

    def build(self, work: Work) -> RemotePrompt:
        if work.suffix is None:
            return RemotePrompt("completions", {"prompt": work.prefix})
        plain = self.layout.plain
        budget = (self.context - work.max_tokens - PROMPT_SPARE) * CHARS_PER_TOKEN
        suffix = fit_lines(plain(work.suffix), budget // 5, from_end=False)
        extra, left = [], budget // 5
        for path, text in work.extra:  # most relevant first; each whole or not at all
            size = len(self.layout.chunk(path, text))
            if size <= left:
                extra.append((plain(path), plain(text)))
                left -= size
        prefix = fit_lines(plain(work.prefix), budget - len(suffix) - (budget // 5 - left),
                           from_end=True)
        return RemotePrompt("completions", {"prompt": self.layout.write(prefix, suffix, extra)})


class InfillPrompts:
    description = "llama-server /infill"

    def build(self, work: Work) -> RemotePrompt:
        if work.suffix is None:
            return RemotePrompt("completions", {"prompt": work.prefix})
        extra = [{"filename": path, "text": text} for path, text in work.extra]
        return RemotePrompt("infill", {"input_prefix": work.prefix,
                                       "input_suffix": work.suffix, "input_extra": extra})


def fit_lines(text: str, chars: int, *, from_end: bool) -> str:
    """The most whole lines of `text` from its end (or start) within `chars` characters; a
    single line longer than that is cut instead."""
    lines: Sequence[str] = text.splitlines(keepends=True)
    kept, size = [], 0
    for line in (reversed(lines) if from_end else lines):
        if size + len(line) > chars:
            break
        kept.append(line)
        size += len(line)
    if not kept and lines:
        return text[-chars:] if from_end and chars > 0 else text[:max(chars, 0)]
    return "".join(reversed(kept) if from_end else kept)


def prompt_builder(*, tokenizer: str | None, served_model: str | None,
                   fim_template: str | None, context: int) -> PromptBuilder:
    """How this daemon builds the prompts for a remote server (see the module's doc)."""
    if fim_template == "infill":
        return InfillPrompts()
    if fim_template is not None:
        return TemplatePrompts(fim_template, context)
    found = find_tokenizer(tokenizer, served_model)
    if found is None:
        looked = (f" ({served_model!r} is not in the Hugging Face cache at {hf_hub_cache()})"
                  if served_model else "")
        raise ValueError(
            f"the openai backend needs the served model's tokenizer to build its prompts{looked}:"
            " set tokenizer (a directory with its tokenizer.json), or fim_template (qwen, "
            "deepseek, starcoder, codellama; or infill for llama-server's /infill)")
    return TokenizerPrompts(found, context)


def find_tokenizer(tokenizer: str | None, served_model: str | None) -> Path | None:
    """The served model's tokenizer directory: `tokenizer` if set, else the served model's
    name when it is a directory (vLLM names a model served from a directory by its path),
    else its Hugging Face cache entry."""
    if tokenizer:
        return Path(tokenizer).expanduser()
    if not served_model:
        return None
    if (Path(served_model).expanduser() / "tokenizer.json").is_file():
        return Path(served_model).expanduser()
    return hf_cache_dir(served_model)


def hf_cache_dir(name: str, env: Mapping[str, str] = os.environ) -> Path | None:
    """The snapshot of model `name` (e.g. "Qwen/Qwen2.5-Coder-7B") in the Hugging Face
    cache that has a tokenizer.json: the one `refs/main` names (see `engine.model.hub`),
    else the newest (a tokenizer rarely changes between revisions). Offline: nothing is
    downloaded."""
    try:
        return snapshot(name, needs="tokenizer.json", env=env)
    except ModelNotFound:
        pass
    repo = hf_hub_cache(env) / ("models--" + name.replace("/", "--"))
    snapshots = [s for s in (repo / "snapshots").glob("*") if (s / "tokenizer.json").is_file()]
    return max(snapshots, key=lambda s: s.stat().st_mtime, default=None)
