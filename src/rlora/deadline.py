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
    """The innermost limit being timed (limits nest: a tool call's inside an environment step's). Written by the
    main thread only; the timers' threads read it under the lock, the signal handler (main thread) without."""

    lock = threading.Lock()
    active: threading.Event | None = None
    handler_installed = False


def _on_signal(signum, frame) -> None:
    # no lock here: the handler runs in the main thread between two bytecodes, possibly while it holds the lock
    timed = _Watch.active
    if timed is not None and timed.is_set():
        raise _Interrupt()


@contextmanager
def time_limit(seconds: float | None, message: str):
    """Raise TimeLimitExceeded(message) if the block runs longer than `seconds` (None or 0: no limit). Limits
    nest; when an enclosing limit passes first (or with this one), the enclosing block reports it."""
    usable = hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread()
    if not seconds or not usable:
        yield
        return
    if not _Watch.handler_installed:
        signal.signal(signal.SIGUSR2, _on_signal)
        _Watch.handler_installed = True
    expired = threading.Event()
    main_thread = threading.main_thread().ident

    def fire() -> None:  # in the timer's thread
        with _Watch.lock:
            expired.set()
            if _Watch.active is expired:  # an inner limit is active: this one fires when the inner one ends
                signal.pthread_kill(main_thread, signal.SIGUSR2)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    outer = _Watch.active
    with _Watch.lock:
        _Watch.active = expired
    timer.start()
    try:
        try:
            yield
        finally:
            _Watch.active = outer  # first: an interruption below must not leave this limit active
            timer.cancel()
            if outer is not None and outer.is_set():  # the enclosing limit passed while this one ran
                signal.pthread_kill(main_thread, signal.SIGUSR2)
    except _Interrupt:
        if (outer is not None and outer.is_set()) or not expired.is_set():
            raise  # the enclosing limit's: its own block reports it
        raise TimeLimitExceeded(message) from None
    if expired.is_set():
        raise TimeLimitExceeded(message)
