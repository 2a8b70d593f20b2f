"""`rlora serve` and bad input: malformed payloads, unknown ids, refused features, oversize bodies, a wrong API key
and a job that fails inside the worker each get a clean error with a message, and the server goes on serving
(checked after each with a real request); the command refuses bad arguments in one line, exit code 2."""

import ipaddress
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
from serve_helpers import KEY, running_server
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from rlora.cli import main
from rlora.errors import UserError
from rlora.models.tiny import build_random_model
from rlora.serve.main import host_url, listen

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
API = "/api/v1"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("serve") / "model", seed=0))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, tmp_path_factory.mktemp("serve-state"), max_body=1 << 20) as (url, served):
        yield url, served


@pytest.fixture(scope="module")
def trainee(server, model_dir):
    """(ServiceClient, TrainingClient, a cross-entropy datum)."""
    url, _ = server
    service = tinker.ServiceClient(base_url=url, api_key=KEY)
    training = service.create_lora_training_client(base_model=model_dir, rank=4, seed=0).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1.0, 1.0, 1.0]})
    yield service, training, datum
    service.close("success").result(timeout=30)


def still_serves(training, datum) -> None:
    out = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert np.isfinite(out.metrics["loss:sum"])


def fb_body(model_id: str, data: list, loss_fn: str = "cross_entropy", forward_only: bool = False) -> bytes:
    """A forward_backward body as the SDK writes it (its own encoder)."""
    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
                                           model_id=model_id, seq_id=10_000)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def broken(model_id: str, datum, change) -> bytes:
    """A forward_backward body as the SDK writes it, then changed by change(the first datum's message)."""
    message = pb.ForwardBackwardRequest()
    message.ParseFromString(fb_body(model_id, [datum]))
    change(message.data[0])
    return message.SerializeToString()


def odd_token_bytes(datum) -> None:
    datum.model_input[0].encoded_text.tokens = b"\x05\x00\x00\x00\x06"


def negative_shape(datum) -> None:
    weights = datum.loss_fn_inputs["weights"]
    del weights.shape[:]
    weights.shape.extend([-1, -4])


def huge_sparse(datum) -> None:  # a 2**80-value tensor if it were made dense
    weights = datum.loss_fn_inputs["weights"]
    del weights.shape[:]
    weights.shape.extend([1 << 40, 1 << 40])
    weights.sparse_csr.values = np.ones(1, np.float32).tobytes()
    weights.sparse_csr.crow_indices = np.array([0, 1], np.int64).tobytes()
    weights.sparse_csr.col_indices = np.zeros(1, np.int64).tobytes()


def chunked(size: int):
    """A body sent without a Content-Length (chunked transfer encoding)."""
    for _ in range(size // (64 << 10)):
        yield b"x" * (64 << 10)


def test_losses_this_server_does_not_run_are_refused_with_a_message(trainee):
    _, training, datum = trainee
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'stable_reinforce' is not served by rlora serve"):
        training.forward_backward([datum], "stable_reinforce").result()
    rl = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        "target_tokens": [6, 7, 8, 9], "logprobs": [-1.0] * 4, "advantages": [1.0, -1.0, 0.5, 0.0]})
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' needs loss_fn_config beta .it has no default"):
        training.forward_backward([rl], "dro").result()
    with pytest.raises(tinker.BadRequestError, match="dro: loss_fn_config beta must be >= 0"):
        training.forward_backward([rl], "dro", {"beta": -0.1}).result()
    with pytest.raises(tinker.BadRequestError, match="cispo: loss_fn_config needs clip_low_threshold <= 1"):
        training.forward_backward([rl], "cispo", {"clip_low_threshold": 1.1}).result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'gspo' needs loss_fn_inputs sequence_ratio_mask"):
        training.forward_backward([rl], "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
    gspo = types.Datum(model_input=datum.model_input, loss_fn_inputs={
        **rl.loss_fn_inputs, "sequence_ratio_mask": np.zeros(4, dtype=np.float32)})
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'gspo' needs loss_fn_config clip_low_threshold, "
                                                     "clip_high_threshold .it has no default"):
        training.forward_backward([gspo], "gspo").result()
    with pytest.raises(tinker.BadRequestError, match="datum 0: loss_fn_inputs\\['sequence_ratio_mask'\\] marks no token"):
        training.forward_backward([gspo], "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}).result()
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs logprobs, advantages"):
        training.forward_backward([datum], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn_config beta"):
        training.forward_backward([datum], "cross_entropy", {"beta": 0.1}).result()
    still_serves(training, datum)


def test_malformed_requests_get_a_4xx_and_the_server_goes_on(server, trainee, model_dir):
    url, _ = server
    _, training, datum = trainee
    http = httpx.Client(base_url=url, headers={"X-API-Key": KEY}, timeout=60)
    session = http.post(f"{API}/create_session", json={"tags": [], "sdk_version": "x"}).json()["session_id"]
    good = {"session_id": session, "model_seq_id": 99, "base_model": model_dir, "lora_config": {"rank": 4}}
    nan = types.Datum(model_input=datum.model_input,
                      loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, float("nan"), 1.0, 1.0]})
    outside = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 10**6]), loss_fn_inputs={"target_tokens": [6, 7, 8]})
    short = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]), loss_fn_inputs={"target_tokens": [6, 7]})
    fractional = types.Datum(model_input=datum.model_input,
                             loss_fn_inputs={"target_tokens": np.array([6.0, 7.5, 8.0, 9.0], np.float32)})
    extra = types.Datum(model_input=datum.model_input,
                        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "advantages": [1.0, 1.0, 1.0, 1.0]})
    sample = {"sampling_session_id": "nope", "prompt": {"chunks": [{"tokens": [5, 6]}]}, "sampling_params": {"max_tokens": 4}}
    cases = [
        ("post", "create_model", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "JSON"),
        ("post", "create_model", {"json": {**good, "lora_config": {"rank": "four"}}}, 422, "rank"),
        ("post", "create_model", {"json": {**good, "base_model": "Qwen/Qwen3-8B"}}, 400, "unknown base model"),
        ("post", "create_model", {"json": {**good, "session_id": "nope"}}, 404, "unknown session"),
        ("post", "create_model", {"json": {**good, "lora_config": {"rank": 4, "train_mlp": False, "train_attn": False,
                                                                   "train_unembed": False}}}, 400, "nothing to train"),
        ("post", "forward_backward", {"content": b"\xff\x00garbage"}, 400, "not a ForwardBackwardRequest"),
        ("post", "forward_backward", {"content": fb_body("nope:train:0", [datum])}, 404, "unknown model_id"),
        ("post", "forward_backward", {"content": fb_body(training.model_id, [nan])}, 400, "NaN"),
        ("post", "forward_backward", {"content": fb_body(training.model_id, [outside])}, 400, "outside the vocabulary"),
        ("post", "forward_backward", {"content": fb_body(training.model_id, [short])}, 400, "values per input token"),
        ("post", "forward_backward", {"content": fb_body(training.model_id, [fractional])}, 400,
         "target_tokens'] holds non-integer values"),
        ("post", "forward_backward", {"content": fb_body(training.model_id, [extra])}, 400,
         "loss_fn 'cross_entropy' does not use loss_fn_inputs advantages (it takes: target_tokens, weights)"),
        ("post", "forward_backward", {"content": b"x" * (2 << 20)}, 413, "request body over"),
        ("post", "forward_backward", {"content": chunked(2 << 20)}, 413, "request body over"),
        ("post", "create_model", {"content": chunked(2 << 20), "headers": {"content-type": "application/json"}}, 413,
         "request body over"),
        ("post", "forward_backward", {"content": broken(training.model_id, datum, odd_token_bytes)}, 400,
         "5 bytes of tokens are not whole int32 values"),
        ("post", "forward_backward", {"content": broken(training.model_id, datum, negative_shape)}, 400,
         "shape [-1, -4] with 4 values: it must be [n]"),
        ("post", "forward_backward", {"content": broken(training.model_id, datum, huge_sparse)}, 400,
         "a sparse tensor"),
        ("post", "optim_step", {"json": {"model_id": "nope:train:0", "adam_params": {}}}, 404, "unknown model_id"),
        ("post", "optim_step", {"json": {"model_id": training.model_id, "optimizer_params": {"type": "dimuon"}}}, 400,
         "'dimuon' is not served"),
        ("post", "optim_step", {"json": {"model_id": training.model_id, "adam_params": {"learning_rate": -1}}}, 422,
         "learning_rate"),
        ("post", "optim_step", {"content": ('{"model_id": "' + training.model_id + '", "adam_params": '
                                            '{"learning_rate": Infinity}}').encode(),
                                "headers": {"content-type": "application/json"}},
         422, "finite number"),
        ("post", "retrieve_future", {"json": {"request_id": "nope"}}, 404, "unknown request_id"),
        ("post", "asample", {"json": sample}, 404, "unknown or expired sampling session"),
        ("post", "save_weights_for_sampler", {"json": {"model_id": training.model_id, "path": "../escape"}}, 400,
         "not usable"),
        ("post", "create_sampling_session", {"json": {"session_id": session, "sampling_session_seq_id": 50,
                                                      "model_path": "tinker://x/weights/y"}}, 400, "sampler_weights"),
        ("post", "create_sampling_session", {"json": {"session_id": session, "sampling_session_seq_id": 51,
                                                      "model_path": "tinker://x/sampler_weights/none"}}, 404, "no saved weights"),
        ("get", "no_such_route", {}, 404, "Not Found"),
    ]
    for method, route, kwargs, status, message in cases:
        response = getattr(http, method)(f"{API}/{route}", **kwargs)
        assert response.status_code == status and message in response.text, (route, response.status_code, response.text)
    # a base sampler with requests it cannot serve
    base = http.post(f"{API}/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 52,
                                                              "base_model": model_dir}).json()["sampling_session_id"]
    sample["sampling_session_id"] = base
    def targets(data, shape, **csr):  # a target_prompt_logprobs TensorData (the prompt [5, 6] has one row)
        return {"target_prompt_logprobs": {"data": data, "dtype": "int64", "shape": shape, **csr}}

    for update, message in [({"topk_sample_logprobs": 10**6}, "topk_sample_logprobs 1000000 is outside 0 .. "),
                            ({"prompt_alt_tokens_k": 1025}, "prompt_alt_tokens_k 1025 is outside 0 .. 1024"),
                            (targets([1, 2], [2, 1]), "it must be [1, K]"),
                            (targets([1.5], [1, 1]), "not a whole number"),
                            ({"target_prompt_logprobs": {"data": [1], "dtype": "float32", "shape": [1, 1]}},
                             "must hold int64 token ids"),
                            (targets([1, 2], [1, 3]), "2 values for shape [1, 3]"),
                            (targets([10**6], [1, 1]), "token id 1000000 is outside the vocabulary"),
                            (targets([-2], [1, 1]), "token id -2 is outside the vocabulary"),
                            (targets([10**30], [1, 1]), "token id 1000000000000000019884624838656 is outside"),
                            (targets([3], [1, 1], sparse_crow_indices=[0, 10**30], sparse_col_indices=[0]),
                             "the sparse CSR indices do not describe 1 values"),
                            (targets([10**400], [1, 1]), "a number too large to be a token id or an index"),
                            (targets([3, 4], [1, 3], sparse_crow_indices=[0, 2], sparse_col_indices=[2, 0]),
                             "ascending and distinct within a row"),
                            (targets([3, 4], [1, 3], sparse_crow_indices=[0, 2], sparse_col_indices=[1, 1]),
                             "ascending and distinct within a row"),
                            ({"topk_sample_logprobs": 300, "num_samples": 1024, "sampling_params": {"max_tokens": 64}},
                             "= 19660800 entries, over 16777216"),
                            (targets([3], [1, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[2]),
                             "the sparse CSR indices do not describe 1 values"),
                            (targets([3, 4], [1, 2], sparse_crow_indices=[0, 1], sparse_col_indices=[0, 1]),
                             "the sparse CSR indices do not describe 2 values"),
                            ({"topk_prompt_logprobs": 10**6}, "topk_prompt_logprobs 1000000 is outside 0 .. "),
                            ({"prompt_logprobs_last_n": 1}, "prompt_logprobs_last_n 1 needs prompt_logprobs"),
                            ({"sampling_params": {}}, "max_tokens is required"),
                            ({"sampling_params": {"max_tokens": 5000}}, "exceed the model's 2048 positions"),
                            ({"prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]}}, "encoded_text")]:
        response = http.post(f"{API}/asample", json={**sample, **update})
        assert 400 <= response.status_code < 500 and message in response.text, (update, response.text)
    # a request sent again (the same model and seq_id: a retry) gets the first one's future, it does not run twice
    first, again = (http.post(f"{API}/forward_backward", content=fb_body(training.model_id, [datum], forward_only=True))
                    for _ in range(2))
    assert first.status_code == 200 and first.json()["request_id"] == again.json()["request_id"]
    assert http.post(f"{API}/session_heartbeat", json={"session_id": session}).json() == {"type": "session_heartbeat"}
    assert http.post(f"{API}/session_heartbeat", json={"session_id": "nope"}).status_code == 404
    assert http.get(f"{API}/healthz").json() == {"status": "ok"}
    still_serves(training, datum)


def test_a_job_that_fails_inside_the_worker_fails_its_future_only(server, trainee):
    _, served = server
    service, training, datum = trainee
    saved = training.save_weights_for_sampler("to-be-removed").result()
    sampler = service.create_sampling_client(model_path=saved.path).result()
    [folder] = list(served.state.root.glob("models/*/sampler_weights/to-be-removed"))
    shutil.rmtree(folder)  # the adapter is read when first sampled: gone by then
    with pytest.raises(tinker.RequestFailedError, match="to-be-removed is gone .its ttl_seconds passed, or it was removed"):
        sampler.sample(types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=3)).result()
    still_serves(training, datum)
    base = service.create_sampling_client(base_model=served.names[0]).result()
    assert len(base.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=3)).result().sequences) == 2


def test_an_api_key_is_required_when_one_is_set(model_dir, tmp_path):
    with running_server(model_dir, tmp_path / "state", api_key=KEY) as (url, _):
        assert httpx.get(f"{url}{API}/get_server_capabilities").status_code == 401
        assert httpx.get(f"{url}{API}/get_server_capabilities", headers={"X-API-Key": "tml-wrong"}).status_code == 401
        assert httpx.get(f"{url}{API}/healthz").status_code == 200
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        training = service.create_lora_training_client(base_model=model_dir, rank=2).result()
        assert training.get_info().lora_rank == 2
        service.close("success").result(timeout=30)


def test_the_command_refuses_bad_arguments_in_one_line(model_dir, tmp_path, capsys, monkeypatch):
    held = socket.create_server(("127.0.0.1", 0))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    cases = [
        (["--host", "0.0.0.0"], "would serve other machines: give an --api-key"),
        (["--api-key", "secret"], "--api-key must start with 'tml-'"),
        (["--port", "70000"], "is not a TCP port"),
        (["--prefix-cache-mb", "-1"], "--prefix-cache-mb -1 is negative: give 0 (no prefix cache) or more"),
        (["--port", str(held.getsockname()[1])], "cannot listen on 127.0.0.1"),
        (["--model", str(tmp_path / "missing")], f"--model '{tmp_path / 'missing'}' not found"),
        (["--model", "smollm2-135m"], "did you mean 'smollm2-135m-instruct'?"),
        (["--model", model_dir, "--state-dir", str(not_a_folder)], "is not a writable folder"),
    ]
    for args, message in cases:
        assert main(["serve", "--port", "0", "--state-dir", str(tmp_path / "state"), *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("rlora: error: ") and message in err and err.count("\n") == 1, (args, err)
    held.close()
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # the serve extra not installed
    monkeypatch.delitem(sys.modules, "rlora.serve.main", raising=False)
    assert main(["serve", "--state-dir", str(tmp_path / "state")]) == 2
    assert "needs the serve extra (uvicorn is missing): pip install 'rlora[serve]'" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_the_socket_binds_the_hosts_address_family(host):
    """--host ::1 was refused ('Address family for hostname not supported'): the socket was always IPv4."""
    try:
        sock = listen(host, 0)
    except UserError as err:
        if host == "::1" and not socket.has_ipv6:
            pytest.skip(f"no IPv6 here: {err}")
        raise
    try:
        bound = sock.getsockname()[0]
        assert ipaddress.ip_address(bound).is_loopback, bound
        # a host name binds IPv4 whatever /etc/hosts lists first: clients given 127.0.0.1 must reach it
        assert sock.family == (socket.AF_INET6 if host == "::1" else socket.AF_INET)
        port = sock.getsockname()[1]
        with socket.create_connection((bound, port), timeout=5):  # it accepts on the address it reports
            pass
        assert host_url(host, port) == (f"[::1]:{port}" if host == "::1" else f"{host}:{port}")
    finally:
        sock.close()


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no dual-stack IPv6 here")
def test_every_address_of_ipv6_includes_ipv4():
    """--host :: binds every address, IPv4 clients included (IPV6_V6ONLY would refuse 127.0.0.1)."""
    sock = listen("::", 0)
    try:
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=5):
            pass
    finally:
        sock.close()


def test_port_0_serves_on_a_free_port_and_says_which(model_dir, tmp_path):
    """--port 0 printed 'http://127.0.0.1:0', an address no client can use: the bound port is printed."""
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(Path(sys.executable).parent / "rlora"), "serve", "--model", model_dir, "--port",
                                    "0", "--state-dir", str(tmp_path / "state")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"TINKER_BASE_URL=(http://127\.0\.0\.1:(\d+))", log_path.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        url, port = found.group(1), int(found.group(2))
        assert port != 0 and f"on {url} " in log_path.read_text()
        while True:  # the line is printed just before the server starts answering
            try:
                assert httpx.get(f"{url}{API}/healthz", timeout=2).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
    finally:
        process.terminate()
        process.wait(timeout=60)
