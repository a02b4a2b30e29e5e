"""The engine: a loaded model with its tokenizer, KV-cache slots and K policy, stepping a
batch of generations.

A slot is kept per key, such as an editor's document, so that each keeps its prefix cached
while others run; the least recently used slot is recycled when all are taken. `step()` runs
one step of several generations in different slots as one batch (`decode/step.py`): one
trunk forward verifies every row's drafts, the modules catch up and draft for every row,
and the host reads the result once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from engine import prompt as recipe
from engine.cache.kv import span_of
from engine.cache.slots import Caches, Slot, SlotTable
from engine.decode import draft_vocab as reduced
from engine.decode.draft import catch_up, draft_chain
from engine.decode.forced import ForcedStarts
from engine.decode.policy import KPolicy
from engine.decode.prefill import PrefillRow, first_tokens, kv_blocks, prefill
from engine.decode.sampling import RowSampling
from engine.decode.sources import DRAFTS
from engine.decode.state import DecodeState
from engine.decode.step import Shape, decode_step, unpack, unpack_logprobs
from engine.drafting import Drafting, Plan, pending
from engine.exec.calibration import CalibrationStore, calibrate
from engine.exec.compile import step_fns
from engine.exec.graphs import StepGraphs
from engine.exec.invariance import Invariance, promised
from engine.generation import Generation, GenParams, Step
from engine.model.hub import assistant_for, resolve_model
from engine.model.quant import QuantCache, quantize_model, resolve
from engine.model.transformer import Transformer
from engine.model.weights import load_assistant, load_model
from engine.paths import cache_dir, checkpoint_identity
from engine.tokenizer import Tokenizer

PROMPT_SPARE = 4  # tokens a prompt leaves beyond the answer and a verify pass: markers, slack


class Engine:
    def __init__(self, model: Transformer, tokenizer: Tokenizer, *, max_seq_len: int = 4096,
                 k_max: int = 8, slots: int = 4, compile: bool | None = None,
                 graphs: bool | None = None, exact: bool | None = None,
                 fixed_shapes: bool | None = None, quant: str = "none",
                 quant_cache: QuantCache | None = None, calibration: CalibrationStore | None = None,
                 draft_vocab: int = reduced.SIZE, drafts: str = "both",
                 rings: bool = True) -> None:
        """`quant`: quantized matmuls (model/quant.py), codes kept in `quant_cache`; what
        `calibrate()` measures is kept in `calibration`; drafts score `draft_vocab` tokens,
        and come from `drafts` unless a generation says otherwise (decode/sources.py);
        `rings` False: sliding-window layers keep caches as long as the context (cache/ring.py)."""
        if drafts not in DRAFTS:
            raise ValueError(f"drafts must be one of {', '.join(DRAFTS)}, got {drafts!r}")
        self.draft_sources = drafts
        self.model, self.tokenizer = model, tokenizer
        self.calibration = calibration
        # Quantized, the fused projections' weights are made only where the cache lacks
        # their codes; the draft head's rows are quantized with the rest.
        model.fuse(weights=resolve(model, quant) == "none")
        reduced.install(model, tokenizer, draft_vocab)
        quantize_model(model, quant, quant_cache)
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.max_seq_len = min(max_seq_len, model.cfg.max_position_embeddings)
        self.max_slots = slots
        self.k_max = k_max  # drafts from the modules or the context (decode/sources.py)
        self.mtp = model.drafts  # MTP modules, or an assistant in their place
        self.width = self.k_max + 1  # the widest verify
        # Step shapes that give every row its plain decoding's bits (exec/invariance.py).
        self.invariance = Invariance(self.width, batch_invariant=False, key_invariant=False)
        # Whether to pay for that where it costs: in fp32 on the CPU (a one-row matmul rounds
        # unlike a many-row one) speed wins by default, and output may differ from plain
        # decoding at near-ties. Auto gives it up where the device cannot keep it; True refuses.
        auto = self.dtype != torch.float32 or self.device.type != "cpu"
        self.exact_asked, self.exact = exact, auto if exact is None else exact
        self.exactness = promised(exact, self.exact)  # what `ahead status` says of it
        self.load_seconds: dict[str, float] = {}  # where loading went: Engine.load, calibrate
        # One slot more than asked for: padding rows run in it (see `_run`).
        self.caches = Caches(model, slots + 1, self.max_seq_len, scratch=2 * self.width + 1,
                             widest=self.width, rings=rings)
        self.slots = SlotTable(slots, self.max_seq_len, recurrent=model.cfg.hybrid,
                               checkpoints=self.caches.checkpoints, ring=self.caches.ring)
        self.state = DecodeState(slots + 1, self.k_max, model.cfg.vocab_size, self.device)
        self._pad_slot = slots
        # How the step runs: eager, compiled, or replayed as CUDA graphs (by default on CUDA).
        # Graphs and compiled steps run one shape, but for compiled blocks in eager shapes on
        # the CPU (exec/compile.py); eager steps take the narrowest that keeps rows exact.
        cuda = self.device.type == "cuda"
        self.graphs = cuda if graphs is None else graphs
        if self.graphs and not cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self.compiled = cuda if compile is None else compile
        self.static = self.graphs or (self.compiled and (cuda or self.exact)) \
            if fixed_shapes is None else fixed_shapes
        self.fns = step_fns(model, self.compiled, self.static)
        model.set_exact(self.exact or self.static)  # compiled: Inductor fuses attention
        self.early_exit = not self.static  # see decode/draft.py
        self._graphed = (StepGraphs(self._call_step, self.state, slots, slots)
                         if self.graphs else None)
        # A nominal cost model (a draft costs a fifth of a verify) until calibrate() measures.
        self.policy = KPolicy(self.k_max, [1.0 + 0.2 * k for k in range(self.k_max + 1)])
        self.drafting = Drafting(self.policy, self.state, self.k_max)
        self.stop_ids = frozenset(tokenizer.stop_ids) | frozenset(model.cfg.eos_token_ids)
        self.model_dir: Path | None = None  # where it was loaded from, if from files
        self.forced = ForcedStarts(tokenizer, model.cfg.vocab_size, self.device)  # healing

    @classmethod
    def load(cls, model_dir: str | Path, *, device: str = "cpu",
             dtype: torch.dtype | None = torch.float32, max_seq_len: int = 4096,
             k_max: int = 8, slots: int = 4, compile: bool | None = None,
             graphs: bool | None = None, exact: bool | None = None,
             fixed_shapes: bool | None = None, quant: str = "none",
             quant_cache: Path | None = None, draft_vocab: int = reduced.SIZE,
             drafts: str = "both", mtp: bool = True, draft_model: str | Path | None = None,
             rings: bool = True) -> Engine:
        """`dtype` None: the quantization's (quant.run_dtype); `quant_cache`: the codes' place
        (~/.cache/ahead/quant; calibrations beside it); `mtp` False: the trunk alone (drafts
        from the context); `draft_model`: a Gemma 4 assistant (a directory or a name) drafting
        in their place, by default `<name>-assistant` beside the model in the HF cache."""
        found = assistant_for(model_dir, draft_model) if mtp else None
        model_dir = resolve_model(model_dir)  # a directory, or a name in the HF cache
        t0 = time.perf_counter()
        model = load_model(model_dir, device=device, dtype=dtype, mtp=mtp, quant=quant)
        if found is not None:
            model.assistant = load_assistant(found, model.cfg, device=device,
                                             dtype=model.model.embed_tokens.weight.dtype)
        root = quant_cache.parent if quant_cache else cache_dir("")
        store = CalibrationStore.of_checkpoint(root / "calibration", Path(model_dir), model,
                                               quant=resolve(model, quant), slots=slots,
                                               k_max=k_max, max_seq_len=max_seq_len, exact=exact,
                                               fixed_shapes=fixed_shapes, draft=draft_vocab,
                                               modules=model.num_mtp,
                                               **({"assistant": checkpoint_identity(found)}
                                                  if found else {}))
        engine = cls(model, Tokenizer.from_dir(model_dir), max_seq_len=max_seq_len,
                     k_max=k_max, slots=slots, compile=compile, graphs=graphs, exact=exact,
                     fixed_shapes=fixed_shapes, quant=quant, calibration=store,
                     draft_vocab=draft_vocab, drafts=drafts, rings=rings,
                     quant_cache=QuantCache(quant_cache or cache_dir("quant"), Path(model_dir)))
        engine.model_dir = Path(model_dir)
        engine.load_seconds["weights"] = time.perf_counter() - t0  # quantizing included
        engine.calibrate()
        return engine

    # Prompts

    def prompt_budget(self, max_new_tokens: int) -> int:
        """The most prompt tokens leaving room for `max_new_tokens` and the verify after them."""
        return self.max_seq_len - max_new_tokens - self.k_max - PROMPT_SPARE

    def fill_in_prompt(self, prefix: str, suffix: str, *, max_new_tokens: int,
                       extra: Sequence[tuple[str, str]] = ()) -> recipe.Prompt:
        """The prompt for the code between `prefix` and `suffix` (see `prompt.fill_in`)."""
        return recipe.fill_in(self.tokenizer, prefix, suffix,
                              budget=self.prompt_budget(max_new_tokens), extra=extra)

    def text_prompt(self, text: str) -> recipe.Prompt:
        """The prompt that continues `text` (see `prompt.continuation`)."""
        return recipe.continuation(self.tokenizer, text)

    # Generations

    def start(self, prompt: list[int], params: GenParams | None = None, *,
              slot: Hashable = None, stable: int | None = None) -> Generation:
        """`stable`: `Prompt.stable`, where recurrent state checkpoints may be kept."""
        return Generation(self, prompt, params or GenParams(), slot, stable)

    def generate(self, prompt: list[int], params: GenParams | None = None, *,
                 slot: Hashable = None, stable: int | None = None, on_step: Callable[[Step],
                 None] | None = None, cancelled: Callable[[], bool] | None = None) -> Generation:
        """Run a generation to its end (or until `cancelled()` says so after a step)."""
        gen = self.start(prompt, params, slot=slot, stable=stable)
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

    @property
    def captured(self) -> int:
        """CUDA graphs captured so far (one per step shape used)."""
        return 0 if self._graphed is None else len(self._graphed)

    def drafts(self, slot: Hashable = None) -> list[int]:
        """The drafts waiting in the slot for its holder's next verify."""
        return list(self.slots.get(slot).drafts)

    def give_drafts(self, gen: Generation, drafts: list[int]) -> None:
        """Drafts of the caller's for the generation's next step, in place of the engine's
        (any tokens: they change how many tokens the step commits, never which)."""
        if not gen.started or gen.finish_reason is not None:
            raise ValueError("drafts are given to a generation between its steps")
        self.drafting.give(gen, self.slots.get(gen.slot), drafts)

    def step(self, gens: Sequence[Generation]) -> list[Step | None]:
        """One step of each generation (None for one that has ended): the prefills of those
        not started, as one pass, then one verify+draft step of the others, as one batch.
        Each must have its own slot."""
        if len({g.slot for g in gens}) < len(gens) or len(gens) > self.max_slots:
            raise ValueError(f"a batch needs distinct slots, at most {self.max_slots}")
        steps: list[Step | None] = [None] * len(gens)
        live = [i for i, g in enumerate(gens) if g.finish_reason is None]
        fresh = [i for i in live if not gens[i].started]
        if fresh:
            for i, step in zip(fresh, self._prefill([gens[i] for i in fresh]), strict=True):
                steps[i] = step
        batch = [i for i in live if i not in fresh and self._ready(gens[i])]
        if batch:
            for i, step in zip(batch, self._decode([gens[i] for i in batch]), strict=True):
                steps[i] = step
        return steps

    def _ready(self, g: Generation) -> bool:
        """Before a verify: take the slot back if another generation ran in it (the rebuild
        is not a step's cost), and end the generation if the context is full."""
        slot = self.slots.get(g.slot)
        if not slot.holds(g.sequence):
            self._start_rows([g], restore=True)
            g.resumed()
        if slot.room() < 1:
            g.finish("length")  # the context is full
            return False
        if len(slot.drafts) + 1 > slot.room():  # commit no more than the context holds
            slot.drafts = slot.drafts[:slot.room() - 1]
            self.state.set_rows([slot.index], num_drafts=[len(slot.drafts)])
        return True

    def _prefill(self, gens: list[Generation]) -> list[Step]:
        """The first step: run the prompts, commit the first tokens, draft the next ones."""
        t0 = time.perf_counter()
        reused = self._start_rows(gens, restore=False)
        seconds = time.perf_counter() - t0
        return [g.prefilled(r, seconds) for g, r in zip(gens, reused, strict=True)]

    def _start_rows(self, gens: list[Generation], *, restore: bool) -> list[int]:
        """Prefill (or, after another generation took the slot, restore) each generation's
        slot, pick its first token unless it has one, and draft for its next step. Where the
        number of rows in a call changes their bits, each prompt runs alone, as it would if
        nothing shared its step."""
        if len(gens) > 1 and not self.invariance.batch_invariant:
            return [r for g in gens for r in self._start_rows([g], restore=restore)]
        slots = [self.slots.get(g.slot) for g in gens]
        rows = [PrefillRow(s, g.sequence, len(g.sequence) - restore, g.stable)
                for s, g in zip(slots, gens, strict=True)]
        reused = prefill(self.model, self.caches, rows, spare=self.k_max + 2)
        index = [s.index for s in slots]
        self.state.set_rows(index, temperature=[g.sampling.temperature for g in gens],
                            top_p=[g.sampling.top_p for g in gens],
                            seed=[g.sampling.seed for g in gens])
        if not restore:
            picked = first_tokens(self.model, self.caches, rows, self._sampling(index, gens),
                                  self.forced.allowed([g.params.forced for g in gens]))
            for g, (tok, logp) in zip(gens, picked.tolist(), strict=True):
                g.sequence.append(int(tok))
                g.first_logprob = logp
        self.state.set_rows(index, lengths=[s.length for s in slots],
                            tokens=[[g.sequence[-1]] + [0] * self.k_max for g in gens],
                            num_drafts=[0] * len(gens), given=[False] * len(gens))
        step_rows = self.step_rows(len(gens))
        self._first_drafts(gens, slots, step_rows)
        self.drafting.choose(gens, slots, step_rows)
        return reused

    def _first_drafts(self, gens: list[Generation], slots: list[Slot], rows: int) -> None:
        plans = [self.drafting.plan(g, s, rows, self.early_exit)
                 for g, s in zip(gens, slots, strict=True)]
        k = max(p[0] for p in plans)
        if not k:
            return
        outs = [catch_up(self.model, self.caches, s.index, g.sequence, s.mtp_len, s.length)
                for g, s in zip(gens, slots, strict=True)]
        for s in slots:
            s.mtp_len = s.length
        index = [s.index for s in slots]
        self.drafting.set_plans(index, plans, rows)
        base = torch.tensor([s.length for s in slots], device=self.device)
        kv_len = self._kv_len(max(s.length for s in slots) + k + 1)
        at = torch.tensor(index, device=self.device)
        with torch.inference_mode():
            draft_chain(self.model, self.caches, self.state, at, torch.cat(outs), base, k,
                        kv_len, self._sampling(index, gens), confident=self._confident(plans),
                        early_exit=self.early_exit)
        counts = self.state.num_drafts[index].tolist()
        made = self.state.tokens[index, 1:k + 1].tolist()
        conf = self.state.confidence[index, :k].tolist()
        for s, c, d, p in zip(slots, counts, made, conf, strict=True):
            s.set_drafts(d[:c], p[:c])

    def _decode(self, gens: list[Generation]) -> list[Step]:
        slots = [self.slots.get(g.slot) for g in gens]
        index = [s.index for s in slots]
        rows = self.step_rows(len(gens))
        plans = [self.drafting.plan(g, s, rows, self.early_exit)
                 for g, s in zip(gens, slots, strict=True)]
        k = max(p[0] for p in plans)
        if k and self.model.num_mtp:  # modules behind (steps without drafts) catch up first
            for g, s in zip(gens, slots, strict=True):
                if s.mtp_len < s.length:
                    catch_up(self.model, self.caches, s.index, g.sequence, s.mtp_len, s.length)
                    s.mtp_len = s.length
        self.drafting.set_plans(index, plans, rows)
        verified = [pending(s) for s in slots]
        width = self.width if self.static else max(self.invariance.min_width,
                                                   max(len(p.tokens) for p in verified) + 1)
        shape = Shape(width=width, drafts=k,
                      kv_len=self._kv_len(max(s.length for s in slots) + width + k + 1),
                      sampled=any(not g.sampling.greedy for g in gens),
                      nucleus=any(g.sampling.top_p < 1 for g in gens),
                      confident=self._confident(plans), early_exit=self.early_exit)
        kinds = [g.kind for g in gens]  # the drafts were made in this kind of text
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self._run(index, shape).tolist()
        seconds = time.perf_counter() - t0
        steps = []
        for g, s, row, p, kind in zip(gens, slots, out[:len(gens)], verified, kinds,
                                      strict=True):
            tokens, n, drafts, confidence = unpack(row, shape)
            s.set_drafts(drafts, confidence)
            g.sequence.extend(tokens)
            s.advance(n + 1, modules=k > 0)
            steps.append(g.verified(tokens, len(p.tokens), seconds, unpack_logprobs(row, shape),
                                    p.source))
            self.drafting.observe(g, kind, p, n)
        self.drafting.observe_step(gens, verified, k, seconds, rows)
        self.drafting.choose(gens, slots, rows)
        return steps

    def step_rows(self, live: int) -> int:
        """Rows a step of `live` generations runs (padded ones included): `live` where a
        row's bits do not depend on the batch's size, else all slots."""
        return self.max_slots if self.static or not self.invariance.batch_invariant else live

    def _kv_len(self, n: int) -> int:
        """Keys a forward reading positions < n attends over."""
        if self.static or not self.invariance.key_invariant:
            return self.caches.length
        return kv_blocks(n, self.caches.length)

    def _run(self, index: list[int], shape: Shape) -> torch.Tensor:
        """The step's rows for the slots in `index`, in that order; where the batch size
        changes the bits, or the step runs one shape, padded to all slots with rows that run
        in the spare slot and are thrown away; where a row's bits depend on its batch row,
        each slot in a call of its own (eager: graphs are captured for all slots)."""
        alone = self.invariance.alone
        if alone and len(index) > 1:
            return torch.cat([self._run([i], shape) for i in index])
        pad = 0 if alone or (self.invariance.batch_invariant and not self.static) else \
            self.max_slots - len(index)
        if pad:
            self.state.idle(self._pad_slot)
        index = index + [self._pad_slot] * pad
        if not self.static:
            shape = replace(shape, span=span_of(index))
        if self._graphed is not None and not alone:
            return self._graphed(index, shape)
        return self._call_step(torch.tensor(index, device=self.device), shape)

    def _call_step(self, slots: torch.Tensor, shape: Shape) -> torch.Tensor:
        with torch.inference_mode():
            return decode_step(self.model, self.caches, self.state, slots, shape, self.fns)

    def _confident(self, plans: list[Plan]) -> bool:
        """Drafts carry their probability for adaptive rows, and always in a fixed shape (one
        compiled variant whatever the warm-up happened to draft, for a softmax a draft)."""
        return self.static or any(adaptive for _, _, adaptive in plans)

    def _sampling(self, index: list[int], gens: list[Generation]) -> RowSampling:
        rows = torch.tensor(index, device=self.device)
        return RowSampling(self.state.temperature[rows], self.state.top_p[rows],
                           self.state.seed[rows], any(not g.sampling.greedy for g in gens),
                           any(g.sampling.top_p < 1 for g in gens))

    def calibrate(self) -> None:
        """Measure on this device which step shapes keep rows bit-identical, then the step
        cost of every K for the K policy (or read both from the calibration store)."""
        calibrate(self)
        self.drafting.totals.clear()  # what serving drafts, not what measuring did

    def reshape_step(self, *, compiled: bool, static: bool) -> None:
        """Run the step otherwise after a fallback at load (graphs only in a fixed shape)."""
        self.compiled, self.static, self.early_exit = compiled, static, not static
        self.graphs = self.graphs and static
        self._graphed = self._graphed if self.graphs else None
        self.fns = step_fns(self.model, compiled, static)
        self.model.set_exact(self.exact or static)
