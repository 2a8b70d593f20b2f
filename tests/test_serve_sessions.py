"""`rlora serve`'s sessions and what they hold: finishing a session (the SDK's close) or leaving it without a
heartbeat frees its training clients and samplers (their adapters leave the model); the numbers of clients and
samplers are capped with a 429 the SDK does not retry; a training client id is made once (409 for a
create_model or create_training_client_from_state with an id the other made; a resent request gets its first
future), and the two requests never share a resend key."""

import time

import httpx
import pytest
import tinker
from serve_helpers import KEY, running_server
from tinker import types

from rlora.models.tiny import build_random_model
from rlora.serve.worker import IDLE_ADAPTER

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
API = "/api/v1"
DATUM = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                    loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = str(build_random_model(tmp_path_factory.mktemp("serve") / "model", seed=0))
    with running_server(model_dir, tmp_path_factory.mktemp("serve-state")) as (url, served):
        http = httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60)
        yield url, model_dir, served, http
        http.close()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not freed in time"
        time.sleep(0.02)


def result(http: httpx.Client, future: dict) -> dict:
    while True:
        out = http.post(f"{API}/retrieve_future", json={"request_id": future["request_id"]}).json()
        if out.get("type") != "try_again":
            return out


def held_by(served, session_id: str) -> list[str]:
    worker = served.worker
    return [i for i in [*worker.trainees, *worker.samplers] if i.startswith(f"{session_id}:")]


def test_finishing_a_session_frees_its_clients_and_samplers(server):
    url, model_dir, served, http = server
    worker = served.worker
    keep = tinker.ServiceClient(base_url=url, api_key=KEY)
    kept = keep.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
    training.forward_backward([DATUM], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    prompt, params = types.ModelInput.from_ints([5, 6]), types.SamplingParams(max_tokens=3, seed=1)
    unnamed = training.save_weights_and_get_sampling_client().result()
    named = service.create_sampling_client(model_path=training.save_weights_for_sampler("s").result().path).result()
    for sampler in (unnamed, named):
        sampler.sample(prompt, 1, params).result()  # loaded as adapters
    session_id = training.model_id.split(":")[0]
    adapter = worker.trainees[training.model_id].peft_name
    assert len(held_by(served, session_id)) == 3 and len(worker.loaded) == 2
    service.close("success").result(timeout=30)
    wait_for(lambda: not held_by(served, session_id))
    assert adapter not in worker.model.peft_config and not worker.loaded
    assert http.post(f"{API}/session_heartbeat", json={"session_id": session_id}).status_code == 410
    assert http.post(f"{API}/sessions/{session_id}/finish", json={}).status_code == 200  # again: no error
    # the other session's client goes on; a new adapter after the deleted ones works
    kept.forward_backward([DATUM], "cross_entropy").result()
    kept.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert len(kept.save_weights_and_get_sampling_client().result().sample(prompt, 1, params).result().sequences) == 1
    keep.close("success").result(timeout=30)
    wait_for(lambda: not worker.trainees and not worker.samplers)
    assert list(worker.model.peft_config) == [IDLE_ADAPTER]  # every client's gone: the base samples, new ones come
    again = tinker.ServiceClient(base_url=url, api_key=KEY)
    base = again.create_sampling_client(base_model=model_dir).result()
    bare = base.sample(prompt, 2, params).result().sequences
    fresh = again.create_lora_training_client(base_model=model_dir, rank=2, seed=0).result()
    fresh.forward_backward([DATUM], "cross_entropy").result()
    fresh.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert [s.tokens for s in base.sample(prompt, 2, params).result().sequences] == [s.tokens for s in bare]
    again.close("success").result(timeout=30)


def test_a_session_without_heartbeats_ends(server, monkeypatch):
    _, model_dir, served, http = server
    session = http.post(f"{API}/create_session", json={}).json()["session_id"]
    model = result(http, http.post(f"{API}/create_model", json={
        "session_id": session, "model_seq_id": 0, "base_model": model_dir, "lora_config": {"rank": 2}}).json())
    assert model["model_id"] in served.worker.trainees
    monkeypatch.setattr(served, "session_timeout", 0.2)
    time.sleep(0.5)
    http.post(f"{API}/create_session", json={})  # a new session's arrival ends the silent ones
    wait_for(lambda: not held_by(served, session))
    response = http.post(f"{API}/session_heartbeat", json={"session_id": session})
    assert response.status_code == 410 and "has finished" in response.text
    for route, body in [("optim_step", {"model_id": model["model_id"], "adam_params": {}}),
                        ("get_info", {"model_id": model["model_id"]})]:
        response = http.post(f"{API}/{route}", json=body)
        assert response.status_code == 410 and "is gone: its session has finished" in response.text, route


def test_clients_and_samplers_are_capped(server, monkeypatch):
    _, model_dir, served, http = server
    session = http.post(f"{API}/create_session", json={}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": model_dir, "lora_config": {"rank": 2}}
    result(http, http.post(f"{API}/create_model", json=create).json())
    monkeypatch.setattr(served.worker, "max_trainees", len(served.worker.trainees))
    monkeypatch.setattr(served.worker, "max_samplers", len(served.worker.samplers) - len(served.worker.unnamed))
    response = http.post(f"{API}/create_model", json={**create, "model_seq_id": 1})
    assert response.status_code == 429 and "training clients already" in response.text
    assert response.headers["x-should-retry"] == "false"  # else the SDK would retry it for minutes
    response = http.post(f"{API}/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                                   "base_model": model_dir})
    assert response.status_code == 429 and "sampling sessions already" in response.text
    http.post(f"{API}/sessions/{session}/finish", json={})


def test_a_training_client_id_is_made_once(server):
    url, model_dir, _, http = server
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
    path = training.save_state("made-once").result().path
    session, seq = training.model_id.split(":train:")
    create = {"session_id": session, "model_seq_id": int(seq), "base_model": model_dir, "lora_config": {"rank": 4}}
    response = http.post(f"{API}/create_model", json=create)  # the SDK's own request again: a resend
    assert response.status_code == 200 and result(http, response.json())["model_id"] == training.model_id
    load_new = {"path": path, "session_id": session, "model_seq_id": int(seq)}
    response = http.post(f"{API}/load_weights", json=load_new)  # once the same resend key as create_model
    assert response.status_code == 409 and "exists already" in response.text
    # a client made from the checkpoint: a create_model with its id is refused, not answered with its future
    loaded = result(http, http.post(f"{API}/load_weights", json={**load_new, "model_seq_id": 50}).json())
    assert loaded["model_id"] == f"{session}:train:50"
    response = http.post(f"{API}/create_model", json={**create, "model_seq_id": 50})
    assert response.status_code == 409 and response.headers["x-should-retry"] == "false"
    # a resent create_model (the same id, still held) gets its first future, not a refusal
    fresh = {**create, "model_seq_id": 60}
    first, again = (http.post(f"{API}/create_model", json=fresh).json() for _ in range(2))
    assert first["request_id"] == again["request_id"]
    service.close("success").result(timeout=30)
