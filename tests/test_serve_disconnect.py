"""`rlora serve` and clients that go away mid-future: a client process killed while it waits for its
forward_backward, and a connection dropped in the middle of a retrieve_future long poll. Their jobs still run,
their results stay retrievable by id, and the server goes on serving others (checked with a real training step)."""

import subprocess
import sys
import textwrap
import threading
import time

import httpx
import numpy as np
import pytest
import tinker
from serve_helpers import KEY, running_server
from test_serve_errors import fb_body
from tinker import types

from rlora.models.tiny import build_random_model

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
API = "/api/v1"
DATUM = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1.0, 1.0, 1.0]})

# A client in its own process: makes a training client, says so, waits for the word, then sends a forward_backward
# and blocks on its result (the test kills it there).
CLIENT = textwrap.dedent("""
    import sys, tinker
    from tinker import types
    service = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
    training = service.create_lora_training_client(base_model=sys.argv[3], rank=4, seed=0).result()
    print("model", training.model_id, flush=True)
    sys.stdin.readline()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4})
    future = training.forward_backward([datum], "cross_entropy")
    print("sent", flush=True)
    future.result()
    print("never here: the job is held", flush=True)
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("serve") / "model", seed=0))


def hold_worker(served) -> threading.Event:
    """Queues a job that keeps the worker busy until the returned event is set: what is sent meanwhile waits."""
    release = threading.Event()
    served.jobs.submit(lambda: {} if release.wait(60) else {})
    return release


def wait_for(condition, what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def still_serves(url: str, model_dir: str) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=model_dir, rank=4, seed=1).result()
    out = training.forward_backward([DATUM], "cross_entropy").result(timeout=60)
    step = training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60)
    assert np.isfinite(out.metrics["loss:sum"]) and step.metrics["grad_norm:mean"] > 0
    service.close("success").result(timeout=30)


def test_a_client_killed_while_it_waits_leaves_the_server_serving(model_dir, tmp_path):
    with running_server(model_dir, tmp_path / "state") as (url, served):
        client = subprocess.Popen([sys.executable, "-c", CLIENT, url, KEY, model_dir], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            line = client.stdout.readline().split()
            assert line[:1] == ["model"], f"the client did not start: {line}"
            model_id = line[1]
            release = hold_worker(served)
            client.stdin.write("go\n")
            client.stdin.flush()
            assert client.stdout.readline().strip() == "sent"
            # its request is queued behind the held job, and the client is in a retrieve_future long poll for it
            wait_for(lambda: served.jobs.queued() == 1, "the client's forward_backward to be queued")
            wait_for(lambda: any(job._waiters for job in list(served.jobs._jobs.values())), "the client's poll")
        finally:
            client.kill()
            client.wait(timeout=30)
        release.set()
        params = served.worker.trainees[model_id].params
        wait_for(lambda: all(p.grad is not None for p in params), "the orphaned forward_backward to run")
        assert any(float(p.grad.abs().sum()) > 0 for p in params)  # it ran in full, for nobody
        still_serves(url, model_dir)


def test_a_connection_dropped_mid_poll_loses_nothing(model_dir, tmp_path):
    with running_server(model_dir, tmp_path / "state") as (url, served):
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
        headers = {"X-API-Key": KEY, "content-type": "application/x-protobuf"}
        release = hold_worker(served)
        sent = httpx.post(f"{url}{API}/forward_backward", content=fb_body(training.model_id, [DATUM]), headers=headers)
        assert sent.status_code == 200, sent.text
        request_id = sent.json()["request_id"]
        poll = {"request_id": request_id}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the server long-polls for it
            httpx.post(f"{url}{API}/retrieve_future", json=poll, headers={"X-API-Key": KEY}, timeout=0.5)
        release.set()
        answer = httpx.post(f"{url}{API}/retrieve_future", json=poll, headers={"X-API-Key": KEY}, timeout=60)
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/x-protobuf")
        assert len(answer.content) > 0  # the forward_backward's result, kept for the client that came back
        still_serves(url, model_dir)
        service.close("success").result(timeout=30)
