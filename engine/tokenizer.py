"""Tokenizer: `tokenizer.json` via `tokenizers`, FIM prompt templates, streaming detokenisation.

FIM tokens and stop tokens are found from the tokenizer's own vocabulary, so any Qwen-,
StarCoder-, DeepSeek- or CodeLlama-style code model works without a per-model table.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used, naming the file at fault."""


# style -> role -> accepted spellings, first preferred. The first style whose prefix, suffix
# and middle all exist wins.
_FIM_SPECS: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen": {"prefix": ("<|fim_prefix|>",), "suffix": ("<|fim_suffix|>",),
             "middle": ("<|fim_middle|>",), "pad": ("<|fim_pad|>",),
             "file_sep": ("<|file_sep|>",), "eot": ("<|endoftext|>",)},
    "starcoder": {"prefix": ("<fim_prefix>",), "suffix": ("<fim_suffix>",),
                  "middle": ("<fim_middle>",), "pad": ("<fim_pad>",),
                  "file_sep": ("<file_sep>",), "eot": ("<|endoftext|>",)},
    "deepseek": {"prefix": ("<｜fim▁begin｜>",), "suffix": ("<｜fim▁hole｜>",),
                 "middle": ("<｜fim▁end｜>",), "eot": ("<｜end▁of▁sentence｜>",)},
    "codellama": {"prefix": ("▁<PRE>", "<PRE>"), "suffix": ("▁<SUF>", "<SUF>"),
                  "middle": ("▁<MID>", "<MID>"), "eot": ("▁<EOT>", "<EOT>")},
}
# Trained alongside the FIM tokens so our own tokenizer can do repo-level prompts.
_TRAIN_EXTRAS = {"qwen": ("<|repo_name|>",), "starcoder": ("<repo_name>",)}
# Tokens after which a completed middle is final, whichever the vocabulary has.
_STOP_STRINGS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|im_end|>", "<fim_pad>",
                 "<file_sep>", "<|end_of_text|>", "<｜end▁of▁sentence｜>", "▁<EOT>", "<EOT>")
_EOS = "<|endoftext|>"
FIM_ORDERS = ("psm", "spm")


@dataclass(frozen=True, slots=True)
class FimTokens:
    style: str
    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    file_sep: int | None = None
    eot: int | None = None


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what code completion needs: FIM ids and stop ids."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_ids: Iterable[int] = (), *,
                 fim_order: str = "psm") -> None:
        self._tok = tok
        added = tok.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.eos_ids = frozenset(eos_ids)
        self.fim = _detect_fim(tok)
        if fim_order not in FIM_ORDERS:
            raise TokenizerError(f"unknown fim_order {fim_order!r}; expected one of {FIM_ORDERS}")
        if fim_order == "spm" and self.fim is not None and self.fim.style == "codellama":
            raise TokenizerError("suffix-prefix-middle prompts are not supported for CodeLlama")
        self.fim_order = fim_order
        stops = (tok.token_to_id(s) for s in _STOP_STRINGS)
        self.stop_ids = self.eos_ids | {i for i in stops if i is not None}
        # SentencePiece-style tokenizers put a "▁" before every encoded text.
        tokens = tok.encode("a", add_special_tokens=False).tokens
        self._prefix_space = bool(tokens) and tokens[0].startswith(("▁", "Ġ"))
        self._pieces: dict[int, str] = {}

    @classmethod
    def from_file(cls, path: str | Path, eos_ids: Iterable[int] = ()) -> Tokenizer:
        """Load a bare `tokenizer.json`."""
        return cls(_load(Path(path)), eos_ids)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`; eos ids come from the HF config files beside it, and the FIM
        order from `tokenizer_config.json`'s `fim_order` ("psm", the default, or "spm")."""
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"model directory {path} does not exist")
        tok = _load(path / "tokenizer.json")
        order = _read_json(path / "tokenizer_config.json").get("fim_order", "psm")
        return cls(tok, _eos_ids(tok, path), fim_order=order)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it become the special ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def fingerprint(self) -> str:
        """A hash of the whole tokenizer (vocabulary, merges, added tokens)."""
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()

    def ids_starting_with(self, text: str) -> list[int]:
        """The ids whose text starts with `text` (token healing's choices)."""
        ids = [i for i, t in enumerate(self._token_texts) if t.startswith(text)]
        if not ids:
            raise ValueError(f"no token starts with {text!r}")
        return ids

    @cached_property
    def _token_texts(self) -> list[str]:
        return [self.decode([i]) for i in range(self.vocab_size)]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def piece(self, token_id: int) -> str:
        """One token's text on its own (a part of a character reads as U+FFFD)."""
        text = self._pieces.get(token_id)
        if text is None:
            text = self._pieces[token_id] = self.decode([token_id])
        return text

    @cached_property
    def bos_ids(self) -> tuple[int, ...]:
        """The ids the tokenizer's own template puts before a text (BOS for Llama, DeepSeek)."""
        enc = self._tok.encode("a", add_special_tokens=True)
        lead = []
        for i, is_special in zip(enc.ids, enc.special_tokens_mask, strict=True):
            if not is_special:
                break
            lead.append(i)
        return tuple(lead)

    def fim_prompt(self, prefix: str, suffix: str, *,
                   extra: Sequence[tuple[str, str]] = ()) -> list[int]:
        """FIM prompt ids; `extra` is (path, text) context from other files."""
        return self.fim_parts(prefix, suffix, extra=extra)[0]

    def fim_parts(self, prefix: str, suffix: str, *,
                  extra: Sequence[tuple[str, str]] = ()) -> tuple[list[int], int]:
        """FIM prompt ids, and how many of them come before the text that moves when the
        user types at the end of `prefix` (the prompt's stable part).

        In the default prefix-suffix-middle order the suffix follows the prefix, so every
        keystroke moves it and the KV cache must run it again: the stable part ends at the
        suffix marker. A model trained in suffix-prefix-middle order (`fim_order` "spm")
        gets the suffix first and the prefix last, ending the prompt; the answer continues
        the prefix, typing only appends, and the whole prompt is stable.
        """
        fim = self.fim
        if fim is None:
            raise TokenizerError("tokenizer has no fill-in-the-middle tokens")
        context: list[int] = []
        if fim.file_sep is not None:  # repo-level layout of Qwen2.5-Coder and StarCoder2
            for path, text in extra:
                context += [fim.file_sep, *self.encode_text(f"{path}\n{_with_eol(text)}")]
        else:  # inside the prefix: text before the FIM marker is out of distribution
            prefix = "".join(f"# {path}\n{_with_eol(text)}" for path, text in extra) + prefix
        if fim.style == "codellama":
            # Meta's layout is "<PRE> {pre} <SUF>{suf} <MID>"; the "▁" of a marker token is the
            # space before it, so spell that space out only when the marker lacks it.
            gap = "" if (self._tok.id_to_token(fim.suffix) or "").startswith("▁") else " "
            prefix, suffix = f" {prefix}{gap}", f"{suffix}{gap}"
        if self.fim_order == "spm":
            ids = [*self.bos_ids, *context, fim.prefix, fim.suffix, *self.encode_text(suffix),
                   fim.middle, *self.encode_text(prefix)]
            return ids, len(ids)
        head = [*self.bos_ids, *context, fim.prefix, *self.encode_text(prefix)]
        return [*head, fim.suffix, *self.encode_text(suffix), fim.middle], len(head)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_text` for many texts at once, in parallel (training data)."""
        if self._prefix_space:
            return [self.encode_text(t) for t in texts]
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def encode_text(self, text: str) -> list[int]:
        """Ids of exactly `text` as plain text: special-token strings and all.

        Editor text is untrusted: a file that contains "<|fim_middle|>" must not end the
        prefix early, so it is encoded as the characters it is.
        """
        if not text:
            return []
        if not self._prefix_space:
            return self._plain.encode(text, add_special_tokens=False).ids
        # Encode behind a newline and drop the tokens covering only it (Meta encodes behind
        # "☺" for the same reason): the text must not gain the implicit leading "▁".
        enc = self._plain.encode("\n" + text, add_special_tokens=False)
        n = next((k for k, (start, _) in enumerate(enc.offsets) if start >= 1), len(enc.ids))
        if any(end > 1 for _, end in enc.offsets[:n]):  # the newline merged into the text
            return self._plain.encode(text, add_special_tokens=False).ids
        return enc.ids[n:]

    @cached_property
    def _plain(self) -> tokenizers.Tokenizer:
        # A copy in which specials encode as text. FIM and stop tokens that were added as
        # non-special are made special first (re-adding flips the flag in place, same id);
        # other non-special added tokens stay, as they are ordinary text pieces.
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        fim = self.fim
        control = set(self.stop_ids) | ({fim.prefix, fim.suffix, fim.middle} if fim else set())
        added = tok.get_added_tokens_decoder()
        tok.add_special_tokens([AddedToken(t.content, special=True, normalized=False)
                                for i, t in added.items() if i in control and not t.special])
        tok.encode_special_tokens = True  # not serialised by to_str(), so set on the copy
        return tok


class StreamDecoder:
    """Turns generated ids into text as they arrive, never emitting half a character.

    The window decoded per step is the last emitted chunk (left context, which also keeps a
    Strip or Metaspace decoder from eating a leading space) plus the pending ids, so a long
    output costs O(n), not O(n^2).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self._tok = tokenizer
        # Decoding with skip_special_tokens drops those tokens before the decoder runs, so
        # dropping them here gives the same text.
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._ids: list[int] = []  # left context, then pending ids
        self._read = 0  # ids[:read] is the context, already emitted

    def push(self, token_id: int) -> str:
        return self.push_many((token_id,))

    def push_many(self, ids: Iterable[int]) -> str:
        self._ids.extend(i for i in ids if i not in self._skip)
        return self._advance(final=False)

    def flush(self) -> str:
        """The held-back rest, with U+FFFD for a character the stream ended inside."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if len(self._ids) == self._read:
            return ""
        done = self._tok.decode(self._ids[: self._read])
        text = self._tok.decode(self._ids)
        # Byte-level BPE splits characters over tokens; the partial tail decodes to U+FFFD.
        if not final and (len(text) <= len(done) or text.endswith("\ufffd")):
            return ""
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text[len(done):]


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, *,
                         fim_style: str | None = "qwen") -> tokenizers.Tokenizer:
    """Byte-level BPE (any text encodes) with `<|endoftext|>` and one style's FIM tokens."""
    if fim_style is not None and fim_style not in _FIM_SPECS:
        raise ValueError(f"unknown FIM style {fim_style!r}; expected one of {list(_FIM_SPECS)}")
    specials = [_EOS]
    if fim_style is not None:
        spec = _FIM_SPECS[fim_style]
        specials += [spec[role][0] for role in ("prefix", "suffix", "middle", "pad", "file_sep",
                                                "eot") if role in spec]
        specials += _TRAIN_EXTRAS.get(fim_style, ())
    specials = list(dict.fromkeys(specials))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"vocab_size {vocab_size} is below the {len(alphabet)} byte tokens "
                         f"plus {len(specials)} special tokens")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer_dir(tok: tokenizers.Tokenizer, path: str | Path, *,
                       eos_token: str = _EOS) -> None:
    """Write `tokenizer.json` and a minimal `tokenizer_config.json` that HF tools accept."""
    if tok.token_to_id(eos_token) is None:
        raise ValueError(f"eos token {eos_token!r} is not in the vocabulary")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token,
              "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def set_fim_order(path: str | Path, order: str) -> None:
    """Record in a model directory's `tokenizer_config.json` the FIM order it was trained on."""
    if order not in FIM_ORDERS:
        raise ValueError(f"unknown fim_order {order!r}; expected one of {FIM_ORDERS}")
    file = Path(path) / "tokenizer_config.json"
    config = _read_json(file)
    config["fim_order"] = order
    file.write_text(json.dumps(config, indent=2) + "\n")


def _load(path: Path) -> tokenizers.Tokenizer:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from e
    try:
        return tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # the Rust side raises a bare Exception for any bad file
        raise TokenizerError(f"invalid tokenizer file {path}: {e}") from e


def _detect_fim(tok: tokenizers.Tokenizer) -> FimTokens | None:
    for style, spec in _FIM_SPECS.items():
        ids = {role: _first_id(tok, names) for role, names in spec.items()}
        pre, suf, mid = ids.pop("prefix"), ids.pop("suffix"), ids.pop("middle")
        if pre is not None and suf is not None and mid is not None:
            return FimTokens(style, pre, suf, mid, **ids)
    return None


def _first_id(tok: tokenizers.Tokenizer, names: tuple[str, ...]) -> int | None:
    return next((i for n in names if (i := tok.token_to_id(n)) is not None), None)


def _eos_ids(tok: tokenizers.Tokenizer, path: Path) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_json(path / name).get("eos_token_id")
        values = value if isinstance(value, list) else [value]
        ids.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    token = _read_json(path / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):  # serialised AddedToken
        token = token.get("content")
    if isinstance(token, str) and (i := tok.token_to_id(token)) is not None:
        ids.add(i)
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from an optional file: {} when it does not exist."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return data


def _with_eol(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"
