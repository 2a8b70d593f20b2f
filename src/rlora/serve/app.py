"""The HTTP side of `rlora serve`: the routes the tinker SDK (tinker==0.38.0) calls, under /api/v1/.

Every handler checks its request completely before it queues anything (a bad one gets a 4xx and a one-line
message, and the server goes on), then either answers at once (sessions, capabilities, get_info, sampling
sessions) or queues a job on the worker thread and answers with its future id (create_model,
forward_backward, optim_step, save_weights_for_sampler, asample); retrieve_future hands the result over.
Handlers never touch the model: only the worker thread does.

Sessions end with sessions/{id}/finish (the SDK's ServiceClient.close) or after SESSION_TIMEOUT seconds
without a heartbeat (the SDK sends one every 10 s); either frees the session's training clients and samplers
(a job, after the ones it already queued). Every refusal is a 4xx with `x-should-retry: false`: the SDK
retries a 409 or a 429 on its own otherwise, and no refusal here changes on a retry.
"""

from __future__ import annotations

import math
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from rlora.serve import proto, wire
from rlora.serve.datum_rows import shares_prefixes
from rlora.serve.jobs import LONG_POLL, MAX_BATCH_TOKENS, RETRIEVED_GRACE, UNRETRIEVED_TTL, Batchable, Jobs
from rlora.serve.limits import Limits
from rlora.serve.losses import check_datum, check_loss
from rlora.serve.prompt_scores import check_asks
from rlora.serve.sampling import sampling_settings
from rlora.serve.state import ServeError, StateDir, check_name, check_ttl, parse_path
from rlora.serve.worker import ModelWorker

API = "/api/v1"
MAX_BODY = 64 * 1024 * 1024  # bytes of one request
MAX_SAMPLES = 1024  # num_samples of one sample request
CPU_BATCH_TOKENS = 512  # on a CPU, clients' forward_backward share a pass only up to so many tokens in all
SAMPLES_BATCHED = 64  # sample requests of one session in one sampler call (an RL step sends one per group)
SESSION_TIMEOUT = 900.0  # seconds without a heartbeat after which a session is finished
FINISHED_KEPT = 4096  # finished session ids remembered (their heartbeats get 410, which stops the SDK's)
NO_RETRY = {"x-should-retry": "false"}


@dataclass
class Served:
    """What the routes share: the model's names, the worker, its jobs, the sessions."""

    names: list[str]  # names a client may give the base model; the first is the one reported
    arch: str
    worker: ModelWorker
    jobs: Jobs
    state: StateDir
    api_key: str | None
    max_body: int = MAX_BODY
    session_timeout: float = SESSION_TIMEOUT
    sessions: dict[str, float] = field(default_factory=dict)  # session id -> when it was last heard from
    finished: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def session(self, session_id: str) -> str:
        """The session, alive (it counts as a sign of life); 404 unknown, 410 finished."""
        if session_id not in self.sessions:
            if session_id in self.finished:
                raise ServeError(410, f"session '{session_id}' has finished (closed, or no heartbeat for "
                                      f"{self.session_timeout:.0f} s): its clients are gone")
            raise ServeError(404, f"unknown session '{session_id}' (sessions do not outlive the server)")
        self.sessions[session_id] = time.monotonic()
        return session_id

    def end(self, session_id: str) -> None:
        """The session is over: its clients and samplers are freed once its queued requests have run."""
        self.sessions.pop(session_id, None)
        self.finished[session_id] = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        self.jobs.submit(lambda: self.worker.free_session(session_id))

    def end_silent(self) -> None:
        """Sessions not heard from for session_timeout seconds end."""
        now = time.monotonic()
        for session_id in [s for s, seen in self.sessions.items() if now - seen > self.session_timeout]:
            self.end(session_id)

    def base(self, name: str) -> None:
        if name not in self.names:
            raise ServeError(400, f"unknown base model '{name}': this server serves {' or '.join(map(repr, self.names))}")

    def saved_for(self, base_model: str | None, path: str) -> None:
        if base_model not in self.names:
            raise ServeError(400, f"{path} was saved for the base model '{base_model}', not this server's "
                                  f"'{self.names[0]}'")

    def trainee(self, model_id: str) -> None:
        """The training client exists: 410 where its session has finished (its clients were freed), else the
        worker's 404 for an unknown id."""
        if model_id.split(":train:")[0] in self.finished:  # also while the freeing job is still queued
            raise ServeError(410, f"training client '{model_id}' is gone: its session has finished (closed, or no "
                                  f"heartbeat for {self.session_timeout:.0f} s); save_state and "
                                  "create_training_client_from_state carry a client over to a new session")
        self.worker.trainee(model_id)

    def new_trainee(self, model_id: str, key: tuple) -> None:
        """A new training client may be made (a resent request finds its first future instead)."""
        if self.jobs.has_key(key):
            return
        if model_id in self.worker.trainees:
            raise ServeError(409, f"training client '{model_id}' exists already")
        self.worker.room_for("trainee")

    def sampler(self, sampler_id: str):
        sampler = self.worker.samplers.get(sampler_id)
        if sampler is None:
            raise ServeError(404, f"unknown or expired sampling session '{sampler_id}'")
        return sampler


def resent(*key) -> tuple | None:
    """The key under which a resent request (the same target and seq_id) finds its first future; None: no seq_id."""
    return None if key[1] is None else key


def _finite_or_text(value):
    """A non-finite float as the text 'inf', '-inf' or 'nan' (the SDK's pydantic models read them back as floats)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite_or_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_text(item) for item in value]
    return value


class FiniteJSONResponse(JSONResponse):
    """A non-finite number (the loss of an overflowing batch, the grad norm of a skipped update) has no strict JSON
    form and the SDK's parser (orjson) refuses Infinity/NaN: it goes out as text, which the SDK's float fields
    parse back. Rendering it as a float failed with a 500 on every poll of the result while the SDK retried."""

    def render(self, content) -> bytes:
        try:  # almost always finite: no walk over large token and log-prob lists
            return super().render(content)
        except ValueError:
            return super().render(_finite_or_text(content))


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="rlora serve", docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=FiniteJSONResponse)
    worker, jobs = served.worker, served.jobs

    app.add_middleware(Limits, max_body=served.max_body, api_key=served.api_key, open_paths=(f"{API}/healthz",))

    @app.exception_handler(ServeError)
    async def refused(_request: Request, err: ServeError):
        return JSONResponse({"detail": err.message}, status_code=err.status, headers=NO_RETRY)

    @app.exception_handler(RequestValidationError)
    async def malformed(_request: Request, err: RequestValidationError):
        # one line, without the offending values: FastAPI's own answer echoes them, and an Infinity it cannot
        # write as JSON made that answer a 500
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return JSONResponse({"detail": problems}, status_code=422, headers=NO_RETRY)

    @app.get(f"{API}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post(f"{API}/client/config")
    async def client_config():
        return wire.CLIENT_CONFIG

    @app.post(f"{API}/client/dynamic_config")
    async def client_dynamic_config():
        return wire.DYNAMIC_CONFIG

    @app.post(f"{API}/telemetry")
    async def telemetry():  # the SDK reports its own events; nothing is kept
        return {"status": "accepted"}

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": name, "max_context_length": worker.max_length, "trainable": True,
                                      "sampleable": True} for name in served.names]}

    @app.post(f"{API}/create_session")
    async def create_session(body: wire.CreateSession):
        served.end_silent()
        session_id = uuid.uuid4().hex
        served.sessions[session_id] = time.monotonic()
        return {"type": "create_session", "session_id": session_id}

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(body: wire.SessionHeartbeat):
        served.end_silent()
        served.session(body.session_id)
        return {"type": "session_heartbeat"}

    @app.post(API + "/sessions/{session_id}/finish")
    async def finish(session_id: str, body: wire.Finish):
        if session_id not in served.finished:  # finishing twice is no error (the SDK's close is first-wins)
            served.end(served.session(session_id))
        return {}

    @app.post(f"{API}/create_model")
    async def create_model(body: wire.CreateModel):
        served.session(body.session_id)
        served.base(body.base_model)
        if body.lora_config is None:
            raise ServeError(400, "create_model: rlora serve trains LoRA adapters only: give a lora_config")
        if body.optimizer_config.type != "adamw":
            raise ServeError(400, f"create_model: optimizer '{body.optimizer_config.type}' is not served (adamw only)")
        worker.lora_config(body.lora_config)  # refuses a config with nothing to train
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        key = (model_id, "create_model")
        served.new_trainee(model_id, key)
        job = jobs.submit(lambda: worker.create_model(model_id, body.lora_config), key=key)
        return wire.untyped_future(job, model_id)

    @app.post(f"{API}/get_info")
    async def get_info(body: wire.GetInfo):
        served.trainee(body.model_id)
        trainee = worker.trainee(body.model_id)
        return {"type": "get_info", "model_id": body.model_id, "is_lora": True, "lora_rank": trainee.rank,
                "model_name": served.names[0], "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": served.arch, "model_name": served.names[0], "tokenizer_id": worker.model_path}}

    # on a CPU the base forward is compute-bound from a few hundred tokens on, so batching clients only pays while
    # their requests together are small (bench/serve_batching.py, 4 clients, SmolLM2 / a small Qwen3-MoE: 1.25x /
    # 1.12x at 256 tokens in all, 1.12x / 0.96x at 512, 0.85x / 0.88x at 1024); a GPU batches up to the jobs' cap
    fb_batch_tokens = CPU_BATCH_TOKENS if worker.base.device.type == "cpu" else MAX_BATCH_TOKENS

    @app.post(f"{API}/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-encoding", "identity") != "identity":
            raise ServeError(415, "forward_backward: compressed bodies are not accepted (the client config says so)")
        fb = proto.parse_forward_backward(await request.body())  # its size: limits.py
        served.trainee(fb.model_id)
        given = [set(d.inputs) for d in fb.data]
        config = check_loss(fb.loss_fn, set.intersection(*given), fb.config, set.union(*given))
        for i, datum in enumerate(fb.data):
            worker.check_tokens(datum.tokens, f"datum {i}")  # first: its length bounds every loss input's
            targets = datum.inputs["target_tokens"]
            if targets.dtype.kind == "f" and not (np.isfinite(targets).all() and (targets == np.round(targets)).all()):
                raise ServeError(400, f"datum {i}: loss_fn_inputs['target_tokens'] holds non-integer values: token ids "
                                      "are integers")
            worker.check_tokens(targets.reshape(-1), f"datum {i} target_tokens", positions=False)  # [n] or [n, K]
            for name, values in datum.inputs.items():
                if values.dtype.kind == "f" and not np.isfinite(values).all():
                    raise ServeError(400, f"datum {i}: loss_fn_inputs['{name}'] holds a NaN or an infinity")
            check_datum(fb.loss_fn, i, datum.inputs)
        # other clients' forward_backward queued right behind it run in the same pass (serve/batched.py)
        # (not a request with K targets per token: its rows are [n, K], other clients' [n])
        columns = any(values.ndim == 2 for d in fb.data for values in d.inputs.values())
        # (nor a client whose LoRA inside a mixture-of-experts block the pass cannot route: Trainee.routable)
        trainee = worker.trainees.get(fb.model_id)  # (not made yet, or unknown: runs alone, or gets its 404 there)
        # (nor data that begin alike: alone they run as trees, their shared prefix once: serve/shared_prefix.py)
        alone = (columns or trainee is None or not trainee.routable
                 or shares_prefixes(worker.model, fb.data, worker.min_shared_prefix))
        batch = None if alone else Batchable(
            ("forward_backward", fb.forward_only), fb.model_id, (fb, config), worker.forward_backward_batch,
            tokens=sum(len(d.tokens) for d in fb.data), max_tokens=fb_batch_tokens)
        job = jobs.submit(lambda: worker.forward_backward(fb, config), key=resent(fb.model_id, fb.seq_id, "fb"),
                          batch=batch)
        return wire.untyped_future(job, fb.model_id)

    @app.post(f"{API}/optim_step")
    async def optim_step(body: wire.OptimStep):
        served.trainee(body.model_id)
        if body.adam_params is None:
            kind = (body.optimizer_params or {}).get("type", "unknown")
            raise ServeError(400, f"optim_step: optimizer '{kind}' is not served (Adam only: AdamParams)")
        adam = wire.Adam.of(body.adam_params)
        job = jobs.submit(lambda: worker.optim_step(body.model_id, adam), key=resent(body.model_id, body.seq_id, "optim"))
        return wire.untyped_future(job, body.model_id)

    @app.post(f"{API}/save_weights_for_sampler")
    async def save_weights_for_sampler(body: wire.SaveWeightsForSampler):
        served.trainee(body.model_id)
        if body.kind != "snapshot":
            raise ServeError(400, f"save_weights_for_sampler: kind '{body.kind}' is not served (snapshot only)")
        name = session_id = None
        check_ttl(body.ttl_seconds, "save_weights_for_sampler")
        if body.path is not None:
            name = check_name(body.path, "save_weights_for_sampler name")
        elif body.sampling_session_seq_id is None:
            raise ServeError(400, "save_weights_for_sampler: give a path (a name) or a sampling_session_seq_id")
        else:
            session_id = f"{body.model_id.split(':train:')[0]}:sample:{body.sampling_session_seq_id}"
        job = jobs.submit(lambda: worker.save_for_sampler(body.model_id, name, session_id, body.ttl_seconds),
                          key=resent(body.model_id, body.seq_id, "save_sampler"))
        return wire.untyped_future(job, body.model_id)

    @app.post(f"{API}/save_weights")
    async def save_weights(body: wire.SaveWeights):
        served.trainee(body.model_id)
        if body.path is None:
            raise ServeError(400, "save_weights: give the checkpoint a name (path)")
        name = check_name(body.path, "save_weights name")
        check_ttl(body.ttl_seconds, "save_weights")
        job = jobs.submit(lambda: worker.save_state(body.model_id, name, body.overwrite, body.ttl_seconds),
                          key=resent(body.model_id, body.seq_id, "save"))
        return wire.untyped_future(job, body.model_id)

    @app.post(f"{API}/load_weights")
    async def load_weights(body: wire.LoadWeights):
        path = parse_path(body.path)
        snapshot = served.state.snapshot(path, "weights")  # there, and the right kind, before anything is queued
        served.saved_for(snapshot.config.base_model_name_or_path, body.path)
        if body.session_id is not None:  # a new training client from the checkpoint
            served.session(body.session_id)
            if body.model_seq_id is None:
                raise ServeError(400, "load_weights: a session_id comes with a model_seq_id")
            if body.base_model is not None:
                served.base(body.base_model)
            if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
                raise ServeError(400, f"load_weights: optimizer '{body.optimizer_config.type}' is not served (adamw only)")
            model_id = f"{body.session_id}:train:{body.model_seq_id}"
            key = (model_id, "load_weights_new")
            served.new_trainee(model_id, key)
        elif body.model_id is not None:
            served.trainee(body.model_id)
            model_id, key = body.model_id, resent(body.model_id, body.seq_id, "load")
        else:
            raise ServeError(400, "load_weights: give a model_id (an existing training client) or a session_id")
        new = body.session_id is not None
        job = jobs.submit(lambda: worker.load_state(model_id, path, body.optimizer, new), key=key)
        return wire.untyped_future(job, model_id)

    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(body: wire.CreateSamplingSession):
        served.session(body.session_id)
        worker.room_for("sampler")
        session_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is not None:
            snapshot = served.state.snapshot(parse_path(body.model_path), "sampler_weights")
            served.saved_for(snapshot.config.base_model_name_or_path, body.model_path)
        elif body.base_model is not None:
            served.base(body.base_model)
            snapshot = None
        else:
            raise ServeError(400, "create_sampling_session: give a model_path or a base_model")
        worker.add_sampler(session_id, snapshot, body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    @app.get(API + "/samplers/{sampler_id}")
    async def sampler(sampler_id: str):
        model_path = served.sampler(sampler_id).model_path
        return {"sampler_id": sampler_id, "base_model": served.names[0], "model_path": model_path}

    @app.post(f"{API}/asample")
    async def asample(body: wire.Sample):
        if body.sampling_session_id is None:
            raise ServeError(400, "asample: give a sampling_session_id (create_sampling_session)")
        served.sampler(body.sampling_session_id)
        params = body.sampling_params
        if params.max_tokens is None:
            raise ServeError(400, "asample: sampling_params.max_tokens is required")
        if body.num_samples > MAX_SAMPLES:
            raise ServeError(400, f"asample: num_samples {body.num_samples} is over {MAX_SAMPLES}")
        prompt = body.prompt.tokens()
        if not prompt:
            raise ServeError(400, "asample: the prompt has no tokens")
        last_n = body.prompt_logprobs_last_n
        if last_n is not None and not (body.prompt_logprobs and 1 <= last_n <= len(prompt) - 1):
            raise ServeError(400, f"asample: prompt_logprobs_last_n {last_n} needs prompt_logprobs and a value in 1 .. "
                                  f"{len(prompt) - 1} (the prompt's tokens after the first)")
        worker.check_tokens(prompt, "prompt")
        check_asks(body, len(prompt), worker.vocab_size)
        if len(prompt) + params.max_tokens > worker.max_length:
            raise ServeError(400, f"asample: {len(prompt)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                                  f"model's {worker.max_length} positions")
        if isinstance(params.stop, list) and params.stop and isinstance(params.stop[0], int):
            worker.check_tokens(params.stop, "sampling_params.stop")
        sampler_id = body.sampling_session_id
        # this session's requests queued right behind it with the same num_samples, ending tokens and max_tokens (a
        # batch ends together) run in the same sampler call (worker.sample)
        ends = sampling_settings(params, worker.tok.eos_ids)[1]
        batch = Batchable(
            ("sample", sampler_id, body.num_samples, tuple(ends), params.max_tokens), object(), body,
            lambda bodies: worker.sample(sampler_id, bodies), tokens=len(prompt) + params.max_tokens * body.num_samples,
            max_members=SAMPLES_BATCHED)
        job = jobs.submit(lambda: worker.sample(sampler_id, [body])[0], key=resent(sampler_id, body.seq_id, "sample"),
                          batch=batch)
        return wire.untyped_future(job, sequence_ids=[f"{job}-{i}" for i in range(body.num_samples)])

    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(body: wire.RetrieveFuture):
        job = jobs.get(body.request_id)
        if job is None:
            raise ServeError(404, f"unknown request_id '{body.request_id}' (a result is kept {RETRIEVED_GRACE:.0f} s "
                                  f"after it is first retrieved, {UNRETRIEVED_TTL:.0f} s if it is not)")
        result = await job.wait(LONG_POLL)
        if result is None:
            return wire.try_again(body.request_id)
        jobs.retrieved(job.id)
        if result.error is not None:
            return wire.failed(result.error, result.user_error)
        if isinstance(result.body, bytes):
            return Response(result.body, media_type=proto.PROTO)
        return result.body

    return app
