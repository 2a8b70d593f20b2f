"""Futures and the one worker thread that runs every model request, in arrival order.

An HTTP handler checks a request, queues a job and answers at once with the job's id (the SDK's
UntypedAPIFuture); the SDK then asks retrieve_future for the result, which waits up to LONG_POLL seconds for
it (the SDK polls again at once on `try_again`, so waiting here keeps it from spinning). A job that fails
with ServeError is the client's mistake (category 'user'); any other exception is this server's fault
(category 'server', the traceback printed): either way the worker goes on with the next job.

Batching: a job may say how it runs in one pass with others (Batchable: serve/batched.py runs several
clients' forward_backward through one base forward; the sampling requests of one session run as one sampler
call). When the worker takes such a job it also takes the jobs queued right behind it of the same group and of
other members (a contiguous run at the head of the queue: it stops at the first job that is anything else or
whose member is in the batch already, so no member's requests are reordered and nothing passes a job of another
kind), up to the first job's max_members jobs and max_tokens tokens. The batch's runner gives each job its own
outcome; a runner that raises leaves the batch to run job by job (each job's own run), so each still gets its
own result or error. A batch of one is a plain job.

A finished job keeps only its result (its request is dropped when it has run). The result is kept by time,
not by count, so that a busy server never forgets a slow client's future: RETRIEVED_GRACE seconds after it
was first retrieved (a lost response is asked for again), or UNRETRIEVED_TTL seconds after the job ended if
nobody asks (a client that went away).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from rlora.serve.state import ServeError

# seconds a retrieve_future waits for its job: well below the SDK's own timeout for it (45 s; the event loop may
# answer late while the worker holds the GIL), and long, since the SDK logs a warning for every `try_again`
LONG_POLL = 30.0
RETRIEVED_GRACE = 60.0  # seconds a result is kept after its first retrieval
UNRETRIEVED_TTL = 3600.0  # seconds a result nobody retrieves is kept
SWEEP_EVERY = 1.0  # seconds between looks for expired results
MAX_BATCH_MEMBERS = 8  # jobs in one batched pass
MAX_BATCH_TOKENS = 65536  # their tokens: a pass that fails runs again job by job, which this bounds


@dataclass
class Result:
    body: bytes | dict  # bytes: protobuf; dict: JSON
    error: str | None = None  # set: the job failed with this message
    user_error: bool = False


@dataclass(frozen=True)
class Batchable:
    """How a job runs in one pass with the jobs queued right behind it."""

    group: Hashable  # jobs of one group only, run by the first one's runner
    member: Hashable  # who sent it: one job per member in a batch, so no member's requests are reordered
    payload: object  # what the runner gets for this job
    # [payload] -> per payload its result body or the exception it failed with; a runner that raises must have
    # changed nothing, since each job then runs alone
    runner: Callable[[list], list]
    tokens: int = 0  # its share of the first job's max_tokens
    max_members: int = MAX_BATCH_MEMBERS  # jobs in a batch led by this one
    max_tokens: int = MAX_BATCH_TOKENS  # their tokens


class Job:
    def __init__(self, job_id: str, run: Callable[[], bytes | dict], batch: Batchable | None = None):
        self.id, self.run, self.batch = job_id, run, batch
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
        self._queue: deque[Job | None] = deque()  # None: stop
        self._queued = threading.Condition()
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

    def submit(self, run: Callable[[], bytes | dict], key: tuple | None = None, batch: Batchable | None = None) -> str:
        """Queues run() (batch: how it may run with the jobs behind it instead) -> the job's id."""
        self.sweep()
        with self._lock:
            if key is not None and key in self._by_key:
                return self._by_key[key]
            job = Job(f"{next(self._ids)}-{uuid.uuid4().hex[:12]}", run, batch)
            self._jobs[job.id] = job
            if key is not None:
                self._by_key[key], self._key_of[job.id] = job.id, key
        self._put(job)
        return job.id

    def queued(self) -> int:
        """Jobs waiting for the worker (not the one it runs)."""
        with self._queued:
            return len(self._queue)

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
        self._put(None)
        self._thread.join(timeout=30)

    def _put(self, job: Job | None) -> None:
        with self._queued:
            self._queue.append(job)
            self._queued.notify()

    def _take(self) -> list[Job]:
        """The next job and the jobs right behind it that run in one pass with it; [] to stop."""
        with self._queued:
            while not self._queue:
                self._queued.wait()
            first = self._queue.popleft()
            if first is None:
                return []
            batch = [first]
            if first.batch is None:
                return batch
            members, tokens = {first.batch.member}, first.batch.tokens
            while self._queue and len(batch) < first.batch.max_members:
                part = getattr(self._queue[0], "batch", None)  # the stop marker has none
                if (part is None or part.group != first.batch.group or part.member in members
                        or tokens + part.tokens > first.batch.max_tokens):
                    break
                batch.append(self._queue.popleft())
                members.add(part.member)
                tokens += part.tokens
            return batch

    def _work(self) -> None:
        while batch := self._take():
            if len(batch) == 1:
                self._run_alone(batch[0])
            else:
                self._run_batch(batch)
            del batch  # nothing of a finished request stays referenced while the worker waits

    def _run_batch(self, batch: list[Job]) -> None:
        runner, payloads = batch[0].batch.runner, [job.batch.payload for job in batch]
        try:
            outcomes = runner(payloads)
        except Exception:  # noqa: BLE001 - the pass failed as a whole, having changed nothing: each job runs alone
            traceback.print_exc(file=sys.stderr)
            del payloads
            for job in batch:
                self._run_alone(job)
            return
        del payloads
        if len(outcomes) != len(batch):  # the pass ran: running its jobs again could apply them twice
            outcomes = [RuntimeError(f"a batch runner gave {len(outcomes)} outcomes for {len(batch)} jobs")] * len(batch)
        for job, outcome in zip(batch, outcomes):
            job.run = job.batch = None
            self._finish(job, _result(outcome))

    def _run_alone(self, job: Job) -> None:
        run, job.run, job.batch = job.run, None, None  # the request (a closure over its parsed body) goes once it has run
        try:
            outcome = run()
        except Exception as err:  # noqa: BLE001 - the server goes on serving; the client gets the message
            outcome = err
        del run
        self._finish(job, _result(outcome))

    def _finish(self, job: Job, result: Result) -> None:
        try:  # nothing here may end the worker thread: every later request would wait forever
            with self._lock:  # before the result is visible, so that its first retrieval shortens this
                self._expires[job.id] = self._clock() + UNRETRIEVED_TTL
            job.finish(result)
            self.sweep()
        except Exception:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)


def _result(outcome: bytes | dict | Exception) -> Result:
    """A job's outcome as its result: a ServeError is the client's mistake, any other exception this server's
    fault (its traceback printed)."""
    if isinstance(outcome, ServeError):
        return Result({}, outcome.message, user_error=True)
    if isinstance(outcome, Exception):
        traceback.print_exception(type(outcome), outcome, outcome.__traceback__, file=sys.stderr)
        return Result({}, f"rlora serve failed: {type(outcome).__name__}: {outcome}")
    return Result(outcome)
