"""Fill-in-the-middle layouts of the common code model families, by name: to write a prompt
in text for a served model whose tokenizer the daemon lacks, and to read back a prompt that
a client wrote in one of them itself (Continue and others render their own FIM templates),
so that the daemon can build the model's own prompt from its parts instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Extra = tuple[tuple[str, str], ...]  # (path, text) of other files


@dataclass(frozen=True, slots=True)
class Layout:
    prefix: str  # the markers
    suffix: str
    middle: str
    file_sep: str | None = None  # repo-level context: file_sep, path, newline, text
    others: tuple[str, ...] = ()  # more special tokens, never meant as text
    spaced: bool = False  # CodeLlama: "<PRE> {prefix} <SUF>{suffix} <MID>"

    @property
    def markers(self) -> tuple[str, ...]:
        seps = (self.file_sep,) if self.file_sep else ()
        return (self.prefix, self.suffix, self.middle, *seps, *self.others)

    def write(self, prefix: str, suffix: str, extra: Sequence[tuple[str, str]] = ()) -> str:
        """The prompt, prefix-suffix-middle, with `extra` before it (as comments at the
        prefix's start where the family has no file separator)."""
        context = "".join(self.chunk(path, text) for path, text in extra)
        if self.file_sep is None:
            prefix, context = context + prefix, ""
        if self.spaced:
            return f"{self.prefix} {prefix} {self.suffix}{suffix} {self.middle}"
        return f"{context}{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"

    def chunk(self, path: str, text: str) -> str:
        text = text if text.endswith("\n") else text + "\n"
        return f"{self.file_sep}{path}\n{text}" if self.file_sep else f"# {path}\n{text}"

    def plain(self, text: str) -> str:
        """`text` with this layout's markers taken out: editor text must not end a part."""
        for marker in self.markers:
            text = text.replace(marker, "")
        return text

    def read(self, prompt: str) -> tuple[str, str, Extra] | None:
        """(prefix, suffix, extra) of a prompt in this layout, in either order (the suffix
        first: "<pre><suf>{suffix}<mid>{prefix}"); None if it is not one."""
        head, sep, rest = prompt.partition(self.prefix)
        if not sep or self.suffix not in rest or self.middle not in rest:
            return None
        before, _, after = rest.partition(self.suffix)
        between, _, tail = after.partition(self.middle)
        if before.strip() == "" and tail:  # suffix-prefix-middle
            prefix, suffix = tail, between
        elif not tail:
            prefix, suffix = before, between
        else:
            return None
        if self.spaced:
            prefix, suffix = prefix.removeprefix(" ").removesuffix(" "), suffix.removesuffix(" ")
        return prefix, suffix, self._context(head)

    def _context(self, head: str) -> Extra:
        if not self.file_sep or self.file_sep not in head:
            return ()
        chunks = []
        for part in head.split(self.file_sep)[1:]:
            path, _, text = part.partition("\n")
            if text.strip():  # Qwen names the current file last, with nothing after it
                chunks.append((path.strip(), text))
        return tuple(chunks)


LAYOUTS: dict[str, Layout] = {
    "qwen": Layout("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>",
                   ("<|fim_pad|>", "<|repo_name|>", "<|endoftext|>")),
    "starcoder": Layout("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>",
                        ("<fim_pad>", "<repo_name>", "<|endoftext|>")),
    "deepseek": Layout("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>",
                       others=("<｜end▁of▁sentence｜>",)),
    "codellama": Layout("<PRE>", "<SUF>", "<MID>", others=("<EOT>",), spaced=True),
}


def read_any(prompt: str) -> tuple[str, str, Extra] | None:
    """A client's own FIM prompt in any known layout, as (prefix, suffix, extra)."""
    for layout in LAYOUTS.values():
        parts = layout.read(prompt)
        if parts is not None:
            return parts
    return None
