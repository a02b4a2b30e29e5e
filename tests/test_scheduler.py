"""Which jobs the engine steps next, and a worker that survives its own faults."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from daemon.backends import local
from daemon.backends.local import PREFILLS_PER_DECODE, LocalBackend
from daemon.scheduler import PRIORITIES, Job, Scheduler, Work
from engine import Engine, Generation
from tests.conftest import CHAIN_VOCAB

PROMPT = list(CHAIN_VOCAB[:8])
GENS: dict[Job, Generation] = {}  # the started jobs' generations, as the backend keeps them


def job(engine: Engine, seq: int, key: str, *, started: bool = False, slot: str | None = None,
        priority: str = "editor") -> Job:
    j = Job(work=Work("x", slot=slot or key), listeners=[], priority=PRIORITIES[priority],
            key=("s", key), seq=seq)
    if started:
        GENS[j] = engine.start(PROMPT, slot=slot or key)
    return j


def plan_step(jobs: list[Job], served: dict, prefills: int, max_slots: int) -> list[Job]:
    return local.plan_step(jobs, GENS, served, prefills, max_slots)


def test_a_prefill_goes_to_the_document_served_longest_ago(trained_engine: Engine) -> None:
    a, b = job(trained_engine, 1, "a"), job(trained_engine, 2, "b")
    assert plan_step([a, b], {("s", "a"): 10.0}, 0, 4) == [b]  # b never served
    assert plan_step([a, b], {("s", "a"): 10.0, ("s", "b"): 20.0}, 0, 4) == [a]
    assert plan_step([a, b], {}, 0, 4) == [a]  # then first come, first served


def test_running_jobs_wait_for_a_bounded_number_of_prefills(trained_engine: Engine) -> None:
    running = [job(trained_engine, 1, "a", started=True), job(trained_engine, 2, "b", started=True)]
    new = job(trained_engine, 3, "c")
    assert plan_step([*running, new], {}, 0, 4) == [new]
    assert plan_step([*running, new], {}, PREFILLS_PER_DECODE, 4) == running
    assert plan_step(running, {}, PREFILLS_PER_DECODE + 5, 4) == running


def test_a_batch_has_one_job_per_slot_and_at_most_max_slots(trained_engine: Engine) -> None:
    jobs = [job(trained_engine, 1, "a", started=True, slot="x"),
            job(trained_engine, 2, "b", started=True, slot="x"),  # shares x: waits
            job(trained_engine, 3, "c", started=True, slot="y"),
            job(trained_engine, 4, "d", started=True, slot="z")]
    assert plan_step(jobs, {}, 0, 2) == [jobs[0], jobs[2]]
    assert plan_step(jobs, {}, 0, 4) == [jobs[0], jobs[2], jobs[3]]


def test_the_most_urgent_class_is_stepped_alone(trained_engine: Engine) -> None:
    editor = job(trained_engine, 2, "a", started=True)
    batch = [job(trained_engine, 1, "b", priority="batch"),
             job(trained_engine, 3, "c", started=True, priority="batch")]
    assert plan_step([*batch, editor], {}, 0, 4) == [editor]
    assert plan_step(batch, {}, 0, 4) == [batch[0]]


class Events:
    def __init__(self) -> None:
        self.skip = 0
        self.errors: list[str] = []
        self.finished = threading.Event()

    def text(self, text: str) -> None:
        pass

    def done(self, job: Job) -> None:
        self.finished.set()

    def error(self, code: str, message: str) -> None:
        self.errors.append(code)
        self.finished.set()


async def test_a_fault_in_scheduling_fails_the_live_jobs_and_the_worker_goes_on(
        trained_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    real, faults = local.plan_step, [1]

    def faulty(*args: Any) -> list[Job]:
        if faults:
            faults.pop()
            raise RuntimeError("a scheduling bug")
        return real(*args)

    monkeypatch.setattr(local, "plan_step", faulty)
    scheduler = Scheduler(LocalBackend(trained_engine))
    scheduler.start()
    try:
        first, second = Events(), Events()
        work = Work("def f(", max_tokens=4, slot="f")
        scheduler.submit(Job(work=work, listeners=[first]))
        assert await asyncio.to_thread(first.finished.wait, 30) and first.errors == ["internal"]
        scheduler.submit(Job(work=work, listeners=[second]))
        assert await asyncio.to_thread(second.finished.wait, 30) and second.errors == []
        assert scheduler.counters.errors == 1
    finally:
        await scheduler.close()
