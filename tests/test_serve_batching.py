"""`rlora serve` batches the forward_backward requests of several training clients queued back to back into one
pass (serve/jobs.py forms the batch, serve/batched.py runs it): each client gets what it gets alone.

A client and its twin (the same rank, targets and seed, so the same adapter) get the same requests, the client's in
a batch with other clients, the twin's alone: the per-datum log-probs agree within 1e-5, loss:sum, the gradients
and the adapter after optim_step within 1e-5 of their size (gradient entries reach ~20). It is the same math in
other batch shapes (other padded widths, other rows beside them in the matmuls), so only float32 rounding differs
(seen: log-probs 5e-7, gradients 3e-6 of their largest entry); a row routed to another client's adapter, or an
output-layer chunk recomputed in backward with another chunk's routing, is off by far more (or fails the pass,
which the batch counter shows). The worker is held on a job waiting for an event while the requests queue up,
so the batch really forms (the worker counts its batched passes and the members of the last one)."""

import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import tinker
import torch
from serve_helpers import sdk_server
from tinker import types

from rlora.serve import logprobs as serve_logprobs
from rlora.serve import losses as losses_module
from rlora.serve import datum_rows
from rlora.serve.jobs import MAX_BATCH_MEMBERS, Batchable, Jobs
from rlora.serve.losses import TokenLoss
from rlora.serve.state import ServeError

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
ADAM = types.AdamParams(learning_rate=1e-2)
WARM = types.AdamParams(learning_rate=5e-2)
# rank and targets differ: attention only; everything with the output layer (the SDK's default); MLP and output layer
SPECS = [dict(rank=4, train_attn=True, train_mlp=False, train_unembed=False),
         dict(rank=8),
         dict(rank=2, train_attn=False, train_mlp=True, train_unembed=True)]
DATA = [[[5, 17, 33, 8, 41], [12, 7, 19, 60, 3, 27, 44, 9, 15]],
        [[30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [2, 4, 6, 8], [50, 9, 22, 13, 7, 1]],
        [[11, 22, 33, 44, 55, 6, 7], [8, 18, 28, 38, 48, 58, 3, 13, 23, 33]]]
TOL = 1e-5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from sdk_server(tmp_path_factory)


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the worker did not get there"
        time.sleep(0.005)


@contextmanager
def held(server, queued: int, then=lambda: None):
    """The worker waits on a job while the block queues requests, until `queued` jobs wait behind it; then it
    runs `then()` and goes on."""
    jobs, started, release = server.served.jobs, threading.Event(), threading.Event()
    jobs.submit(lambda: (started.set(), release.wait(60), then(), {})[-1])
    assert started.wait(30)
    try:
        yield
        wait_for(lambda: jobs.queued() >= queued)
    finally:
        release.set()


def ce_datum(ids: list[int], weights=None) -> types.Datum:
    inputs = {"target_tokens": ids[1:]}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def rl_datum(ids: list[int], sampler_logp: np.ndarray, advantages: np.ndarray) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "logprobs": sampler_logp.astype(np.float32),
                                       "advantages": advantages.astype(np.float32)})


def twins(server, seed: int) -> tuple[list, list]:
    """(clients, their twins), one per SPECS, each one warm-up step in alone (LoRA B no longer 0, so every
    adapter changes the log-probs and every parameter gets a gradient)."""
    pairs = []
    for k, spec in enumerate(SPECS):
        pair = [server.service.create_lora_training_client(base_model=server.model, seed=seed + k, **spec).result()
                for _ in range(2)]
        for client in pair:
            client.forward_backward([ce_datum(s) for s in DATA[k]], "cross_entropy").result()
            client.optim_step(WARM).result()
        pairs.append(pair)
    return [p[0] for p in pairs], [p[1] for p in pairs]


def grads(server, client) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in server.worker.trainees[client.model_id].params]


def adapter(server, client) -> dict[str, torch.Tensor]:
    return server.worker._adapter_tensors(server.worker.trainees[client.model_id])


def assert_same_output(batched, alone) -> None:
    loss, alone_loss = batched.metrics["loss:sum"], alone.metrics["loss:sum"]
    assert abs(loss - alone_loss) <= TOL * max(1.0, abs(alone_loss))  # a sum of ~30 log-probs: relative
    assert len(batched.loss_fn_outputs) == len(alone.loss_fn_outputs)
    for a, b in zip(batched.loss_fn_outputs, alone.loss_fn_outputs):
        a, b = a["logprobs"].to_numpy(), b["logprobs"].to_numpy()
        assert a.shape == b.shape and float(np.abs(a - b).max()) <= TOL


def assert_close(a: list, b: list) -> None:
    """Gradients (entries up to ~20, sums over ~30 tokens) and adapters: within TOL of each tensor's largest entry."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and float((x - y).abs().max()) <= TOL * max(1.0, float(y.abs().max()))


def batched_then_alone(server, clients, alone_clients, requests) -> tuple[list, list]:
    """requests[k](client) -> its future, sent by every client while the worker is held (one batch), then by each
    twin alone -> (batched results, alone results)."""
    passes, flags = server.worker.batched_passes, [p.requires_grad for p in server.worker.model.parameters()]
    with held(server, len(clients)):
        futures = [request(client) for request, client in zip(requests, clients)]
    batched = [f.result() for f in futures]
    assert server.worker.batched_passes == passes + 1 and server.worker.last_batch == len(clients)
    assert [p.requires_grad for p in server.worker.model.parameters()] == flags  # put back after the pass
    alone = [request(twin).result() for request, twin in zip(requests, alone_clients)]
    assert server.worker.batched_passes == passes + 1  # one after another: no batch
    return batched, alone


def test_a_batch_of_clients_of_other_ranks_and_targets_gets_what_each_gets_alone(server, monkeypatch):
    clients, alone_clients = twins(server, seed=100)
    # micro-batches of a few rows that mix clients, output-layer chunks of 7 positions that cut through clients'
    # rows: the routing of every piece and of the chunks backward recomputes is exercised
    monkeypatch.setattr(datum_rows, "MICRO_BATCH_TOKENS", 24)
    monkeypatch.setattr(serve_logprobs, "HEAD_CHUNK", 7)
    requests = [lambda c, k=k: c.forward_backward([ce_datum(s) for s in DATA[k]], "cross_entropy") for k in range(3)]
    batched, alone = batched_then_alone(server, clients, alone_clients, requests)
    for k in range(3):
        assert_same_output(batched[k], alone[k])
        assert all(g is not None for g in grads(server, clients[k]))
        assert_close(grads(server, clients[k]), grads(server, alone_clients[k]))
    for client, twin in zip(clients, alone_clients):
        client.optim_step(ADAM).result()
        twin.optim_step(ADAM).result()
        ours, theirs = adapter(server, client), adapter(server, twin)
        assert ours.keys() == theirs.keys()
        assert_close([ours[key] for key in ours], [theirs[key] for key in ours])


def test_a_batch_mixes_losses_and_configs(server):
    clients, alone_clients = twins(server, seed=200)
    logp = [c.forward([ce_datum(s) for s in DATA[k]], "cross_entropy").result() for k, c in enumerate(alone_clients)]
    rng = np.random.default_rng(0)

    def rl_data(k: int) -> list[types.Datum]:
        data = []
        for ids, out in zip(DATA[k], logp[k].loss_fn_outputs):
            sampler = out["logprobs"].to_numpy() + rng.uniform(-0.4, 0.4, len(ids) - 1)
            data.append(rl_datum(ids, sampler, rng.choice([-1.0, 0.5, 2.0], len(ids) - 1)))
        return data

    weighted = [ce_datum(s, rng.uniform(0.0, 2.0, len(s) - 1)) for s in DATA[0]]
    ppo, importance = rl_data(1), rl_data(2)
    requests = [lambda c: c.forward_backward(weighted, "cross_entropy"),
                lambda c: c.forward_backward(ppo, "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
                lambda c: c.forward_backward(importance, "importance_sampling")]
    batched, alone = batched_then_alone(server, clients, alone_clients, requests)
    for k in range(3):
        assert_same_output(batched[k], alone[k])
        assert_close(grads(server, clients[k]), grads(server, alone_clients[k]))


def test_a_forward_only_batch(server):
    clients, alone_clients = twins(server, seed=300)
    requests = [lambda c, k=k: c.forward([ce_datum(s) for s in DATA[k]], "cross_entropy") for k in range(3)]
    batched, alone = batched_then_alone(server, clients, alone_clients, requests)
    for k in range(3):
        assert_same_output(batched[k], alone[k])
        assert all(g is None for g in grads(server, clients[k]))  # nothing to take back, nothing added


def test_a_member_whose_client_is_gone_fails_alone(server):
    clients, alone_clients = twins(server, seed=400)
    gone = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=1).result()
    trainees = server.worker.trainees
    passes = server.worker.batched_passes
    with held(server, 3, then=lambda: trainees.pop(gone.model_id)):  # its client goes before the batch runs
        futures = [gone.forward_backward([ce_datum(DATA[0][0])], "cross_entropy")]
        futures += [c.forward_backward([ce_datum(s) for s in DATA[k]], "cross_entropy") for k, c in enumerate(clients[:2])]
    with pytest.raises(tinker.RequestFailedError, match="unknown model_id"):
        futures[0].result()
    batched = [f.result() for f in futures[1:]]
    assert server.worker.batched_passes == passes + 1 and server.worker.last_batch == 2
    for k, twin in enumerate(alone_clients[:2]):
        assert_same_output(batched[k], twin.forward_backward([ce_datum(s) for s in DATA[k]], "cross_entropy").result())
        assert_close(grads(server, clients[k]), grads(server, twin))

    gone = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=1).result()
    data = [ce_datum(s) for s in DATA[2]]
    with held(server, 2, then=lambda: trainees.pop(gone.model_id)):  # one member left: it runs the plain way
        futures = [gone.forward_backward(data, "cross_entropy"), clients[2].forward_backward(data, "cross_entropy")]
    with pytest.raises(tinker.RequestFailedError, match="unknown model_id"):
        futures[0].result()
    assert_same_output(futures[1].result(), alone_clients[2].forward_backward(data, "cross_entropy").result())
    assert_close(grads(server, clients[2]), grads(server, alone_clients[2]))
    assert server.worker.batched_passes == passes + 1


@pytest.mark.parametrize("fails", ["the 2nd micro-batch only", "every micro-batch from the 2nd"])
def test_a_pass_that_fails_part_way_takes_back_every_gradient_and_runs_each_alone(server, monkeypatch, fails):
    """The batched pass fails after its first micro-batch's backward added gradients: every member's pending
    gradients are put back bit for bit, then each member runs alone (jobs.py): with the failure gone each gets its
    own result (what its twin gets alone); with it still there each gets its own error and its gradients are the
    pending ones, exactly."""
    clients, alone_clients = twins(server, seed=500)
    data = [[ce_datum(s) for s in DATA[k]] for k in range(3)]
    for client, twin, d in zip(clients, alone_clients, data):  # gradients pending: they must stay, exactly
        client.forward_backward(d[:1], "cross_entropy").result()
        twin.forward_backward(d[:1], "cross_entropy").result()
    pending = [grads(server, c) for c in clients]
    monkeypatch.setattr(datum_rows, "MICRO_BATCH_TOKENS", 24)  # several micro-batches
    calls, real = [], server.worker.token_logprobs

    def failing(*args, **kwargs):
        calls.append(len(args) > 3)  # the batched pass routes the output layer (a 4th argument); alone, none
        if len(calls) == 2 or (len(calls) > 2 and fails.startswith("every")):
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    passes = server.worker.batched_passes
    with monkeypatch.context() as patch:
        patch.setattr(server.worker, "token_logprobs", failing)
        with held(server, 3):
            futures = [c.forward_backward(d, "cross_entropy") for c, d in zip(clients, data)]
        if fails.startswith("every"):
            for future in futures:
                with pytest.raises(tinker.RequestFailedError, match="injected failure"):
                    future.result()
        else:
            results = [f.result() for f in futures]
    assert calls[:2] == [True, True] and len(calls) > 2 and not any(calls[2:])  # the pass (it failed), then each alone
    assert server.worker.batched_passes == passes
    if fails.startswith("every"):
        for client, before in zip(clients, pending):
            after = grads(server, client)
            assert all(torch.equal(a, b) for a, b in zip(after, before))
            assert server.worker.trainees[client.model_id].loss_since_step == server.worker.trainees[
                alone_clients[clients.index(client)].model_id].loss_since_step
        return
    for k, (twin, d) in enumerate(zip(alone_clients, data)):
        assert_same_output(results[k], twin.forward_backward(d, "cross_entropy").result())
        assert_close(grads(server, clients[k]), grads(server, twin))


def test_a_member_whose_loss_fails_fails_alone(server, monkeypatch):
    clients, alone_clients = twins(server, seed=600)

    calls = []

    def broken(*args):
        calls.append(1)
        raise ValueError("injected loss failure")

    ppo = losses_module.LOSSES["ppo"]
    monkeypatch.setitem(losses_module.LOSSES, "ppo", TokenLoss(ppo.inputs, ppo.optional, ppo.config, broken))
    rl = [rl_datum(s, np.zeros(len(s) - 1), np.ones(len(s) - 1)) for s in DATA[1]]
    passes = server.worker.batched_passes
    with held(server, 3):
        futures = [clients[0].forward_backward([ce_datum(s) for s in DATA[0]], "cross_entropy"),
                   clients[1].forward_backward(rl, "ppo"),
                   clients[2].forward_backward([ce_datum(s) for s in DATA[2]], "cross_entropy")]
    with pytest.raises(tinker.RequestFailedError, match="injected loss failure"):
        futures[1].result()
    assert len(calls) == 2 and server.worker.batched_passes == passes  # in the pass (it failed), then alone
    assert all(g is None for g in grads(server, clients[1]))
    for k in (0, 2):
        alone = alone_clients[k].forward_backward([ce_datum(s) for s in DATA[k]], "cross_entropy").result()
        assert_same_output(futures[k].result(), alone)
        assert_close(grads(server, clients[k]), grads(server, alone_clients[k]))


def test_a_clients_second_forward_backward_waits_for_its_optim_step(server):
    """A.fb, B.fb, A.optim, A.fb queued together: A's second forward_backward runs after its optim_step (on the
    stepped adapter), never batched ahead of it."""
    (a, b, _), (twin_a, _, _) = twins(server, seed=700)
    first, second = [ce_datum(s) for s in DATA[0][:1]], [ce_datum(s) for s in DATA[0]]
    passes = server.worker.batched_passes
    with held(server, 4):
        futures = [a.forward_backward(first, "cross_entropy"),
                   b.forward_backward([ce_datum(s) for s in DATA[1]], "cross_entropy"),
                   a.optim_step(ADAM), a.forward_backward(second, "cross_entropy")]
    results = [f.result() for f in futures]
    twin_a.forward_backward(first, "cross_entropy").result()
    twin_a.optim_step(ADAM).result()
    assert_same_output(results[3], twin_a.forward_backward(second, "cross_entropy").result())
    assert_close(grads(server, a), grads(server, twin_a))
    assert server.worker.batched_passes == passes + 1  # B.fb with one of A's (whichever way B's request arrived)


# ------------------------------------------------------------------------------------------ the queue, without a model

def test_the_queue_batches_a_contiguous_run_of_other_members_of_one_group():
    jobs, batches = Jobs(), []
    release = threading.Event()

    def runner(payloads):
        batches.append(payloads)
        return [{"ran": p} if p != "bad" else ServeError(404, "unknown") for p in payloads]

    def fb(member, name, group="fb", tokens=1, **caps):
        return jobs.submit(lambda: batches.append([name]) or {"ran": name},
                           batch=Batchable(group, member, name, runner, tokens, **caps))

    try:
        jobs.submit(lambda: release.wait(30) and {})
        ids = [fb("A", "A1"), fb("B", "B1"), jobs.submit(lambda: batches.append(["A-optim"]) or {}),
               fb("A", "A2"), fb("C", "C1"), fb("A", "A3"), fb("B", "B2"), fb("D", "D1", group="fwd"),
               *[fb(f"M{i}", f"M{i}") for i in range(MAX_BATCH_MEMBERS + 1)],
               fb("X", "bad"), fb("Y", "Y1", tokens=10**9),
               # the first job's own caps (rlora serve's CPU cap on forward_backward tokens, its sampling's members)
               fb("P", "P1", "small", 3, max_tokens=5), fb("Q", "Q1", "small", 2), fb("R", "R1", "small", 1),
               fb("S", "S1", "two", max_members=2), fb("T", "T1", "two"), fb("U", "U1", "two")]
        release.set()
        wait_for(lambda: all(jobs.get(j).result is not None for j in ids))
    finally:
        jobs.stop()
    members = [f"M{i}" for i in range(MAX_BATCH_MEMBERS + 1)]
    assert batches == [["A1", "B1"], ["A-optim"], ["A2", "C1"], ["A3", "B2"], ["D1"], members[:MAX_BATCH_MEMBERS],
                       [members[-1], "bad"], ["Y1"], ["P1", "Q1"], ["R1"], ["S1", "T1"], ["U1"]]
    assert jobs.get(ids[-8]).result.error == "unknown" and jobs.get(ids[-8]).result.user_error
    assert jobs.get(ids[-7]).result.body == {"ran": "Y1"}
    assert all(jobs.get(j).run is None and jobs.get(j).batch is None for j in ids)


def test_a_batch_runner_that_raises_leaves_each_job_to_run_alone(capsys):
    jobs, ran = Jobs(), []
    release = threading.Event()

    def runner(payloads):
        raise RuntimeError("the pass broke")

    try:
        jobs.submit(lambda: release.wait(30) and {})
        ids = [jobs.submit(lambda m=m: ran.append(m) or {"alone": m}, key=(m, 1, "fb"),
                           batch=Batchable("fb", m, m, runner)) for m in "ABC"]
        assert jobs.submit(lambda: {}, key=("A", 1, "fb"), batch=Batchable("fb", "A", "A", runner)) == ids[0]  # resent
        release.set()
        wait_for(lambda: all(jobs.get(j).result is not None for j in ids))
    finally:
        jobs.stop()
    assert ran == ["A", "B", "C"] and [jobs.get(j).result.body for j in ids] == [{"alone": m} for m in "ABC"]
    assert "the pass broke" in capsys.readouterr().err
