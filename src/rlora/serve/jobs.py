"""Futures and the one worker thread that runs every model request, in arrival order.

An HTTP handler checks a request, queues a job and answers at once with the job's id (the SDK's
UntypedAPIFuture); the SDK then asks retrieve_future for the result, which waits up to LONG_POLL seconds for
it (the SDK polls again at once on `try_again`, so waiting here keeps it from spinning). A job that fails
with ServeError is the client's mistake (category 'user'); any other exception is this server's fault
(category 'server', the traceback printed): either way the worker goes on with the next job.

A finished job keeps only its result (its request is dropped when it has run). The result is kept by time,
not by count, so that a busy server never forgets a slow client's future: RETRIEVED_GRACE seconds after it
was first retrieved (a lost response is asked for again), or UNRETRIEVED_TTL seconds after the job ended if
nobody asks (a client that went away).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from rlora.serve.state import ServeError

LONG_POLL = 20.0  # seconds a retrieve_future waits for its job (the SDK's own timeout for it is 45 s)
RETRIEVED_GRACE = 60.0  # seconds a result is kept after its first retrieval
UNRETRIEVED_TTL = 3600.0  # seconds a result nobody retrieves is kept
SWEEP_EVERY = 1.0  # seconds between looks for expired results


@dataclass
class Result:
    body: bytes | dict  # bytes: protobuf; dict: JSON
    error: str | None = None  # set: the job failed with this message
    user_error: bool = False


class Job:
    def __init__(self, job_id: str, run: Callable[[], bytes | dict]):
        self.id, self.run = job_id, run
        self.result: Result | None = None
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def finish(self, result: Result) -> None:
        with self._lock:
            self.result = result
            waiters, self._waiters = self._waiters, []
        for loop, waiter in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # that waiter's event loop has closed (the server is stopping): nobody waits
                pass

    async def wait(self, timeout: float) -> Result | None:
        """The result, or None if the job is still queued or running after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        with self._lock:
            if self.result is not None:
                return self.result
            self._waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            with self._lock:
                if (loop, waiter) in self._waiters:
                    self._waiters.remove((loop, waiter))
        return self.result


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Jobs:
    """The job table and the worker thread. clock: seconds, monotonic (the tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: dict[str, Job] = {}
        self._expires: dict[str, float] = {}  # finished job id -> when its result is dropped
        self._by_key: dict[tuple, str] = {}  # (target id, kind, seq_id) -> job id: a resent request is not run twice
        self._key_of: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._clock = clock
        self._next_sweep = clock()
        self._thread = threading.Thread(target=self._work, name="rlora-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], bytes | dict], key: tuple | None = None) -> str:
        self.sweep()
        with self._lock:
            if key is not None and key in self._by_key:
                return self._by_key[key]
            job = Job(f"{next(self._ids)}-{uuid.uuid4().hex[:12]}", run)
            self._jobs[job.id] = job
            if key is not None:
                self._by_key[key], self._key_of[job.id] = job.id, key
        self._queue.put(job)
        return job.id

    def has_key(self, key: tuple) -> bool:
        """Whether a request with this key is queued, running or still held (a resend gets its future)."""
        with self._lock:
            return key in self._by_key

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def retrieved(self, job_id: str) -> None:
        """Its result has been handed over: keep it only RETRIEVED_GRACE seconds more."""
        with self._lock:
            if job_id in self._expires:
                self._expires[job_id] = min(self._expires[job_id], self._clock() + RETRIEVED_GRACE)

    def sweep(self, force: bool = False) -> None:
        """Drop the results whose time is up (at most once every SWEEP_EVERY seconds unless forced)."""
        now = self._clock()
        with self._lock:
            if not force and now < self._next_sweep:
                return
            self._next_sweep = now + SWEEP_EVERY
            for job_id in [j for j, at in self._expires.items() if at <= now]:
                del self._expires[job_id]
                self._jobs.pop(job_id, None)
                self._by_key.pop(self._key_of.pop(job_id, None), None)

    def __len__(self) -> int:
        return len(self._jobs)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            run, job.run = job.run, None  # the request (a closure over its parsed body) goes once it has run
            try:
                result = Result(run())
            except ServeError as err:
                result = Result({}, err.message, user_error=True)
            except Exception as err:  # noqa: BLE001 - the server goes on serving; the client gets the message
                traceback.print_exc(file=sys.stderr)
                result = Result({}, f"rlora serve failed: {type(err).__name__}: {err}")
            del run
            try:  # nothing here may end the worker thread: every later request would wait forever
                with self._lock:  # before the result is visible, so that its first retrieval shortens this
                    self._expires[job.id] = self._clock() + UNRETRIEVED_TTL
                job.finish(result)
                self.sweep()
            except Exception:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
