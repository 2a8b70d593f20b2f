"""A time limit on Python code run in the main thread (reward functions, environment steps, tool calls).

A watchdog thread signals the main thread (SIGUSR2, whose handler rlora installs once and which does nothing
unless a deadline passed); Python code is interrupted at once, a call blocked in C code when it returns to
Python. Code that uses SIGALRM itself (math-verify does) does not disturb it, and if the interruption is
somehow swallowed (a bare `except BaseException`) the call still fails when it returns. Outside the main thread
(or without pthread_kill) there is no limit: signals reach only the main thread, where training runs.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class TimeLimitExceeded(Exception):
    """The limited code did not finish in time (raised after it has been interrupted)."""


class _Interrupt(BaseException):
    """Raised in the main thread when its deadline passes. A BaseException, so that the limited code's own
    `except Exception` cannot swallow it."""


class _Watch:
    """The call being timed (at most one: limited calls run in the main thread, one after another)."""

    lock = threading.Lock()
    active: object | None = None
    handler_installed = False


def _on_signal(signum, frame) -> None:
    with _Watch.lock:
        timed = _Watch.active
    if timed is not None and timed.is_set():
        raise _Interrupt()


@contextmanager
def time_limit(seconds: float | None, message: str):
    """Raise TimeLimitExceeded(message) if the block runs longer than `seconds` (None or 0: no limit)."""
    usable = hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread()
    if not seconds or not usable:
        yield
        return
    if not _Watch.handler_installed:
        signal.signal(signal.SIGUSR2, _on_signal)
        _Watch.handler_installed = True
    expired = threading.Event()
    main_thread = threading.main_thread().ident

    def fire() -> None:
        with _Watch.lock:
            if _Watch.active is expired:
                expired.set()
                signal.pthread_kill(main_thread, signal.SIGUSR2)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    with _Watch.lock:
        outer, _Watch.active = _Watch.active, expired
    timer.start()
    try:
        try:
            yield
        finally:
            with _Watch.lock:
                _Watch.active = outer
            timer.cancel()
    except _Interrupt:
        raise TimeLimitExceeded(message) from None
    if expired.is_set():
        raise TimeLimitExceeded(message)
