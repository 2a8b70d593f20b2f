"""`rlora serve` in this process for the tests: the real app on a free port of 127.0.0.1 (uvicorn in a thread), on a
tiny random model saved to a folder; the official tinker SDK talks to it over HTTP."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from rlora.serve.main import build

os.environ.setdefault("TINKER_TELEMETRY", "0")  # the SDK's own event reports: the server accepts and drops them

KEY = "tml-rlora-tests"


@contextmanager
def running_server(model_dir: str, state_dir, **options):
    """Yields (base URL, Served); the server stops and its worker thread ends on exit. options: build()'s."""
    app, served = build(model_dir, state_dir, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", served
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        served.jobs.stop()
        sock.close()
