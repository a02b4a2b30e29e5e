"""The engine: a loaded model with its tokenizer, KV-cache slots and K policy, stepping a
batch of generations.

A slot is kept per key, such as an editor's document, so that each keeps its prefix cached
while others run; the least recently used slot is recycled when all are taken. `step()` runs
one step of several generations in different slots as one batch: one trunk forward verifies
every row's drafts, one module forward per draft position drafts for every row. Eager on
every device today (see `decode/verify.py` for what a CUDA graph would need).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from engine import prompt as recipe
from engine.cache.slots import SlotCache, SlotTable
from engine.decode.draft import catch_up, draft
from engine.decode.policy import DraftChain, KPolicy, monotone
from engine.decode.prefill import prefill, restore
from engine.decode.rows import Drafts, Row
from engine.decode.sampling import Sampler
from engine.decode.verify import verify
from engine.generation import Generation, GenParams, Step
from engine.model.transformer import Transformer
from engine.model.weights import load_model
from engine.tokenizer import Tokenizer

PROMPT_SPARE = 4  # tokens a prompt leaves beyond the answer and a verify pass: markers, slack


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, max_seq_len: int = 4096,
                 k_max: int = 8, slots: int = 4) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_seq_len = min(max_seq_len, model.cfg.max_position_embeddings)
        self.slots = SlotTable(lambda: SlotCache(model, self.max_seq_len), slots)
        self.max_slots = slots
        self.k_max = k_max if model.num_mtp else 0
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
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

    # Prompts

    def prompt_budget(self, max_new_tokens: int) -> int:
        """The most prompt tokens that leave room for `max_new_tokens` and the verify pass
        after them: the one rule for the room a prompt may take."""
        return self.max_seq_len - max_new_tokens - self.k_max - PROMPT_SPARE

    def fill_in_prompt(self, prefix: str, suffix: str, *, max_new_tokens: int,
                       extra: Sequence[tuple[str, str]] = ()) -> recipe.Prompt:
        """The prompt for the code between `prefix` and `suffix` (see `prompt.fill_in`)."""
        return recipe.fill_in(self.tokenizer, prefix, suffix,
                              budget=self.prompt_budget(max_new_tokens), extra=extra)

    def text_prompt(self, text: str) -> recipe.Prompt:
        """The prompt that continues `text` (see `prompt.continuation`)."""
        return recipe.continuation(self.tokenizer, text)

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

    # Generations

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

    def clear_cache(self, slot: Hashable = None) -> None:
        """Forget what the slot's cache holds: its next prompt runs from scratch."""
        self.slots.get(slot).reset()

    def step(self, gens: Sequence[Generation]) -> list[Step | None]:
        """One step of each generation (None for one that has ended); the verify and draft
        steps of those past their prefill run as one batch. Each must have its own slot."""
        if len({g.slot for g in gens}) < len(gens) or len(gens) > self.max_slots:
            raise ValueError(f"a batch needs distinct slots, at most {self.max_slots}")
        steps: list[Step | None] = [None] * len(gens)
        batch = []
        for i, g in enumerate(gens):
            if g.finish_reason is not None:
                continue
            if not g.started:
                steps[i] = self._prefill(g)
            elif self._resume(g):
                batch.append(i)
        if not batch:
            return steps
        rows = [self._row(gens[i]) for i in batch]
        ks = [r.drafts.count for r in rows]
        kinds = [gens[i].kind for i in batch]  # the drafts were made in this kind of text
        t0 = time.perf_counter()
        news = verify(self.model, rows)
        seconds = time.perf_counter() - t0
        alone = len(batch) == 1  # only a step run alone tells the policy what its K costs
        for i, row, new, k, kind in zip(batch, rows, news, ks, kinds, strict=True):
            g, cost = gens[i], seconds + row.drafts.seconds
            steps[i] = g.verified(new, k, cost)
            if g.use_mtp and g.params.k is None:
                self.policy.observe(kind, k, len(new) - 1, cost if alone else None,
                                    row.drafts.confidence[:k])
        self._draft([gens[i] for i in batch if gens[i].finish_reason is None])
        return steps

    def _row(self, g: Generation) -> Row:
        return Row(self.slots.get(g.slot), g.sequence, g.sampler, g.drafts)

    def _prefill(self, g: Generation) -> Step:
        """The first step: run the prompt, commit the first token, draft the next ones."""
        t0 = time.perf_counter()
        row = self._row(g)
        _, reused = prefill(self.model, row, self.tokens_starting_with(g.params.forced))
        if g.use_mtp:  # the modules take in the prompt too: prefill work, not a step's
            catch_up(self.model, [row])
        step = g.prefilled(reused, time.perf_counter() - t0)
        if g.finish_reason is None:
            self._draft([g])
        return step

    def _resume(self, g: Generation) -> bool:
        """Before a verify: take the slot back if another generation ran in it (the rebuild
        is not a step's cost), and end the generation if the context is full."""
        row = self._row(g)
        if not row.slot.holds(g.sequence):
            restore(self.model, row)
            if g.use_mtp:
                catch_up(self.model, [row])
            g.resumed()
            self._draft([g])
        if g.drafts.count + 1 > row.slot.room():
            g.finish("length")  # the context is full
            return False
        return True

    def _draft(self, gens: list[Generation]) -> None:
        """Draft the next step of each generation, in one batch (of one, after a prefill or
        a rebuild)."""
        if not gens:
            return
        t0 = time.perf_counter()
        rows = [self._row(g) for g in gens]
        plans = [self._plan(g, r) for g, r in zip(gens, rows, strict=True)]
        room = min(r.slot.room() for r in rows) - 2  # padded rows need it too
        draft(self.model, rows, [max(0, min(k, room)) for k, _ in plans],
              [chain.more if chain else None for _, chain in plans])
        for g in gens:
            g.drafts.seconds = time.perf_counter() - t0

    def _plan(self, g: Generation, row: Row) -> tuple[int, DraftChain | None]:
        """Drafts for the next step, within what is left to generate and the room in the
        context: a fixed K, or (adaptive) up to k_max with the policy's rule for stopping
        after each draft, when the policy drafts at all."""
        if not g.use_mtp:
            return 0, None
        fixed, policy = g.params.k, self.policy
        if fixed is None:  # draft at all? then up to k_max, the chain deciding where to stop
            chosen = policy.choose(g.kind)
            k = self.k_max if chosen else 0
        else:
            k = fixed
        k = max(0, min(k, self.k_max, g.tokens_left() - 1, row.slot.room() - 2))
        if fixed is not None or not k:
            return k, None
        return k, policy.chain(floor=chosen if policy.probing else 1)

    # Step costs

    def calibrate(self) -> None:
        """Measure the step cost of every K on this machine for the K policy."""
        self.policy.set_costs(self.measure_costs())

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
        greedy = Sampler(0.0, 1.0, 0, self.device)
        n = max(1, min(context, self.max_seq_len // 2))
        vocab = self.model.cfg.vocab_size
        warm = [(i * 7919 + 13) % vocab for i in range(n)]
        slot = self.slots.get(None)
        slot.reset()
        row = Row(slot, list(warm), greedy, Drafts.empty(self.k_max, self.device))
        first, _ = prefill(self.model, row)
        catch_up(self.model, [row])
        times: list[list[float]] = [[] for _ in range(self.k_max + 1)]
        for _ in range(reps + 1):  # the first round warms up every K's shapes
            for k in range(self.k_max + 1):
                if k + 2 > slot.room():  # a short context fills up: start over
                    row.seq = [*warm, first]
                    restore(self.model, row)
                    catch_up(self.model, [row])
                t0 = time.perf_counter()
                draft(self.model, [row], [k])
                verify(self.model, [row])
                times[k].append(time.perf_counter() - t0)
        slot.reset()
        return monotone([statistics.median(t[1:]) for t in times])
