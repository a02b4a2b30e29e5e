"""The engine's one worker thread and the order in which it steps requests.

Every loop iteration runs one engine step of the most urgent class of live jobs (editor
before CLI before batch): the prefill of a job that has not started, else one draft+verify
step of all its started jobs together, as one batch (continuous batching: a job joins the
batch after its prefill, and leaves it when it ends; see `_batch` for the turns). So several
editors typing at once share each step instead of queueing behind each other; a cancelled or
superseded job stops within one step; and urgent work overtakes batch work between steps
(generations interleave safely: each takes its KV cache back when it resumes). Results leave
through each job's listeners, called on the worker thread: the server hands them to its
event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine import Engine, Generation, Step

log = logging.getLogger("ahead.daemon")
PRIORITIES = {"editor": 0, "cli": 1, "batch": 2}
PREFILLS_PER_DECODE = 1  # running jobs wait for at most this many new jobs' prefills


class Listener(Protocol):
    skip: int  # characters of the job's text this listener already has (typing through)

    def text(self, text: str) -> None: ...
    def done(self, job: Job) -> None: ...
    def error(self, code: str, message: str) -> None: ...


@dataclass(eq=False)
class Job:
    make: Callable[[Engine], Generation]  # builds the prompt; runs on the worker thread
    listeners: list[Listener]
    priority: int = 0
    key: tuple[str, str] | None = None  # (session, document): a newer job supersedes
    deadline: float | None = None  # time.monotonic() after which the text so far is final
    multiline: bool = False  # a deadline then cuts back to the last whole line
    seq: int = 0
    gen: Generation | None = None
    text: str = ""
    steps: int = 0
    created: float = field(default_factory=time.monotonic)
    started: float | None = None
    finished: float | None = None
    engine_s: float = 0.0
    cancelled: str | None = None  # why, once cancelled
    finish_reason: str | None = None

    @property
    def live(self) -> bool:
        return self.cancelled is None and self.finish_reason is None


@dataclass(slots=True)
class Counters:
    steps: int = 0
    completed: int = 0
    cancelled: int = 0
    superseded: int = 0
    stale_steps: int = 0  # steps that ended after their job was cancelled (at most one each)
    errors: int = 0
    batched_steps: int = 0  # engine steps that stepped more than one job
    batched_jobs: int = 0  # job steps taken in those
    prefilled_tokens: int = 0  # prompt tokens run by prefills, superseded jobs' included
    prefix_reused_tokens: int = 0  # prompt tokens those prefills found in the KV cache


class Scheduler:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.counters = Counters()
        self._jobs: list[Job] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._closed = False
        self._stepping = False
        self._next_engine: Engine | None = None
        self._prefills = 0  # prefill steps since the last decoding step
        self._served: dict[tuple[str, str] | None, float] = {}  # key: when last stepped
        self._thread = threading.Thread(target=self._loop, name="ahead-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> Job:
        with self._cv:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._seq += 1
            job.seq = self._seq
            if job.key is not None:
                for old in self._jobs:
                    if old.key == job.key and old.live:
                        self._cancel(old, "superseded")
            self._jobs.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        with self._cv:
            if job.live:
                self._cancel(job, reason)

    def running_for(self, key: tuple[str, str]) -> Job | None:
        with self._cv:
            return next((j for j in self._jobs if j.key == key and j.live), None)

    def attach(self, job: Job, listener: Listener) -> bool:
        """Add a listener to a live job (typing through); False if it has already ended.
        The text the job has beyond the listener's `skip` is sent to it at once."""
        with self._cv:
            if not job.live:
                return False
            job.listeners.append(listener)
            if len(job.text) > listener.skip:
                listener.text(job.text[listener.skip:])
            return True

    def detach(self, job: Job, listener: Listener, reason: str = "cancelled") -> None:
        """Drop one listener (telling it why); a job nobody listens to any more is cancelled."""
        with self._cv:
            if listener not in job.listeners:
                return
            job.listeners.remove(listener)
            if job.live:
                listener.error("cancelled", f"request {reason}")
                if not job.listeners:
                    self._cancel(job, reason)

    def swap(self, engine: Engine) -> None:
        """Serve with `engine` from the first moment no job is live (between requests)."""
        with self._cv:
            self._next_engine = engine
            self._cv.notify()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is live and no step is running (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._stepping and
                                     not any(j.live for j in self._jobs), timeout)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            for job in self._jobs:
                if job.live:
                    self._cancel(job, "shutdown")
            self._cv.notify()
        self._thread.join(timeout)

    def _cancel(self, job: Job, reason: str) -> None:
        job.cancelled = reason
        if reason == "superseded":
            self.counters.superseded += 1
        else:
            self.counters.cancelled += 1
        for listener in job.listeners:
            listener.error("cancelled", f"request {reason}")

    def _next_jobs(self) -> list[Job]:
        """The jobs of the next engine step; none once closed."""
        with self._cv:
            self._stepping = False
            self._cv.notify_all()  # for wait_idle
            while True:
                self._jobs = [j for j in self._jobs if j.live]
                if self._next_engine is not None and all(j.gen is None for j in self._jobs):
                    self.engine, self._next_engine = self._next_engine, None
                if self._jobs:
                    self._stepping = True
                    return self._batch()
                if self._closed:
                    return []
                self._cv.wait()

    def _batch(self) -> list[Job]:
        jobs = plan_step(self._jobs, self._served, self._prefills, self.engine.max_slots)
        self._prefills = self._prefills + 1 if jobs[0].gen is None else 0
        return jobs

    def _loop(self) -> None:
        while True:
            try:
                jobs = self._next_jobs()
            except Exception as e:  # a bug in the scheduling: fail the live jobs, never hang
                log.exception("scheduling failed")
                with self._cv:
                    self._fail([j for j in self._jobs if j.live], e)
                continue
            if not jobs:
                return
            try:
                self._step(jobs)
            except Exception as e:  # a bad request must not take the worker down
                if not isinstance(e, ValueError):
                    log.exception("engine step failed")
                with self._cv:
                    self._fail(jobs, e)  # a batch's state is shared: all of it fails

    def _fail(self, jobs: list[Job], e: Exception) -> None:
        for job in jobs:
            self.counters.errors += 1
            job.finish_reason = "error"
            for listener in job.listeners:
                listener.error(_code(e), str(e))

    def _step(self, jobs: list[Job]) -> None:
        t0 = time.monotonic()
        for job in jobs:
            if job.gen is None:
                job.started = t0
                job.gen = job.make(self.engine)
        steps = self.engine.step([job.gen for job in jobs if job.gen is not None])
        elapsed = time.monotonic() - t0
        with self._cv:
            if len(jobs) > 1:
                self.counters.batched_steps += 1
                self.counters.batched_jobs += len(jobs)
            for job, step in zip(jobs, steps, strict=True):
                self._after_step(job, step, elapsed)

    def _after_step(self, job: Job, step: Step | None, elapsed: float) -> None:
        assert job.gen is not None
        if job.key is not None:
            self._served[job.key] = time.monotonic()
            if len(self._served) > 4096:  # forget documents not served for longest
                recent = sorted(self._served.items(), key=lambda kv: kv[1])[-1024:]
                self._served = dict(recent)
        job.engine_s += elapsed
        job.steps += 1
        self.counters.steps += 1
        if job.steps == 1:  # its prefill
            s = job.gen.stats
            self.counters.prefilled_tokens += s.prompt_tokens - s.reused_tokens
            self.counters.prefix_reused_tokens += s.reused_tokens
        if not job.live:  # cancelled while the step ran: its result goes nowhere
            self.counters.stale_steps += 1
            return
        if step is not None and step.text:
            self._emit(job, step.text)
        reason = job.gen.finish_reason
        if reason is None and job.deadline is not None and time.monotonic() >= job.deadline:
            reason = "deadline"
        if reason is not None or step is None:
            self._finish(job, reason or "stop")

    def _emit(self, job: Job, text: str) -> None:
        start = len(job.text)
        job.text += text
        for listener in job.listeners:
            if len(job.text) > listener.skip:
                listener.text(job.text[max(start, listener.skip):])

    def _finish(self, job: Job, reason: str) -> None:
        if reason == "deadline" and job.multiline:
            job.text = job.text[: job.text.rfind("\n") + 1]  # whole lines only, maybe none
        job.finish_reason = reason
        job.finished = time.monotonic()
        self.counters.completed += 1
        for listener in job.listeners:
            listener.done(job)


def plan_step(jobs: list[Job], served: dict[tuple[str, str] | None, float], prefills: int,
              max_slots: int) -> list[Job]:
    """The jobs of the next step, from the most urgent class of the live `jobs`.

    A prefill runs alone, then its job joins the decoding batch (one job per KV-cache slot:
    CLI generations share theirs). New requests go first, but running ones wait for at most
    PREFILLS_PER_DECODE prefills (`prefills` have run since the last decoding step), so that
    neither kind starves the other. New requests take their turns by when their document was
    last `served`: one editor typing fast must not keep the others' prefills waiting (each of
    its keystrokes' requests being new)."""
    top = min(j.priority for j in jobs)
    urgent = sorted((j for j in jobs if j.priority == top), key=lambda j: j.seq)
    fresh = [j for j in urgent if j.gen is None]
    started = len(fresh) < len(urgent)
    if fresh and not (started and prefills >= PREFILLS_PER_DECODE):
        return [min(fresh, key=lambda j: (served.get(j.key, 0.0), j.seq))]
    batch: list[Job] = []
    slots: set[object] = set()
    for job in urgent:
        if job.gen is None or job.gen.slot in slots or len(batch) == max_slots:
            continue
        batch.append(job)
        slots.add(job.gen.slot)
    return batch


def _code(e: Exception) -> str:
    return "bad_request" if isinstance(e, ValueError) else "internal"
