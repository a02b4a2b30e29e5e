"""Generation: the step loop with stops, streaming text, the K policy and cancellation.

`Engine.start()` returns a `Generation`, an iterator whose every `next()` runs one step (the
prefill, then one verify+draft step) and returns what it committed. A caller cancels by not
asking for the next step: the cache is consistent after every step.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.model import Transformer
from engine.policy import DraftChain, KPolicy, TextKind, classify
from engine.runner import Runner, Sampler, draft_many, verify_many
from engine.tokenizer import StreamDecoder, Tokenizer
from engine.weights import load_model


@dataclass(slots=True)
class GenParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    stop_ids: frozenset[int] = frozenset()  # in addition to the model's end tokens
    seed: int | None = None
    k: int | None = None  # None: adaptive; an int: that many drafts every step
    speculative: bool = True  # False: plain autoregressive decoding, MTP modules unused
    forced: str = ""  # the output must start with this text, which is not returned (healing)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.k is not None and self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")


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
    prefill_s: float = 0.0
    decode_s: float = 0.0
    resumed: int = 0  # times the cache was rebuilt after another generation ran


class Engine:
    """A loaded model with its tokenizer, K policy and a few KV-cache slots.

    A slot (one `Runner`: caches and buffers for one sequence) is kept per key, such as an
    editor's document, so that each keeps its prefix cached while others run; the least
    recently used slot is recycled when all are taken. `step()` runs one step of several
    generations in different slots as one batch: one trunk forward verifies every row's
    drafts, one module forward per draft position drafts for every row.
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, max_seq_len: int = 4096,
                 k_max: int = 8, slots: int = 4) -> None:
        if slots < 1:
            raise ValueError(f"need at least one KV-cache slot, got {slots}")
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = min(max_seq_len, model.cfg.max_position_embeddings)
        self.max_slots = slots
        first = Runner(model, self.max_seq_len, k_max)
        self._slots: OrderedDict[Hashable, Runner] = OrderedDict({None: first})
        self.k_max, self.device, self.dtype = first.k_max, first.device, first.dtype
        # A nominal cost model (a draft costs a fifth of a verify) until calibrate() measures.
        self.policy = KPolicy(self.k_max, [1.0 + 0.2 * k for k in range(self.k_max + 1)])
        self.stop_ids = frozenset(tokenizer.stop_ids) | frozenset(model.cfg.eos_token_ids)
        self.model_dir: Path | None = None  # where it was loaded from, if from files
        self._masks: dict[str, torch.Tensor] = {}

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu",
             dtype: torch.dtype = torch.float32, **kw: int) -> Engine:
        model = load_model(model_dir, device=device, dtype=dtype)
        engine = cls(model, Tokenizer.from_dir(model_dir), **kw)
        engine.model_dir = Path(model_dir)
        engine.calibrate()
        return engine

    def calibrate(self) -> None:
        """Measure the step cost of every K on this machine for the K policy."""
        self.policy.set_costs(self.measure_costs())

    def tokens_starting_with(self, text: str) -> torch.Tensor | None:
        """A mask of the vocabulary's tokens whose text starts with `text` (None for "")."""
        if not text:
            return None
        if text not in self._masks:
            vocab = self.model.cfg.vocab_size
            texts = [self.tokenizer.decode([i]) for i in range(min(vocab,
                                                                   self.tokenizer.vocab_size))]
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[[i for i, t in enumerate(texts) if t.startswith(text)]] = True
            if not mask.any():
                raise ValueError(f"no token starts with {text!r}")
            self._masks[text] = mask.to(self.device)
        return self._masks[text]

    @property
    def runner(self) -> Runner:
        """The default slot's runner."""
        return self.runner_for(None)

    def runner_for(self, slot: Hashable) -> Runner:
        """The slot's runner, made most recently used; a new slot recycles the least."""
        if slot in self._slots:
            self._slots.move_to_end(slot)
            return self._slots[slot]
        if len(self._slots) < self.max_slots:
            runner = Runner(self.model, self.max_seq_len, self.k_max)
        else:
            _, runner = self._slots.popitem(last=False)
            runner.reset()
        self._slots[slot] = runner
        return runner

    def start(self, prompt: list[int], params: GenParams | None = None, *,
              slot: Hashable = None) -> Generation:
        return Generation(self, prompt, params or GenParams(), slot)

    def generate(self, prompt: list[int], params: GenParams | None = None, *,
                 slot: Hashable = None, on_step: Callable[[Step], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> Generation:
        """Run a generation to its end (or until `cancelled()` says so after a step)."""
        gen = self.start(prompt, params, slot=slot)
        for step in gen:
            if on_step:
                on_step(step)
            if cancelled and cancelled():
                gen.finish("cancelled")
                break
        return gen

    def step(self, gens: Sequence[Generation]) -> list[Step | None]:
        """One step of each generation (None for one that has ended); the verify and draft
        steps of those past their prefill run as one batch. Each must have its own slot."""
        if len({g.slot for g in gens}) < len(gens) or len(gens) > self.max_slots:
            raise ValueError(f"a batch needs distinct slots, at most {self.max_slots}")
        steps: list[Step | None] = [None] * len(gens)
        batch, draft_s = [], []
        for i, g in enumerate(gens):
            if g.finish_reason is not None:
                continue
            if not g._started:
                steps[i] = g._prefill()
            elif (s := g._ready()) is not None:
                batch.append(i)
                draft_s.append(s)
        if not batch:
            return steps
        runners = [self.runner_for(gens[i].slot) for i in batch]
        ks = [r.num_drafts for r in runners]
        t0 = time.perf_counter()
        new_by_row: dict[int, list[int]] = {}
        for group in _padding_groups(runners, max(ks)):
            news = verify_many([runners[b] for b in group], [gens[batch[b]].sampler
                                                             for b in group])
            new_by_row.update(zip(group, news, strict=True))
        seconds = time.perf_counter() - t0
        alone = len(batch) == 1
        for b, i in enumerate(batch):
            steps[i] = gens[i]._verified(new_by_row[b], ks[b], seconds + draft_s[b], alone=alone)
            runners[b].owner = gens[i]
        self._draft([gens[i] for i in batch if gens[i].finish_reason is None])
        return steps

    def _draft(self, gens: list[Generation]) -> None:
        """Draft the next step of each generation, in one batch (of one, after a prefill or
        a rebuild)."""
        if not gens:
            return
        t0 = time.perf_counter()
        runners = [self.runner_for(g.slot) for g in gens]
        plans = [g._choose_k(r) for g, r in zip(gens, runners, strict=True)]
        room = min(r.max_seq_len - r.length for r in runners) - 2  # padded rows need it too
        draft_many(runners, [max(0, min(k, room)) for k, _ in plans], [g.sampler for g in gens],
                   [chain.more if chain else None for _, chain in plans])
        for g in gens:
            g._draft_s = time.perf_counter() - t0

    def measure_costs(self, reps: int = 7, context: int = 1024) -> list[float]:
        """Seconds per step for each K (verify of K+1 tokens plus K draft steps), at a
        context as long as an editor's prompt: attention over it is a good part of a step's
        cost. The Ks take turns, round after round, so that a disturbance of the machine
        (another process, a frequency change) spreads over all of them instead of bending
        one; each K's cost is the median of its `reps` rounds, made monotone (more drafts
        never cost less). The curve is not a line: on a CPU a verify of 3 to 6 tokens costs
        about what one of 2 does."""
        if self.k_max == 0:
            return [1.0]
        r, greedy = self.runner, Sampler(0.0, 1.0, 0, self.device)
        n = max(1, min(context, self.max_seq_len // 2))
        vocab = self.model.cfg.vocab_size
        warm = [(i * 7919 + 13) % vocab for i in range(n)]
        r.reset()
        first, _ = r.prefill(warm, greedy)
        r.catch_up()
        times: list[list[float]] = [[] for _ in range(self.k_max + 1)]
        for _ in range(reps + 1):  # the first round warms up every K's shapes
            for k in range(self.k_max + 1):
                if r.length + k + 2 > r.max_seq_len:  # a short context fills up: start over
                    r.restore(warm, first)
                    r.catch_up()
                t0 = time.perf_counter()
                r.draft(k, greedy)
                r.verify(greedy)
                times[k].append(time.perf_counter() - t0)
        r.reset()
        return monotone([statistics.median(t[1:]) for t in times])


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _padding_groups(runners: list[Runner], k_top: int) -> list[list[int]]:
    """Rows that can verify together padded to k_top drafts, then each row without the room
    for that padding on its own."""
    short = [b for b, r in enumerate(runners) if r.length + k_top + 1 > r.max_seq_len]
    rest = [b for b in range(len(runners)) if b not in short]
    return [rest, *([b] for b in short)] if rest else [[b] for b in short]


class Generation(Iterator[Step]):
    def __init__(self, engine: Engine, prompt: list[int], params: GenParams,
                 slot: Hashable = None) -> None:
        self.engine, self.prompt, self.params, self.slot = engine, list(prompt), params, slot
        self.sampler = Sampler(params.temperature, params.top_p, params.seed, engine.device)
        self.use_mtp = params.speculative and engine.k_max > 0
        self.tokens: list[int] = []  # the output, up to a stop
        self._committed: list[int] = []  # every token the runner committed for this sequence
        self.text = ""
        self.finish_reason: str | None = None
        self.stats = Stats(prompt_tokens=len(prompt))
        self._decoder = StreamDecoder(engine.tokenizer)
        self._stop_ids = engine.stop_ids | params.stop_ids
        self._tail = engine.tokenizer.decode(prompt[-64:])  # recent text, for the kind of text
        self._kind = TextKind.CODE
        self._started = False
        self._held = ""  # text that may begin a stop string, not yet returned
        self._unforced = params.forced  # forced text not yet removed from the output
        self._draft_s = 0.0

    def __next__(self) -> Step:
        step = self.engine.step([self])[0]
        if step is None:
            raise StopIteration
        return step

    def _prefill(self) -> Step:
        """The first step: run the prompt, commit the first token, draft the next ones."""
        r, t0 = self.engine.runner_for(self.slot), time.perf_counter()
        self._started = True
        allowed = self.engine.tokens_starting_with(self.params.forced)
        first, self.stats.reused_tokens = r.prefill(self.prompt, self.sampler, allowed)
        if self.use_mtp:  # the modules take in the prompt too: prefill work, not a step's
            r.catch_up()
        self.stats.prefill_s = time.perf_counter() - t0
        step = self._commit([first], k=0, accepted=0)
        r.owner = self
        if self.finish_reason is None:
            self.engine._draft([self])
        return step

    def _ready(self) -> float | None:
        """Before a verify: take the cache back if another generation ran in this slot (the
        rebuild is not a step's cost), and end if the context is full. Returns the seconds
        the pending drafts took, or None when it ended."""
        r = self.engine.runner_for(self.slot)
        if r.owner is not self:
            r.restore(self.prompt + self._committed[:-1], self._committed[-1])
            if self.use_mtp:
                r.catch_up()
            r.owner = self
            self.stats.resumed += 1
            self.engine._draft([self])
        if r.length + r.num_drafts + 1 > r.max_seq_len:
            self.finish("length")  # the context is full
            return None
        return self._draft_s

    def _verified(self, new: list[int], k: int, seconds: float, *, alone: bool) -> Step:
        """Commit what a verify of k drafts returned; `seconds`: the step's cost (drafts,
        verify, commit). Only a step run alone tells the K policy what its K costs."""
        kind = self._kind  # the drafts were made in this kind of text
        step = self._commit(new, k=k, accepted=len(new) - 1)
        self._record(k, len(new) - 1, seconds if alone else None, kind)
        self.stats.decode_s += seconds
        return step

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason

    def _choose_k(self, r: Runner) -> tuple[int, DraftChain | None]:
        """Drafts for the next step, within what is left to generate and the room in the
        context: a fixed K, or (adaptive) up to k_max with the policy's rule for stopping
        after each draft, when the policy drafts at all."""
        if not self.use_mtp:
            return 0, None
        fixed, policy = self.params.k, self.engine.policy
        if fixed is None:  # draft at all? then up to k_max, the chain deciding where to stop
            chosen = policy.choose(self._kind)
            k = self.engine.k_max if chosen else 0
        else:
            k = fixed
        room = r.max_seq_len - r.length - 2
        k = max(0, min(k, self.engine.k_max, self.params.max_new_tokens - len(self.tokens) - 1,
                       room))
        if fixed is not None or not k:
            return k, None
        return k, DraftChain(policy, floor=chosen if policy.probing else 1)

    def _record(self, k: int, accepted: int, seconds: float | None, kind: TextKind) -> None:
        s = self.stats
        s.steps += 1
        s.drafted += k
        s.accepted += accepted
        s.k_hist[k] += 1
        while len(s.verified_by_pos) < k:
            s.verified_by_pos.append(0)
            s.accepted_by_pos.append(0)
        for i in range(min(accepted + 1, k)):
            s.verified_by_pos[i] += 1
            s.accepted_by_pos[i] += i < accepted
        if self.use_mtp and self.params.k is None:
            confidence = self.engine.runner_for(self.slot).draft_confidence
            self.engine.policy.observe(kind, k, accepted, seconds, confidence[:k])

    def _commit(self, new: list[int], *, k: int, accepted: int) -> Step:
        """Append tokens up to a stop token or the token limit, then apply stop strings."""
        self._committed.extend(new)
        kept: list[int] = []
        for tok in new:
            if tok in self._stop_ids:
                self.finish("stop")
                break
            kept.append(tok)
            if len(self.tokens) + len(kept) >= self.params.max_new_tokens:
                self.finish("length")
                break
        self.tokens.extend(kept)
        text = self._decoder.push_many(kept)
        if self.finish_reason is not None:
            text += self._decoder.flush()
        if self._unforced:  # drop the forced text from the front of the output, once
            n = next((i for i, (a, b) in enumerate(zip(text, self._unforced, strict=False))
                      if a != b),
                     min(len(text), len(self._unforced)))
            text, self._unforced = text[n:], self._unforced[n:]
        text = self._apply_stop_strings(text)
        self.text += text
        self._tail = (self._tail + text)[-256:]
        self._kind = classify(self._tail)
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
