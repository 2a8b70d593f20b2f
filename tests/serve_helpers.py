"""`rlora serve` in this process for the tests: the real app on a free port of 127.0.0.1 (uvicorn in a thread), on a
tiny random model saved to a folder; the official tinker SDK talks to it over HTTP."""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import tinker
import uvicorn

from rlora.models.tiny import build_random_model
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


def sdk_server(tmp_path_factory):
    """A module fixture's body: the server on a tiny random model and an SDK ServiceClient on it -> (url, model
    folder, Served, its worker, the service), the service closed afterwards."""
    model_dir = str(build_random_model(tmp_path_factory.mktemp("serve") / "model", seed=0))
    with running_server(model_dir, tmp_path_factory.mktemp("serve-state")) as (url, served):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        yield SimpleNamespace(url=url, model=model_dir, served=served, worker=served.worker, service=service)
        service.close("success").result(timeout=30)
