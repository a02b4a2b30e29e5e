"""From protocol requests to scheduler jobs: prompts, typing through, and what a client hears.

A `Complete` whose prefix is an earlier completion's prefix plus text that completion already
produced (with the same suffix) is answered from that completion: instantly if it finished,
else by following it as it runs. Anything else becomes a new job that supersedes the
document's earlier ones.

Prefetch: once an editor shows a suggestion, it asks (at "prefetch" priority, the lowest) for
the completion at the cursor the suggestion would leave if it were accepted whole. That job
runs while nothing else waits; the request after the accept types through it (from its
start), promoting it to its own priority, or is answered from it at once. Accepting a part
(a word, a line) needs none: the shown completion's rest answers it. A keystroke that leaves
the suggestion supersedes the prefetch like any older request of the document.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from daemon import protocol as p
from daemon.scheduler import PRIORITIES, Job, Scheduler, Work
from engine.decode import quality

_OVERLAP = 4096  # characters of the earlier prefix's end that must match
Send = Callable[[p.Reply], None]  # thread-safe: hands a frame to the connection's writer


class Listener:
    """One request's view of a job: streams its part of the text back to the client."""

    def __init__(self, req_id: int, send: Send, skip: int = 0, *, typed_through: bool = False,
                 on_end: Callable[[Listener], None] | None = None) -> None:
        self.req_id, self.send, self.skip = req_id, send, skip
        self.typed_through = typed_through
        self.prefetched = False  # answered from a prefetch
        self.received = time.monotonic()
        self.on_end = on_end
        self.ended = False
        self.final: p.RequestStats | None = None  # set when it is done
        self.judge: float | None = None  # judged by the quality rules at this threshold
        self.withheld: str | None = None  # why a judged answer came back empty

    def text(self, text: str) -> None:
        self.send(p.Chunk(id=self.req_id, text=text))

    # The bookkeeping is handed over before the last frame, so that whoever reads that frame
    # and asks for the status sees this request counted.
    def done(self, job: Job) -> None:
        self.final = self.stats(job)
        text, reason, u = job.text[self.skip:], job.finish_reason or "stop", job.usage
        if self.judge is not None and text.strip():
            scores = None if u.mean_logprob is None or u.min_logprob is None else \
                quality.Confidence(u.mean_logprob, u.min_logprob, u.tokens)
            shown, self.withheld = quality.judged(job.text, reason, scores, self.judge,
                                                  prefix=job.work.prefix,
                                                  suffix=job.work.suffix)
            if self.withheld is not None:
                text, reason = "", self.withheld
            elif reason == quality.REPETITION:  # what came before the loop
                text = shown[self.skip:]
        self._end()
        self.send(p.Done(id=self.req_id, text=text, finish_reason=reason, stats=self.final,
                         mean_logprob=u.mean_logprob, min_logprob=u.min_logprob))

    def error(self, code: str, message: str) -> None:
        self._end()
        self.send(p.Error(id=self.req_id, code=code, message=message))

    def _end(self) -> None:
        self.ended = True
        if self.on_end:
            self.on_end(self)

    def stats(self, job: Job) -> p.RequestStats:
        now = time.monotonic()
        if self.typed_through:
            return p.RequestStats(total_ms=(now - self.received) * 1000, typed_through=True,
                                  prefetched=self.prefetched)
        u = job.usage
        engine_s = job.engine_s - u.hop_s  # building the prompt and running the model
        return p.RequestStats(
            tokens=u.tokens, steps=u.steps, accepted=u.accepted,
            prefill_tokens=u.prompt_tokens - u.reused_tokens, reused_tokens=u.reused_tokens,
            queue_ms=((job.started or now) - job.created) * 1000,
            engine_ms=engine_s * 1000, total_ms=(now - self.received) * 1000,
            hop_ms=u.hop_s * 1000, k_histogram=dict(u.k_hist))


@dataclass(slots=True)
class _Last:
    prefix: str
    suffix: str
    job: Job


class Requests:
    """Turns requests into jobs; remembers each document's last completion and prefetch."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._last: dict[tuple[str, str], _Last] = {}
        self._ahead: dict[tuple[str, str], _Last] = {}  # the document's prefetch
        self.typed_through = 0
        self.completions = 0
        self.prefetches = 0  # prefetch jobs started
        self.prefetch_hits = 0  # requests answered from one
        self.min_confidence = 0.0  # judged completions below it come back empty (config)

    def complete(self, req: p.Complete, listener: Listener) -> Job | None:
        """Start or join a completion; None when it was answered at once."""
        key = (req.session, req.document)
        if req.judge:
            listener.judge = self.min_confidence
        if req.priority == "prefetch":
            return self._prefetch(key, req, listener)
        self.completions += 1
        ahead = self._ahead.pop(key, None)
        hit = _typed(ahead, req) if ahead else None
        if hit is not None:
            assert ahead is not None
            self.prefetch_hits += 1
            listener.prefetched = True
            self._last[key] = ahead  # typing on along it is typing through it
        else:
            hit = _typed(self._last.get(key), req)
            if hit is not None and ahead is not None:
                self._ahead[key] = ahead  # typing along the shown text: still ahead
        if hit is not None:
            return self._join(*hit, listener, PRIORITIES[req.priority])
        work = self._work(key, req)
        job = self.run(work, listener, priority=req.priority, budget_ms=req.budget_ms,
                       key=key, multiline=req.multiline)
        self._last[key] = _Last(req.prefix, req.suffix, job)
        return job

    def _prefetch(self, key: tuple[str, str], req: p.Complete,
                  listener: Listener) -> Job | None:
        """A prefetch: nothing to do where the document's last completion already has more
        to say at that cursor (its rest will answer); else a job for later requests."""
        last = self._last.get(key)
        if last is None or last.job.live or _typed(last, req) is not None or \
                _typed(self._ahead.get(key), req) is not None:
            listener.done(_nothing(req))  # (or the prefetch there already: it stands)
            return None
        self.prefetches += 1
        job = self.run(self._work(key, req), listener, priority=req.priority,
                       budget_ms=req.budget_ms, key=key, multiline=req.multiline)
        self._ahead[key] = _Last(req.prefix, req.suffix, job)
        return job

    def _join(self, job: Job, typed: str, listener: Listener, priority: int) -> Job | None:
        """Answer `listener` from `job`, the first `typed` characters of its text typed."""
        self.typed_through += 1
        listener.skip, listener.typed_through = len(typed), True
        earlier = list(job.listeners)
        if self.scheduler.attach(job, listener, priority):
            for old in earlier:  # earlier requests are superseded; the job runs on
                self.scheduler.detach(job, old, "superseded")
            return job
        listener.done(job)  # it had finished: the rest of its text is the answer
        return None

    @staticmethod
    def _work(key: tuple[str, str], req: p.Complete) -> Work:
        return Work(req.prefix, req.suffix, tuple((c.path, c.text) for c in req.extra),
                    max_tokens=req.max_tokens, temperature=req.temperature,
                    stop=(*req.stop, *(() if req.multiline else ("\n",))), slot=key,
                    stop_loops=req.stop_loops, indent_floor=req.indent_floor)

    def generate(self, req: p.Generate, listener: Listener) -> Job:
        work = Work(req.prompt, max_tokens=req.max_tokens, temperature=req.temperature,
                    top_p=req.top_p, stop=tuple(req.stop), seed=req.seed, k=req.k,
                    speculative=req.speculative, slot="generate", stop_loops=req.stop_loops)
        return self.run(work, listener, priority=req.priority, budget_ms=req.budget_ms)

    def run(self, work: Work, listener: Listener, *, priority: p.Priority,
            budget_ms: int | None = None, key: tuple[str, str] | None = None,
            multiline: bool = False) -> Job:
        """A new job for `work`; with a `key`, it supersedes that document's earlier ones."""
        job = Job(work=work, listeners=[listener], priority=PRIORITIES[priority], key=key,
                  deadline=_deadline(budget_ms), multiline=multiline)
        return self.scheduler.submit(job)



def _typed(last: _Last | None, req: p.Complete) -> tuple[Job, str] | None:
    """The earlier completion this request types through, and the text typed.

    The prefix must be the earlier prefix plus text that completion produced. Clients send
    windows cut at line boundaries, so as the cursor moves a line may drop off the window's
    start: the earlier prefix is compared by its end, not its start. A finished completion
    typed to its end, or to nothing but white space, has nothing left to say: no match (a
    new completion at the new cursor may). At its own cursor (nothing typed) its answer is
    the one a new completion would give, empty or not (a prefetch that found nothing), and
    so is that of one the loop rule stopped (the same prompt loops the same way); typed
    into, that one is no match.
    """
    if last is None or last.suffix != req.suffix:
        return None
    job = last.job
    looped = job.finish_reason == quality.REPETITION  # stopped by the loop rule
    if job.cancelled or (job.finish_reason not in (None, "stop", "length") and not looped):
        return None  # an error or a deadline cut: its text is no promise of the rest
    new, old, text = req.prefix, last.prefix, job.text
    for t in range(min(len(text), len(new)), -1, -1):
        head = new[:len(new) - t]
        overlap = min(len(old), len(head), _OVERLAP)
        same_before = (head[len(head) - overlap:] == old[len(old) - overlap:]) if overlap \
            else head == old
        if same_before and new[len(new) - t:] == text[:t]:
            if looped:  # at its own cursor it is the answer; typed into, a loop's text
                return (job, "") if t == 0 else None  # is no promise of the rest
            return (job, text[:t]) if job.live or t == 0 or text[t:].strip() else None
    return None


def _nothing(req: p.Complete) -> Job:
    """A finished job with no text: the answer to a request with nothing to do."""
    return Job(work=Work(req.prefix, req.suffix), listeners=[], finish_reason="stop")


def _deadline(budget_ms: int | None) -> float | None:
    return None if budget_ms is None else time.monotonic() + budget_ms / 1000
