"""One generation: its parameters, its tokens, its text as it streams, stops and statistics.

`Engine.start()` returns a `Generation`, an iterator whose every `next()` runs one step (the
prefill, then one verify+draft step) and returns what it committed. A caller cancels by not
asking for the next step: the cache is consistent after every step. The generation owns its
sequence (the prompt, then every token the steps commit, the last one not yet run); the
engine's steps extend it, and tell the generation what each step committed.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.decode import quality
from engine.decode.indent import IndentFloor
from engine.decode.policy import TextKind, classify
from engine.decode.sampling import Sampling
from engine.decode.sources import DRAFTS
from engine.tokenizer import StreamDecoder, Tokenizer


@dataclass(slots=True)
class GenParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()  # in addition to the model's end tokens
    ignore_eos: bool = False  # the model's end tokens do not end it (timing steps)
    seed: int | None = None
    k: int | None = None  # None: adaptive; an int: that many drafts every step
    speculative: bool = True  # False: plain autoregressive decoding, no drafts at all
    drafts: str | None = None  # where drafts come from: "mtp", "context", "both"; None: the
    #                            engine's default
    forced: str = ""  # the output must start with this text, which is not returned (healing)
    stop_loops: bool = True  # end the output where it falls into a loop (see quality.py)
    indent_floor: int = 0  # end the output where a line is indented less (see indent.py)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.indent_floor < 0:
            raise ValueError(f"indent_floor must be >= 0, got {self.indent_floor}")
        if self.k is not None and self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        if self.drafts not in (None, *DRAFTS):
            raise ValueError(f"drafts must be one of {', '.join(DRAFTS)}, got {self.drafts!r}")


@dataclass(slots=True)
class Step:
    tokens: list[int]  # committed this step, after stop handling
    text: str  # new complete text
    k: int  # drafts verified (0 for the prefill and autoregressive steps)
    accepted: int


@dataclass(slots=True)
class Stats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    k_hist: Counter[int] = field(default_factory=Counter)
    accepted_by_pos: list[int] = field(default_factory=list)  # drafts accepted at position i
    verified_by_pos: list[int] = field(default_factory=list)  # drafts reached at position i
    # Per source of drafts ("mtp", "context", "given"): [steps, drafts verified, accepted].
    by_source: dict[str, list[int]] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    resumed: int = 0  # times the cache was rebuilt after another generation ran
    finish_reason: str | None = None  # "stop", "length", "repetition" (see quality.py)
    mean_logprob: float | None = None  # of the output's tokens, under the target
    min_logprob: float | None = None

    def record(self, k: int, accepted: int, seconds: float, source: str = "mtp") -> None:
        tally(self.by_source, source, k, accepted)
        self.steps += 1
        self.drafted += k
        self.accepted += accepted
        self.k_hist[k] += 1
        self.decode_s += seconds
        while len(self.verified_by_pos) < k:
            self.verified_by_pos.append(0)
            self.accepted_by_pos.append(0)
        for i in range(min(accepted + 1, k)):
            self.verified_by_pos[i] += 1
            self.accepted_by_pos[i] += i < accepted


def tally(table: dict[str, list[int]], source: str, k: int, accepted: int) -> None:
    """Count a step that verified k drafts of `source` (none: nothing to count) and kept
    `accepted`, in a table of [steps, drafts, accepted] per source."""
    if k:
        counts = table.setdefault(source, [0, 0, 0])
        counts[:] = [counts[0] + 1, counts[1] + k, counts[2] + accepted]


class Host(Protocol):
    """What a generation needs of the engine that runs it (an `Engine`)."""

    k_max: int  # the most drafts a step verifies
    mtp: bool  # whether the model has MTP modules to draft with
    draft_sources: str  # where drafts come from unless a generation says otherwise
    tokenizer: Tokenizer
    stop_ids: frozenset[int]

    def step(self, gens: Sequence[Generation]) -> list[Step | None]: ...


class Generation(Iterator[Step]):
    def __init__(self, engine: Host, prompt: list[int], params: GenParams,
                 slot: object = None, stable: int | None = None) -> None:
        """`stable`: how many prompt tokens come before the text that moves while the user
        types (see `prompt.Prompt`); None: all of them."""
        self.prompt, self.params, self.slot = list(prompt), params, slot
        self.stable = len(self.prompt) if stable is None else stable
        if not 0 <= self.stable <= len(self.prompt):
            raise ValueError(f"stable must be within the prompt's {len(self.prompt)} tokens, "
                             f"got {stable}")
        seed = params.seed if params.seed is not None else secrets.randbits(31)
        self.sampling = Sampling(params.temperature, params.top_p, seed)
        drafting, sources = params.speculative and engine.k_max > 0, \
            params.drafts or engine.draft_sources
        self.use_mtp = drafting and engine.mtp and sources != "context"
        # Drafts from the row's own tokens too (decode/context.py)
        self.use_context = drafting and sources != "mtp"
        self.sequence = list(prompt)  # then every committed token; the last is next to run
        self.tokens: list[int] = []  # the output, up to a stop
        self.text = ""
        self.finish_reason: str | None = None
        self.logprobs: list[float] = []  # of each output token, under the target model
        self.first_logprob: float | None = None  # the first token's, set by the prefill
        self.stats = Stats(prompt_tokens=len(prompt))
        self.kind = TextKind.CODE  # of the text being written: acceptance differs by kind
        self._engine = engine
        self._decoder = StreamDecoder(engine.tokenizer)
        self._stop_ids = (frozenset() if params.ignore_eos else engine.stop_ids) | \
            params.stop_ids
        self._tail = engine.tokenizer.decode(prompt[-64:])  # recent text, for the kind of text
        self._held = ""  # text that may begin a stop string, not yet returned
        self._unforced = params.forced  # forced text not yet removed from the output
        self._loops = quality.LoopWatch(engine.tokenizer.piece)
        self._block = IndentFloor(params.indent_floor)

    def __next__(self) -> Step:
        step = self._engine.step([self])[0]
        if step is None:
            raise StopIteration
        return step

    @property
    def started(self) -> bool:
        """Whether the prefill has committed the first token."""
        return len(self.sequence) > len(self.prompt)

    def tokens_left(self) -> int:
        return self.params.max_new_tokens - len(self.tokens)

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = self.stats.finish_reason = reason

    @property
    def confidence(self) -> quality.Confidence | None:
        """The output's scores (see quality.py); None before it has a token."""
        return quality.confidence(self.logprobs)

    def prefilled(self, reused: int, seconds: float) -> Step:
        """The prefill appended the first token to the sequence."""
        self.stats.reused_tokens, self.stats.prefill_s = reused, seconds
        first = [] if self.first_logprob is None else [self.first_logprob]
        return self._commit(self.sequence[-1:], first, k=0, accepted=0)

    def verified(self, new: list[int], k: int, seconds: float,
                 logprobs: list[float] | None = None, source: str = "mtp") -> Step:
        """A verify of k drafts (made by `source`) appended `new` to the sequence (the
        accepted drafts, then one of the target's own), with their log-probabilities;
        `seconds`: the step's cost (drafts, verify, commit)."""
        step = self._commit(new, logprobs or [], k=k, accepted=len(new) - 1)
        self.stats.record(k, len(new) - 1, seconds, source)
        return step

    def resumed(self) -> None:
        """Its slot's cache was rebuilt: another generation had run in it."""
        self.stats.resumed += 1

    def _commit(self, new: list[int], logprobs: list[float], *, k: int, accepted: int) -> Step:
        """Take tokens up to a stop token, a loop or the token limit, then apply stop
        strings."""
        kept: list[int] = []
        for tok in new:
            if tok in self._stop_ids:
                self.finish("stop")
                break
            kept.append(tok)
            if self.params.stop_loops and self._loops.push(tok):
                self.finish(quality.REPETITION)
                break
            if len(self.tokens) + len(kept) >= self.params.max_new_tokens:
                self.finish("length")
                break
        self.tokens.extend(kept)
        self.logprobs.extend(logprobs[:len(kept)])
        if (scores := self.confidence) is not None:
            self.stats.mean_logprob, self.stats.min_logprob = scores.mean_logprob, \
                scores.min_logprob
        text = self._decoder.push_many(kept)
        if self.finish_reason is not None:
            text += self._decoder.flush()
        if self._unforced:  # drop the forced text from the front of the output, once
            n = next((i for i, (a, b) in enumerate(zip(text, self._unforced, strict=False))
                      if a != b),
                     min(len(text), len(self._unforced)))
            text, self._unforced = text[n:], self._unforced[n:]
        text = self._apply_stop_strings(text)
        text = self._block.push(text, final=self.finish_reason is not None)
        if self._block.ended:
            self.finish("stop")
        self.text += text
        self._tail = (self._tail + text)[-256:]
        self.kind = classify(self._tail)
        return Step(kept, text, k, accepted)

    def _apply_stop_strings(self, text: str) -> str:
        """Cut at the first stop string; hold back a tail that may be the start of one."""
        stops = self.params.stop
        if not stops:
            return text
        buf, self._held = self._held + text, ""
        hits = [i for s in stops if (i := buf.find(s)) >= 0]
        if hits:
            self.finish("stop")
            return buf[:min(hits)]
        if self.finish_reason is not None:
            return buf
        hold = max((j for s in stops for j in range(1, len(s)) if buf.endswith(s[:j])), default=0)
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]
