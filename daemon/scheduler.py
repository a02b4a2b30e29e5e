"""The request pipeline's jobs, whichever backend runs them.

A job is one request's work (`Work`: the text between a prefix and a suffix, or the text
after a prompt) and the clients listening to it. The scheduler keeps the live jobs: a newer
job of the same document supersedes the older ones, listeners join (typing through) and
leave, a job nobody listens to any more is cancelled, and a deadline ends a job with the
text so far. A backend (`daemon.backends`) runs the jobs: the local engine steps them on its
worker thread, a remote server streams them. It takes them from here (`next_jobs`, `live`),
is told of new work and cancellations (`wake`, `cancelled`), and reports what each step made
through `stepped`, from whichever thread it runs on. Results leave through each job's
listeners: the server hands them to its event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

PRIORITIES = {"editor": 0, "cli": 1, "batch": 2, "prefetch": 3}
PREFETCH = PRIORITIES["prefetch"]


class Listener(Protocol):
    skip: int  # characters of the job's text this listener already has (typing through)

    def text(self, text: str) -> None: ...
    def done(self, job: Job) -> None: ...
    def error(self, code: str, message: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Work:
    """What a job asks of the model, in text: each backend builds the model's prompt."""

    prefix: str  # the text before the cursor, or the prompt to continue
    suffix: str | None = None  # None: continue `prefix` as plain text (no fill-in)
    extra: tuple[tuple[str, str], ...] = ()  # (path, text) of other files, for fill-in
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()  # where the answer ends, besides the model's end tokens
    seed: int | None = None
    k: int | None = None  # the local engine's drafts per step (None: adaptive)
    speculative: bool = True
    stop_loops: bool = True  # the local engine ends the answer where it loops
    indent_floor: int = 0  # the answer ends before a line indented less (engine/decode/indent.py)
    slot: Hashable = None  # the local engine's KV-cache slot (a document keeps its prefix)

    @property
    def fill_in(self) -> bool:
        return self.suffix is not None


@dataclass(slots=True)
class Usage:
    """What a job's work took, as its backend reports it."""

    tokens: int = 0
    steps: int = 0  # engine steps, or chunks streamed by a server
    accepted: int = 0  # drafts accepted (the local engine)
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens found in the cache
    k_hist: dict[int, int] = field(default_factory=dict)
    hop_s: float = 0.0  # a remote backend: time in transit (its round trip minus the
    #                     server's own time, when the server says what that was)
    mean_logprob: float | None = None  # of the tokens so far (the local engine)
    min_logprob: float | None = None


@dataclass(eq=False)
class Job:
    work: Work
    listeners: list[Listener]
    priority: int = 0
    key: tuple[str, str] | None = None  # (session, document): a newer job supersedes
    deadline: float | None = None  # time.monotonic() after which the text so far is final
    multiline: bool = False  # a deadline then cuts back to the last whole line
    seq: int = 0
    text: str = ""
    steps: int = 0
    usage: Usage = field(default_factory=Usage)
    created: float = field(default_factory=time.monotonic)
    started: float | None = None  # when its backend began the work
    finished: float | None = None
    engine_s: float = 0.0  # time in the backend: engine steps, or the stream of a server
    cancelled: str | None = None  # why, once cancelled
    finish_reason: str | None = None
    prompt_counted: bool = False

    @property
    def live(self) -> bool:
        return self.cancelled is None and self.finish_reason is None


@dataclass(slots=True)
class StepReport:
    """What one step of a job made: text, and when the job's work ended, why."""

    job: Job
    text: str = ""
    finish_reason: str | None = None  # "stop", "length"...: the backend has no more
    usage: Usage | None = None


class Backend(Protocol):
    """Runs the scheduler's jobs (see `daemon.backends`)."""

    name: str

    def start(self, scheduler: Scheduler) -> None:
        """Begin taking jobs; called once, on the server's event loop."""

    def wake(self) -> None:
        """There is new work (called with the scheduler's lock held: must not block)."""

    def cancelled(self, job: Job) -> None:
        """`job` was cancelled; stop its work (same as `wake`: must not block)."""

    async def close(self) -> None:
        """Stop: the scheduler has cancelled every live job."""

    def save_state(self) -> None:
        """Keep what is worth keeping across restarts."""

    def status(self) -> dict[str, Any]:
        """The backend's figures, for `ahead status`."""


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
    prefetch_steps: int = 0  # steps of jobs still at prefetch priority (no one asked yet)


class Scheduler:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.counters = Counters()
        self._jobs: list[Job] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._closed = False
        self._stepping = False

    def start(self) -> None:
        self.backend.start(self)

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
            self._cv.notify_all()
            self.backend.wake()
        return job

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        with self._cv:
            if job.live:
                self._cancel(job, reason)

    def attach(self, job: Job, listener: Listener, priority: int | None = None) -> bool:
        """Add a listener to a live job (typing through); False if it has already ended.
        The text the job has beyond the listener's `skip` is sent to it at once. The job
        runs on at `priority` where that is more urgent (a prefetch someone now waits for)."""
        with self._cv:
            if not job.live:
                return False
            job.listeners.append(listener)
            if priority is not None and priority < job.priority:
                job.priority = priority
                self._cv.notify_all()
                self.backend.wake()
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

    def wait_idle(self, timeout: float) -> bool:
        """Block until no job is live and no step is running (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._stepping and
                                     not any(j.live for j in self._jobs), timeout)

    async def close(self) -> None:
        """Cancel the live jobs (their listeners hear "shutdown"), then stop the backend."""
        with self._cv:
            self._closed = True
            for job in self._jobs:
                if job.live:
                    self._cancel(job, "shutdown")
            self._cv.notify_all()
        await self.backend.close()

    # For backends.

    def notify(self) -> None:
        """Wake a worker waiting in `next_jobs`: its plan may have something to do."""
        with self._cv:
            self._cv.notify_all()

    def live(self) -> list[Job]:
        """The live jobs, most urgent first (by priority, then age)."""
        with self._cv:
            return sorted((j for j in self._jobs if j.live), key=lambda j: (j.priority, j.seq))

    def next_jobs(self, plan: Callable[[list[Job]], list[Job]]) -> list[Job] | None:
        """For a worker thread: block until `plan` (called under the lock with the live
        jobs, maybe none) picks some to step; None once closed. Until the next call, a step
        is running (see `wait_idle`)."""
        with self._cv:
            self._stepping = False
            self._cv.notify_all()
            while True:
                self._jobs = [j for j in self._jobs if j.live]
                picked = plan(self._jobs)
                if picked:
                    self._stepping = True
                    return picked
                if self._closed:
                    return None
                self._cv.wait()

    def stepped(self, reports: list[StepReport], elapsed: float) -> None:
        """One step of each reported job took `elapsed` seconds: hand its text on, and
        finish the jobs whose work ended or whose deadline has passed."""
        with self._cv:
            if len(reports) > 1:
                self.counters.batched_steps += 1
                self.counters.batched_jobs += len(reports)
            for report in reports:
                self._after_step(report, elapsed)

    def fail(self, jobs: list[Job], code: str, message: str) -> None:
        """End `jobs` with an error (those still live)."""
        with self._cv:
            for job in jobs:
                if not job.live:
                    continue
                self.counters.errors += 1
                job.finish_reason = "error"
                for listener in job.listeners:
                    listener.error(code, message)

    def _cancel(self, job: Job, reason: str) -> None:
        job.cancelled = reason
        if reason == "superseded":
            self.counters.superseded += 1
        else:
            self.counters.cancelled += 1
        for listener in job.listeners:
            listener.error("cancelled", f"request {reason}")
        self.backend.cancelled(job)

    def _after_step(self, report: StepReport, elapsed: float) -> None:
        job = report.job
        if report.usage is not None:
            job.usage = report.usage
        job.engine_s += elapsed
        job.steps += 1
        self.counters.steps += 1
        if job.priority == PREFETCH:
            self.counters.prefetch_steps += 1
        u = job.usage
        if not job.prompt_counted and u.prompt_tokens:  # known after the prefill
            job.prompt_counted = True
            self.counters.prefilled_tokens += u.prompt_tokens - u.reused_tokens
            self.counters.prefix_reused_tokens += u.reused_tokens
        if not job.live:  # cancelled while the step ran: its result goes nowhere
            self.counters.stale_steps += 1
            return
        if report.text:
            self._emit(job, report.text)
        reason = report.finish_reason
        if reason is None and job.deadline is not None and time.monotonic() >= job.deadline:
            reason = "deadline"
        if reason is not None:
            self._finish(job, reason)

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
