"""Prompts for a remote server, and the FIM layouts the daemon writes and reads: plain code,
no server needed (tests/test_remote.py runs them against one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.backends import openai as remote
from daemon.backends.prompts import (
    InfillPrompts,
    TemplatePrompts,
    TokenizerPrompts,
    fit_lines,
    hf_cache_dir,
    prompt_builder,
)
from daemon.config import FIM_TEMPLATES
from daemon.fim import LAYOUTS, read_any
from daemon.scheduler import Work
from engine import Engine

PREFIX, SUFFIX = "import os\n\n\ndef walk(top):\n    for ", "\n    return top\n"


def test_the_remote_prompt_is_the_one_the_local_engine_builds(trained_engine: Engine,
                                                              trained_dir: Path) -> None:
    prompts = TokenizerPrompts(trained_dir, context=512)
    work = Work(PREFIX, SUFFIX, (("util.py", "X = 1\n"),), max_tokens=16)
    built = prompts.build(work)
    local = trained_engine.fill_in_prompt(PREFIX, SUFFIX, max_new_tokens=16,
                                          extra=[("util.py", "X = 1\n")])
    assert built.endpoint == "completions" and built.body["prompt"] == local.ids
    assert built.forced == local.forced == " "  # token healing: the answer starts with it
    plain = prompts.build(Work("def f(x):\n    return"))
    assert plain.body["prompt"] == trained_engine.text_prompt("def f(x):\n    return").ids


def test_healing_takes_the_forced_start_off_the_stream() -> None:
    stream = remote._Stream("completions", forced=" ")
    chunks = [{"choices": [{"text": t}]} for t in ("", " x", " + 1")]
    assert "".join(stream.read(c) for c in chunks) + stream.flush() == "x + 1"
    other = remote._Stream("completions", forced=" ")  # an answer without it stays whole
    assert other.read({"choices": [{"text": "(x)"}]}) + other.flush() == "(x)"


def test_llama_servers_timings_are_the_servers_own_time() -> None:
    stream = remote._Stream("infill", forced="", sent=100.0)
    stream.read({"content": "a", "stop": False})
    assert stream.usage(100.005).hop_s == 0.0  # unknown until the server says
    stream.read({"content": "", "stop": True, "stop_type": "limit", "timings": {
        "cache_n": 30, "prompt_n": 5, "prompt_ms": 2.0, "predicted_n": 7, "predicted_ms": 8.0}})
    u = stream.usage(100.013)
    assert stream.finish == "length" and (u.tokens, u.prompt_tokens, u.reused_tokens) == (7, 35, 30)
    assert u.hop_s == pytest.approx(0.003)  # 13 ms round trip, 10 ms of them the server's


def test_openais_log_probabilities_score_the_answer_and_its_tokens_feed_the_loop_rule() -> None:
    """vLLM and SGLang stream OpenAI's legacy `logprobs` (llama-server's own shape runs
    against the real server in test_remote.py): each chunk's tokens score the answer, and
    their texts are what the loop rule sees."""
    stream = remote._Stream("completions", forced="")
    for text, lps in [(" a list of", [-0.5, -1.0, -0.25]), (" a list of", [-0.5, -0.25, -0.25])]:
        pieces = [" a", " list", " of"]
        stream.read({"choices": [{"text": text, "logprobs": {
            "tokens": pieces, "token_logprobs": lps, "top_logprobs": None}}]})
    u = stream.usage(0.0)
    assert (u.mean_logprob, u.min_logprob) == (pytest.approx(-2.75 / 6), -1.0)
    assert not stream.looped  # twice is not yet a loop
    stream.read({"choices": [{"text": " a list of", "logprobs": {
        "tokens": [" a", " list", " of"], "token_logprobs": [None, -0.5, -0.5]}}]})
    assert stream.looped and stream.finish == "repetition"
    assert stream.usage(0.0).min_logprob == -1.0
    quiet = remote._Stream("completions", forced="", loops=False)  # stop_loops off
    for _ in range(4):
        quiet.read({"choices": [{"text": " a list of"}]})
    assert not quiet.looped and quiet.usage(0.0).mean_logprob is None  # no scores given


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_layout_reads_back_what_it_writes(name: str) -> None:
    layout = LAYOUTS[name]
    extra = (("a/util.py", "X = 1\n"),)
    written = layout.write(PREFIX, SUFFIX, extra)
    prefix, suffix, context = read_any(written) or ("", "", ())
    if layout.file_sep:
        assert (prefix, suffix, context) == (PREFIX, SUFFIX, extra)
    else:  # no separator: the other file is a comment at the prefix's start
        assert (prefix, suffix, context) == ("# a/util.py\nX = 1\n" + PREFIX, SUFFIX, ())
    spm = f"{layout.prefix}{layout.suffix}{SUFFIX}{layout.middle}{PREFIX}"
    if not layout.spaced:
        assert layout.read(spm) == (PREFIX, SUFFIX, ())
    assert read_any("def f(x):\n    return x\n") is None


def test_a_template_prompt_keeps_editor_text_from_ending_a_part() -> None:
    prompts = TemplatePrompts("qwen", context=256)
    hostile = "x = '<|fim_middle|>'\n" + PREFIX
    prompt = prompts.build(Work(hostile, SUFFIX, max_tokens=16)).body["prompt"]
    assert prompt.count("<|fim_middle|>") == 1 and prompt.endswith("<|fim_middle|>")
    long = "".join(f"line = {i}\n" for i in range(1000)) + PREFIX  # cut to the budget
    cut = prompts.build(Work(long, SUFFIX, max_tokens=16)).body["prompt"]
    assert len(LAYOUTS["qwen"].plain(cut)) <= (256 - 16) * 3  # about 3 characters a token
    assert cut.endswith(f"{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>")


def test_infill_sends_the_parts_as_they_are() -> None:
    built = InfillPrompts().build(Work(PREFIX, SUFFIX, (("u.py", "X = 1\n"),)))
    assert built.endpoint == "infill" and built.body == {
        "input_prefix": PREFIX, "input_suffix": SUFFIX,
        "input_extra": [{"filename": "u.py", "text": "X = 1\n"}]}


def test_without_a_tokenizer_or_template_the_backend_says_what_to_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache at .* set tokenizer"):
        prompt_builder(tokenizer=None, served_model="org/unknown-model", fim_template=None,
                       context=1024)
    assert set(FIM_TEMPLATES) == {*LAYOUTS, "infill"}


def test_the_served_models_tokenizer_is_found_in_the_hugging_face_cache(
        trained_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's layout (models--ORG--NAME/snapshots/REV, refs/main naming one), offline."""
    repo = tmp_path / "hf" / "hub" / "models--org--coder-7b"
    for rev in ("aaa", "bbb"):
        (repo / "snapshots" / rev).mkdir(parents=True)
        (repo / "snapshots" / rev / "tokenizer.json").write_bytes(
            (trained_dir / "tokenizer.json").read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("aaa\n")
    env = {"HF_HOME": str(tmp_path / "hf")}
    assert hf_cache_dir("org/coder-7b", env) == repo / "snapshots" / "aaa"
    assert hf_cache_dir("org/other", env) is None
    assert hf_cache_dir("org/coder-7b", {"HF_HUB_CACHE": str(tmp_path / "none")}) is None
    (repo / "refs" / "main").write_text("gone")  # a ref without its snapshot: the newest one
    assert hf_cache_dir("org/coder-7b", env) is not None
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    prompts = prompt_builder(tokenizer=None, served_model="org/coder-7b", fim_template=None,
                             context=512)
    assert isinstance(prompts, TokenizerPrompts) and "models--org--coder-7b" in prompts.description


def test_fit_lines_keeps_whole_lines() -> None:
    assert fit_lines("a\nbb\nccc\n", 7, from_end=True) == "bb\nccc\n"
    assert fit_lines("a\nbb\nccc\n", 5, from_end=False) == "a\nbb\n"
    assert fit_lines("x" * 50, 10, from_end=True) == "x" * 10
