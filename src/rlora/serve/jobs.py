"""Futures and the one worker thread that runs every model request, in arrival order.

An HTTP handler checks a request, queues a job and answers at once with the job's id (the SDK's
UntypedAPIFuture); the SDK then asks retrieve_future for the result, which waits up to LONG_POLL seconds for
it (the SDK polls again at once on `try_again`, so waiting here keeps it from spinning). A job that fails
with ServeError is the client's mistake (category 'user'); any other exception is this server's fault
(category 'server', the traceback printed): either way the worker goes on with the next job.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import sys
import threading
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from rlora.serve.state import ServeError

LONG_POLL = 20.0  # seconds a retrieve_future waits for its job (the SDK's own timeout for it is 45 s)
KEEP_DONE = 4096  # finished results kept for a repeated retrieve (a lost response, a retry)


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
            loop.call_soon_threadsafe(_resolve, waiter)

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
    """The job table and the worker thread."""

    def __init__(self):
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._jobs: dict[str, Job] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._by_key: dict[tuple, str] = {}  # (model or sampler id, seq_id) -> job id: a resent request is not run twice
        self._key_of: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._work, name="rlora-serve-worker", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], bytes | dict], key: tuple | None = None) -> str:
        with self._lock:
            if key is not None and key in self._by_key:
                return self._by_key[key]
            job = Job(f"{next(self._ids)}-{uuid.uuid4().hex[:12]}", run)
            self._jobs[job.id] = job
            if key is not None:
                self._by_key[key], self._key_of[job.id] = job.id, key
        self._queue.put(job)
        return job.id

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                result = Result(job.run())
            except ServeError as err:
                result = Result({}, err.message, user_error=True)
            except Exception as err:  # noqa: BLE001 - the server goes on serving; the client gets the message
                traceback.print_exc(file=sys.stderr)
                result = Result({}, f"rlora serve failed: {type(err).__name__}: {err}")
            job.finish(result)
            self._forget_old(job.id)

    def _forget_old(self, job_id: str) -> None:
        with self._lock:
            self._done[job_id] = None
            while len(self._done) > KEEP_DONE:
                old, _ = self._done.popitem(last=False)
                self._jobs.pop(old, None)
                self._by_key.pop(self._key_of.pop(old, None), None)
