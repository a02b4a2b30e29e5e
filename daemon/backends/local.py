"""The local backend: the engine on one worker thread, stepping the scheduler's jobs.

Every loop iteration runs one engine step of the most urgent class of live jobs (editor
before CLI before batch): the prefill of a job that has not started, else one draft+verify
step of all its started jobs together, as one batch (continuous batching: a job joins the
batch after its prefill, and leaves it when it ends; see `plan_step` for the turns). So
several editors typing at once share each step instead of queueing behind each other; a
cancelled or superseded job stops within one step; and urgent work overtakes batch work
between steps (generations interleave safely: each takes its KV cache back when it resumes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from daemon import policy_store
from daemon.reload import Loader, Reloader
from daemon.scheduler import Job, Scheduler, StepReport, Usage
from engine import Engine, Generation, GenParams
from engine.model.quant import describe

log = logging.getLogger("ahead.daemon")
PREFILLS_PER_DECODE = 1  # running jobs wait for at most this many new jobs' prefills


class LocalBackend:
    name = "local"

    def __init__(self, engine: Engine, *, loader: Loader | None = None,
                 model_dir: Path | None = None, policy_dir: Path | None = None) -> None:
        """`loader` (model dir -> Engine) enables reloads of `model_dir` (default: where
        the engine was loaded from); `policy_dir` keeps the K policy's learning per model
        across restarts (see `daemon.policy_store`)."""
        self.engine = engine
        self.policy_dir = policy_dir
        self.policy_restored = False  # whether the K policy started from saved learning
        if policy_dir is not None:
            self.policy_restored = policy_store.restore(engine, policy_dir)
            if loader is not None:
                loader = _restoring(loader, policy_dir)
        model_dir = model_dir or engine.model_dir or Path(".")
        self.reloader = Reloader(self.swap, loader, model_dir) if loader else None
        self._gens: dict[Job, Generation] = {}  # the started jobs' generations
        self._served: dict[tuple[str, str] | None, float] = {}  # key: when last stepped
        self._prefills = 0  # prefill steps since the last decoding step
        self._next_engine: Engine | None = None
        self._scheduler: Scheduler | None = None
        self._thread = threading.Thread(target=self._loop, name="ahead-engine", daemon=True)

    def start(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._thread.start()

    def wake(self) -> None:
        pass  # the worker waits on the scheduler's own condition

    def cancelled(self, job: Job) -> None:
        pass  # the worker steps live jobs only

    def swap(self, engine: Engine) -> None:
        """Serve with `engine` from the first moment no job has started (between requests)."""
        self._next_engine = engine
        if self._scheduler is not None:
            self._scheduler.notify()

    async def close(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)

    def save_state(self) -> None:
        if self.policy_dir is not None:
            policy_store.save(self.engine, self.policy_dir)

    def status(self) -> dict[str, Any]:
        reloader = self.reloader
        return {"backend": self.name,
                "reloads": reloader.reloads if reloader else 0,
                "last_reload_error": reloader.last_error if reloader else None,
                "policy_restored": self.policy_restored,
                "model_threads": torch.get_num_threads(),
                "step": step_mode(self.engine),
                "exact": self.engine.exactness,
                "quant": describe(self.engine.model),
                "load_s": {k: round(v, 2) for k, v in self.engine.load_seconds.items()},
                **self._memory(),
                "drafts_by_source": self.engine.drafting.report(),
                **self.engine.policy.report()}

    def _memory(self) -> dict[str, Any]:
        """The slots' device memory, and the draft model's parameters where there is one;
        for hybrid models, the recurrent states' share of the slots' memory
        (conv and delta-rule states, k_max + 2 per slot and layer and the checkpoints that
        prefix reuse resumes from: see cache/state.py); for models whose sliding-window
        layers keep rings, the rings' share and entries (cache/ring.py)."""
        caches, mib = self.engine.caches, 1 << 20
        out: dict[str, Any] = {"cache_mib": round(caches.nbytes() / mib, 1)}
        assistant = self.engine.model.assistant
        if assistant is not None:  # a drafter of its own checkpoint (Gemma 4's -assistant)
            out["draft_model_mib"] = round(assistant.nbytes() / mib, 1)
        if self.engine.model.cfg.hybrid:
            out["recurrent_state_mib"] = round(caches.state_nbytes() / mib, 2)
            out["state_snapshots_per_slot"] = caches.snapshots
            out["state_checkpoints_per_slot"] = caches.checkpoints
        if caches.ring is not None:
            out["ring_mib"] = round(caches.ring_nbytes() / mib, 2)
            out["ring_entries"] = caches.ring.size
            out["ring_checkpoints_per_slot"] = caches.checkpoints
        return out

    def _plan(self, jobs: list[Job]) -> list[Job]:
        """Under the scheduler's lock: the jobs of the next step (none: wait)."""
        self._gens = {j: g for j, g in self._gens.items() if j.live}
        if self._next_engine is not None and not self._gens:
            self.engine, self._next_engine = self._next_engine, None
        if not jobs:
            return []
        picked = plan_step(jobs, self._gens, self._served, self._prefills,
                           self.engine.max_slots)
        self._prefills = self._prefills + 1 if picked[0] not in self._gens else 0
        return picked

    def _loop(self) -> None:
        assert self._scheduler is not None
        scheduler = self._scheduler
        while True:
            try:
                jobs = scheduler.next_jobs(self._plan)
            except Exception as e:  # a bug in the scheduling: fail the live jobs, never hang
                log.exception("scheduling failed")
                scheduler.fail(scheduler.live(), "internal", str(e))
                continue
            if jobs is None:
                return
            try:
                self._step(scheduler, jobs)
            except Exception as e:  # a bad request must not take the worker down
                if not isinstance(e, ValueError):
                    log.exception("engine step failed")
                # a batch's state is shared: all of it fails
                scheduler.fail(jobs, "bad_request" if isinstance(e, ValueError) else "internal",
                               str(e))

    def _step(self, scheduler: Scheduler, jobs: list[Job]) -> None:
        t0 = time.monotonic()
        for job in jobs:
            if job not in self._gens:
                job.started = t0
                self._gens[job] = self._generation(job)
        gens = [self._gens[job] for job in jobs]
        steps = self.engine.step(gens)
        now = time.monotonic()
        reports = []
        for job, gen, step in zip(jobs, gens, steps, strict=True):
            if job.key is not None:
                self._served[job.key] = now
            reason = gen.finish_reason or ("stop" if step is None else None)
            reports.append(StepReport(job, step.text if step else "", reason, _usage(gen)))
        if len(self._served) > 4096:  # forget documents not served for longest
            self._served = dict(sorted(self._served.items(), key=lambda kv: kv[1])[-1024:])
        scheduler.stepped(reports, now - t0)

    def _generation(self, job: Job) -> Generation:
        """The job's prompt, built with the engine's recipe, as a generation."""
        w, engine = job.work, self.engine
        if w.suffix is not None:
            prompt = engine.fill_in_prompt(w.prefix, w.suffix, max_new_tokens=w.max_tokens,
                                           extra=list(w.extra))
        else:
            prompt = engine.text_prompt(w.prefix)
        params = GenParams(max_new_tokens=w.max_tokens, temperature=w.temperature,
                           top_p=w.top_p, stop=w.stop, seed=w.seed, k=w.k,
                           speculative=w.speculative, forced=prompt.forced,
                           stop_loops=w.stop_loops, indent_floor=w.indent_floor)
        return engine.start(prompt.ids, params, slot=w.slot, stable=prompt.stable)


def _usage(gen: Generation) -> Usage:
    s = gen.stats
    return Usage(tokens=len(gen.tokens), steps=s.steps, accepted=s.accepted,
                 prompt_tokens=s.prompt_tokens, reused_tokens=s.reused_tokens, k_hist=s.k_hist,
                 mean_logprob=s.mean_logprob, min_logprob=s.min_logprob)


def _restoring(loader: Loader, policy_dir: Path) -> Loader:
    def load(model_dir: Path) -> Engine:
        engine = loader(model_dir)
        policy_store.restore(engine, policy_dir)
        return engine
    return load


def plan_step(jobs: list[Job], gens: dict[Job, Generation],
              served: dict[tuple[str, str] | None, float], prefills: int,
              max_slots: int) -> list[Job]:
    """The jobs of the next step, from the most urgent class of the live `jobs` (those in
    `gens` have started).

    A prefill runs alone, then its job joins the decoding batch (one job per KV-cache slot:
    CLI generations share theirs). New requests go first, but running ones wait for at most
    PREFILLS_PER_DECODE prefills (`prefills` have run since the last decoding step), so that
    neither kind starves the other. New requests take their turns by when their document was
    last `served`: one editor typing fast must not keep the others' prefills waiting (each of
    its keystrokes' requests being new)."""
    top = min(j.priority for j in jobs)
    urgent = sorted((j for j in jobs if j.priority == top), key=lambda j: j.seq)
    fresh = [j for j in urgent if j not in gens]
    started = len(fresh) < len(urgent)
    if fresh and not (started and prefills >= PREFILLS_PER_DECODE):
        return [min(fresh, key=lambda j: (served.get(j.key, 0.0), j.seq))]
    batch: list[Job] = []
    slots: set[object] = set()
    for job in urgent:
        gen = gens.get(job)
        if gen is None or gen.slot in slots or len(batch) == max_slots:
            continue
        batch.append(job)
        slots.add(gen.slot)
    return batch


def step_mode(engine: Engine) -> str:
    """How the engine's decode step runs (after any fallback to eager at load)."""
    if engine.graphs:
        return "cuda graphs"
    if engine.compiled:
        return "compiled" if engine.static else "compiled blocks"
    return "eager"
