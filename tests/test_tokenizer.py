"""Tokenizer tests on tiny tokenizers trained from stdlib source and written to real files."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from engine.tokenizer import (
    FimTokens,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    save_tokenizer_dir,
    set_fim_order,
    train_byte_level_bpe,
)

VOCAB = 600
EXTRA_LINES = ['greeting = "héllo wörld"  # café, naïve\n', 'names = ["中文", "字符"]\n',
               'snake = "🐍"\n']
TEXT = "def fête(x):\n    return '中文字符 🎉 naïve café' + x  # 🐍✨\n"
STYLE_TOKENS = {
    "starcoder": ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<file_sep>"],
    "deepseek": ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "<｜end▁of▁sentence｜>"],
    "codellama": ["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"],
}
PREFIX, SUFFIX = "def greet(name):\n    ", "\n    return msg\n"
EXTRA = [("util/a.py", "X = 1\n"), ("b.py", "Y = 'é'")]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    lines: list[str] = []
    for name in ("json.decoder", "json.encoder", "textwrap", "shlex"):
        lines += inspect.getsource(importlib.import_module(name)).splitlines(keepends=True)
    return lines[:800] + EXTRA_LINES


@pytest.fixture(scope="module")
def base_json(corpus: list[str]) -> str:
    return train_byte_level_bpe(corpus, VOCAB, fim_style=None).to_str()


@pytest.fixture(scope="module")
def qwen_dir(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = train_byte_level_bpe(corpus, VOCAB)
    path = tmp_path_factory.mktemp("qwen")
    save_tokenizer_dir(tok, path)
    gen = {"eos_token_id": [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|repo_name|>")]}
    (path / "generation_config.json").write_text(json.dumps(gen))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    return path


@pytest.fixture(scope="module")
def styled(base_json: str, qwen_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    toks = {"qwen": Tokenizer.from_dir(qwen_dir)}
    for style, specials in STYLE_TOKENS.items():
        tok = tokenizers.Tokenizer.from_str(base_json)
        tok.add_special_tokens(specials)
        path = tmp_path_factory.mktemp(style)
        save_tokenizer_dir(tok, path)
        toks[style] = Tokenizer.from_dir(path)
    return toks


@pytest.fixture(scope="module")
def qwen(styled: dict[str, Tokenizer]) -> Tokenizer:
    return styled["qwen"]


@pytest.fixture(scope="module")
def llama_like(corpus: list[str]) -> Tokenizer:
    """A Llama/CodeLlama-shaped tokenizer: "▁" for spaces, byte fallback, a Strip decoder."""
    norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.normalizer = norm
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400,
                                                                show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in trained["vocab"]:
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = norm
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens(specials + STYLE_TOKENS["codellama"])
    return Tokenizer(tok, eos_ids=[2])


def test_round_trip_non_ascii(qwen: Tokenizer, llama_like: Tokenizer) -> None:
    for tok in (qwen, llama_like):
        ids = tok.encode(TEXT)
        assert tok.decode(ids) == TEXT
        assert tok.decode(tok.encode_text(TEXT)) == TEXT
    assert qwen.vocab_size == VOCAB
    assert qwen.token_to_id("<|fim_prefix|>") is not None
    assert qwen.token_to_id("<no such token>") is None


def test_encode_recognises_special_strings(qwen: Tokenizer) -> None:
    eos = qwen.token_to_id("<|endoftext|>")
    assert eos in qwen.encode("x = 1<|endoftext|>")
    assert eos not in qwen.encode_text("x = 1<|endoftext|>")
    assert qwen.decode(qwen.encode("a<|endoftext|>b"), skip_special=True) == "ab"


@pytest.mark.parametrize("style", ["qwen", "starcoder", "deepseek", "codellama"])
def test_fim_detection(styled: dict[str, Tokenizer], style: str) -> None:
    tok = styled[style]
    names = {"qwen": ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
             "starcoder": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
             "deepseek": STYLE_TOKENS["deepseek"][:3],
             "codellama": STYLE_TOKENS["codellama"][:3]}[style]
    pre, suf, mid = (tok.token_to_id(n) for n in names)
    assert tok.fim is not None
    assert (tok.fim.style, tok.fim.prefix, tok.fim.suffix, tok.fim.middle) == (style, pre, suf, mid)
    has_sep = style in ("qwen", "starcoder")
    assert (tok.fim.pad is not None, tok.fim.file_sep is not None) == (has_sep, has_sep)
    assert tok.fim.eot is not None and tok.fim.eot in tok.stop_ids


def test_fim_tokens_for_trained_styles(corpus: list[str]) -> None:
    tok = Tokenizer(train_byte_level_bpe(corpus[:200], 400, fim_style="deepseek"))
    pre, suf, mid, eot = (tok.token_to_id(n) for n in STYLE_TOKENS["deepseek"])
    assert pre is not None and suf is not None and mid is not None
    assert tok.fim == FimTokens("deepseek", pre, suf, mid, eot=eot)


EXPECTED_PROMPTS = {
    "qwen": "<|file_sep|>util/a.py\nX = 1\n<|file_sep|>b.py\nY = 'é'\n"
            f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>",
    "starcoder": "<file_sep>util/a.py\nX = 1\n<file_sep>b.py\nY = 'é'\n"
                 f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>",
    "deepseek": f"<｜fim▁begin｜># util/a.py\nX = 1\n# b.py\nY = 'é'\n{PREFIX}"
                f"<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>",
    "codellama": f"▁<PRE> # util/a.py\nX = 1\n# b.py\nY = 'é'\n{PREFIX}▁<SUF>{SUFFIX}▁<MID>",
}


@pytest.mark.parametrize("style", list(EXPECTED_PROMPTS))
def test_fim_prompt(styled: dict[str, Tokenizer], style: str) -> None:
    tok = styled[style]
    fim = tok.fim
    assert fim is not None
    ids = tok.fim_prompt(PREFIX, SUFFIX, extra=EXTRA)
    seps = [fim.file_sep] * 2 if fim.file_sep is not None else []
    assert [i for i in ids if i in tok.special_ids] == [*seps, fim.prefix, fim.suffix, fim.middle]
    assert ids[-1] == fim.middle
    assert tok.decode(ids) == EXPECTED_PROMPTS[style]
    assert tok.decode(tok.fim_prompt(PREFIX, SUFFIX), skip_special=True).endswith(SUFFIX)
    # What moves while the user types at the end of the prefix starts at the suffix marker.
    assert tok.fim_parts(PREFIX, SUFFIX, extra=EXTRA) == (ids, ids.index(fim.suffix))


def test_spm_prompt_puts_the_suffix_first_and_ends_with_the_prefix(qwen_dir: Path,
                                                                 tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "config.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    assert Tokenizer.from_dir(tmp_path).fim_order == "psm"  # the default
    set_fim_order(tmp_path, "spm")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.fim_order == "spm" and tok.eos_ids == Tokenizer.from_dir(qwen_dir).eos_ids
    assert tok.decode(tok.fim_prompt(PREFIX, SUFFIX, extra=EXTRA)) == (
        "<|file_sep|>util/a.py\nX = 1\n<|file_sep|>b.py\nY = 'é'\n"
        f"<|fim_prefix|><|fim_suffix|>{SUFFIX}<|fim_middle|>{PREFIX}")
    # Typing only appends to the prompt: the cache keeps all but the prefix's last tokens.
    before = tok.fim_prompt(PREFIX, SUFFIX)
    after = tok.fim_prompt(PREFIX + "msg = f'hi {name}'", SUFFIX)
    assert after[:len(before) - 1] == before[:-1]
    assert tok.fim_parts(PREFIX, SUFFIX) == (before, len(before))  # all of it is stable


def test_fim_order_is_checked(qwen_dir: Path, styled: dict[str, Tokenizer],
                              tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fim_order"):
        set_fim_order(tmp_path, "pms")
    (tmp_path / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"fim_order": "middle-first"}')
    with pytest.raises(TokenizerError, match="middle-first"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="CodeLlama"):
        Tokenizer(styled["codellama"]._tok, fim_order="spm")


def test_fim_prompt_codellama_sentencepiece(llama_like: Tokenizer) -> None:
    fim = llama_like.fim
    assert fim is not None and fim.style == "codellama"
    assert llama_like.stop_ids == {2, llama_like.token_to_id("▁<EOT>")}
    ids = llama_like.fim_prompt("def f():", "pass\n")
    assert ids[:2] == [1, fim.prefix]  # the tokenizer's own BOS comes first
    suf, mid = ids.index(fim.suffix), ids.index(fim.middle)
    raw = [llama_like._tok.id_to_token(i) for i in ids]
    # "<PRE> {pre} <SUF>{suf} <MID>": one space after <PRE>, none after <SUF>.
    assert raw[2].startswith("▁") and not raw[2].startswith("▁▁")
    assert not raw[suf + 1].startswith("▁")
    assert llama_like.decode(ids[suf + 1:mid]) == "pass\n"
    assert llama_like.decode(ids) == "<s> <PRE> def f(): <SUF>pass\n <MID>"


def test_fim_prompt_cannot_be_injected(qwen: Tokenizer) -> None:
    fim = qwen.fim
    assert fim is not None
    prefix = "s = '<|fim_middle|>'\n<|endoftext|>"
    extra = [("<|file_sep|>x.py", "<|fim_suffix|>")]
    ids = qwen.fim_prompt(prefix, "<|fim_prefix|>", extra=extra)
    assert [i for i in ids if i in qwen.special_ids] == [fim.file_sep, fim.prefix, fim.suffix,
                                                         fim.middle]
    assert qwen.decode(ids) == ("<|file_sep|><|file_sep|>x.py\n<|fim_suffix|>\n<|fim_prefix|>"
                                f"{prefix}<|fim_suffix|><|fim_prefix|><|fim_middle|>")


def test_injection_with_non_special_fim_tokens(base_json: str) -> None:
    raw = tokenizers.Tokenizer.from_str(base_json)
    raw.add_tokens([*STYLE_TOKENS["starcoder"], "ordinary_piece"])  # added, not special
    tok = Tokenizer(raw)
    fim = tok.fim
    assert fim is not None and fim.style == "starcoder"
    ids = tok.fim_prompt("a<fim_middle>b", "<fim_prefix>")
    assert [i for i in ids if i in (fim.prefix, fim.suffix, fim.middle)] == [
        fim.prefix, fim.suffix, fim.middle]
    assert tok.encode("<fim_middle>") == [fim.middle]  # the shared tokenizer is unchanged
    assert tok.encode_text("x = ordinary_piece") == tok.encode("x = ordinary_piece")
    assert raw.token_to_id("ordinary_piece") in tok.encode_text("ordinary_piece")


def test_no_fim_tokens(base_json: str) -> None:
    tok = Tokenizer(tokenizers.Tokenizer.from_str(base_json))
    assert tok.fim is None
    with pytest.raises(TokenizerError, match="fill-in-the-middle"):
        tok.fim_prompt("a", "b")


def test_stop_ids(styled: dict[str, Tokenizer]) -> None:
    qwen = styled["qwen"]
    eot, repo = qwen.token_to_id("<|endoftext|>"), qwen.token_to_id("<|repo_name|>")
    assert qwen.eos_ids == {eot, repo, 7}
    stops = {eot, qwen.token_to_id("<|fim_pad|>"), qwen.token_to_id("<|file_sep|>")}
    assert qwen.stop_ids == qwen.eos_ids | stops
    for style in ("starcoder", "deepseek", "codellama"):
        tok = styled[style]
        expected = {tok.token_to_id(n) for n in
                    ["<|endoftext|>", *STYLE_TOKENS[style][3:]]} - {None}
        assert tok.stop_ids == expected
        assert tok.fim is not None and tok.fim.eot in tok.stop_ids | {None}


def test_eos_token_forms(base_json: str, tmp_path: Path) -> None:
    raw = tokenizers.Tokenizer.from_str(base_json)
    raw.add_special_tokens(["<|im_end|>"])
    save_tokenizer_dir(raw, tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|im_end|>", "special": True}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_ids == {3, raw.token_to_id("<|im_end|>")}
    assert tok.stop_ids == tok.eos_ids | {raw.token_to_id("<|endoftext|>")}


def _stream(tok: Tokenizer, ids: list[int], seed: int, skip_special: bool = True) -> list[str]:
    rng = random.Random(seed)
    dec, chunks, i = StreamDecoder(tok, skip_special), [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        chunks.append(dec.push(ids[i]) if n == 1 else dec.push_many(ids[i:i + n]))
        i += n
    return [*chunks, dec.flush()]


@pytest.mark.parametrize("which", ["qwen", "llama_like"])
def test_stream_matches_decode(which: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(which)
    for seed, text in enumerate([TEXT * 3, " leading space " + TEXT, "🎉🎉 中文\n" * 4]):
        ids = tok.encode(text)
        chunks = _stream(tok, ids, seed)
        assert all("\ufffd" not in c for c in chunks)
        assert "".join(chunks) == tok.decode(ids) == text


def test_stream_holds_partial_character(qwen: Tokenizer) -> None:
    emoji = qwen.encode("🎉")
    assert len(emoji) > 1  # split over byte tokens, or the test proves nothing
    dec = StreamDecoder(qwen)
    assert dec.push_many(qwen.encode("x = ")) == "x = "
    assert [dec.push(i) for i in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert dec.push(emoji[-1]) == "🎉"
    assert dec.flush() == ""


def test_stream_flush_partial(qwen: Tokenizer) -> None:
    emoji = qwen.encode("🎉")
    dec = StreamDecoder(qwen)
    assert dec.push_many(qwen.encode("ok")) == "ok"
    assert dec.push_many(emoji[:-1]) == ""
    rest = dec.flush()
    assert rest.endswith("\ufffd") and rest == qwen.decode(emoji[:-1])
    assert dec.flush() == ""


def test_stream_special_tokens(qwen: Tokenizer) -> None:
    eot = qwen.token_to_id("<|endoftext|>")
    assert eot is not None
    ids = [*qwen.encode("a é"), eot, *qwen.encode("b")]
    assert "".join(_stream(qwen, ids, 0)) == "a éb"
    assert "".join(_stream(qwen, ids, 0, skip_special=False)) == "a é<|endoftext|>b"


class _CountingTokenizer(Tokenizer):
    decoded = 0

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        self.decoded += len(ids)
        return super().decode(ids, skip_special)


def test_stream_is_linear(qwen_dir: Path) -> None:
    tok = _CountingTokenizer.from_dir(qwen_dir)
    ids = tok.encode(TEXT * 60)
    assert len(ids) > 1000
    dec = StreamDecoder(tok)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == TEXT * 60
    assert tok.decoded < 20 * len(ids)  # re-decoding everything would be ~len(ids)**2 / 2


def test_missing_and_corrupt_files(tmp_path: Path, qwen_dir: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="nope"):
        Tokenizer.from_dir(missing)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="nope"):
        Tokenizer.from_file(missing / "tokenizer.json")
    for bad in ("{ not json", "{}", "\xff\xfe"):
        (tmp_path / "tokenizer.json").write_bytes(bad.encode("latin-1"))
        with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "tokenizer.json"))):
            Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    (tmp_path / "generation_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match=r"generation_config\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="not a JSON object"):
        Tokenizer.from_dir(tmp_path)


def test_training_arguments(corpus: list[str], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="FIM style"):
        train_byte_level_bpe(corpus, VOCAB, fim_style="gpt")
    with pytest.raises(ValueError, match="vocab_size"):
        train_byte_level_bpe(corpus, 100)
    tok = train_byte_level_bpe(corpus[:50], 300, fim_style=None)
    with pytest.raises(ValueError, match="eos token"):
        save_tokenizer_dir(tok, tmp_path, eos_token="</s>")
