"""`rlora serve`'s training and sampling, checked against what they must equal, through the official tinker SDK on a
tiny random model: ppo's and importance_sampling's gradients are cross_entropy's weighted by ratio * advantage where
ppo does not clip (0 where it does), cispo's and dro's by their coefficients, gspo's by its sequence ratio; a forward_backward split into micro-batches gives what one micro-batch gives; a
forward_backward that fails part-way leaves the client exactly as if it had never been sent; the sampler's kept
decoder samples what a fresh one samples."""


import numpy as np
import pytest
import tinker
import torch
from serve_helpers import sdk_server
from tinker import types

from rlora.serve import datum_rows

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
ADAM = types.AdamParams(learning_rate=1e-2)
NO_STEP = types.AdamParams(learning_rate=0.0)  # an optim_step that clears the gradients and moves nothing
SEQUENCES = [[5, 17, 33, 8, 41], [12, 7, 19, 60, 3, 27, 44, 9, 15], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from sdk_server(tmp_path_factory)


def ce_datum(ids: list[int], weights=None) -> types.Datum:
    inputs = {"target_tokens": ids[1:]}
    if weights is not None:
        inputs["weights"] = np.asarray(weights, dtype=np.float32)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def trained_client(server, seed: int):
    """A client one cross-entropy step in: its LoRA B is no longer 0, so every parameter gets a gradient."""
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=seed).result()
    client.forward_backward([ce_datum(s) for s in SEQUENCES], "cross_entropy")
    client.optim_step(ADAM).result()
    return client


def gradients(server, client, data, loss_fn, config=None) -> list[torch.Tensor]:
    """The gradients a forward_backward leaves, read off the server's adapter (cleared again afterwards)."""
    out = client.forward_backward(data, loss_fn, config).result()
    grads = [p.grad.clone() for p in server.worker.trainees[client.model_id].params]
    client.optim_step(NO_STEP).result()
    return out, grads


def assert_same_gradients(rl_grads: list[torch.Tensor], ce_grads: list[torch.Tensor]) -> None:
    """An RL loss's gradients equal the weighted cross_entropy's (relative to each tensor's scale), and are not 0."""
    assert any(float(g.abs().max()) > 1e-3 for g in rl_grads)
    for rl_grad, ce_grad in zip(rl_grads, ce_grads, strict=True):
        scale = float(ce_grad.abs().max())
        np.testing.assert_allclose(rl_grad.numpy(), ce_grad.numpy(), rtol=1e-4, atol=1e-5 * scale + 1e-9)


def test_ppo_and_importance_sampling_gradients_are_ratio_weighted_cross_entropy(server):
    client = trained_client(server, seed=1)
    ids = SEQUENCES[2]
    logp = client.forward([ce_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    rng = np.random.default_rng(0)
    sampler_logp = (logp + rng.uniform(-0.4, 0.4, len(logp))).astype(np.float32)  # ratios 0.67 .. 1.5
    advantages = rng.choice([-1.0, 0.5, 2.0], len(logp)).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:], "logprobs": sampler_logp, "advantages": advantages})
    ratio = np.exp(logp.astype(np.float64) - sampler_logp)
    # d/dtheta of -min(r A, clip(r) A) is -r A dlogp where the unclipped term is the smaller, 0 where the clipped is
    for loss_fn, config, low, high in [("importance_sampling", None, -np.inf, np.inf), ("ppo", None, 0.8, 1.2),
                                       ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, 0.9, 1.05)]:
        clipped = ((advantages > 0) & (ratio > high)) | ((advantages < 0) & (ratio < low))
        if loss_fn == "ppo":
            assert clipped.any() and not clipped.all(), (loss_fn, config)
        weights = np.where(clipped, 0.0, ratio * advantages)
        _, rl_grads = gradients(server, client, [rl], loss_fn, config)
        _, ce_grads = gradients(server, client, [ce_datum(ids, weights)], "cross_entropy")
        assert_same_gradients(rl_grads, ce_grads)


def test_cispo_and_dro_are_cross_entropy_weighted_by_their_coefficients(server):
    """cispo's gradient is cross_entropy's weighted by clip(r, low, high) * A (the clipped ratio is a constant), dro's
    by A - beta * (logp - q); each loss:sum is Tinker's formula over the returned log-probs (hand-computed here)."""
    client = trained_client(server, seed=2)
    ids = SEQUENCES[1]
    logp = client.forward([ce_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    logp = logp.astype(np.float64)
    rng = np.random.default_rng(1)
    sampler_logp = (logp + rng.uniform(-0.4, 0.4, len(logp))).astype(np.float32)
    advantages = rng.choice([-1.0, 0.5, 2.0], len(logp)).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                     loss_fn_inputs={"target_tokens": ids[1:], "logprobs": sampler_logp, "advantages": advantages})
    ratio, q = np.exp(logp - sampler_logp), sampler_logp.astype(np.float64)
    for loss_fn, config in [("cispo", None), ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
                            ("dro", {"beta": 0.5})]:
        if loss_fn == "cispo":
            low, high = (0.8, 1.2) if config is None else (0.9, 1.05)
            clipped = np.clip(ratio, low, high)
            assert (clipped != ratio).any() and (clipped == ratio).any()
            weights, loss_sum = clipped * advantages, -(clipped * logp * advantages).sum()
        else:
            weights = advantages - config["beta"] * (logp - q)
            loss_sum = -(logp * advantages - 0.5 * config["beta"] * (logp - q) ** 2).sum()
        out, rl_grads = gradients(server, client, [rl], loss_fn, config)
        assert out.metrics["loss:sum"] == pytest.approx(loss_sum, rel=1e-5, abs=1e-5), loss_fn
        np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), logp, rtol=0, atol=1e-6)
        _, ce_grads = gradients(server, client, [ce_datum(ids, weights)], "cross_entropy")
        assert_same_gradients(rl_grads, ce_grads)


def test_gspo_is_cross_entropy_weighted_by_the_sequence_ratio_where_it_does_not_clip(server):
    """Tinker's GSPO-token: s = exp(mean(logp - q)) over the tokens sequence_ratio_mask marks, every token carrying s's
    value with its own log-prob's gradient, so the gradient is cross_entropy's weighted by s * A where min(s A,
    clip(s) A) takes the unclipped term and 0 elsewhere; loss:sum by hand. Here s is ~1.1 and the thresholds
    (0.9, 1.05): the tokens with A > 0 clip, those with A < 0 do not."""
    client = trained_client(server, seed=3)
    ids = SEQUENCES[2]
    logp = client.forward([ce_datum(ids)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    logp = logp.astype(np.float64)
    n = len(logp)
    marked = (np.arange(n) >= n // 2).astype(np.float32)  # the "sampled" second half forms the sequence ratio
    rng = np.random.default_rng(2)
    sampler_logp = (logp - 0.1 + rng.uniform(-0.05, 0.05, n)).astype(np.float32)
    advantages = np.where(np.arange(n) % 2 == 0, 1.0, -0.5).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ids[1:], "logprobs": sampler_logp, "advantages": advantages, "sequence_ratio_mask": marked})
    s = float(np.exp(((logp - sampler_logp) * marked).sum() / marked.sum()))
    low, high = 0.9, 1.05
    assert high < s < 1.2
    clipped = np.clip(s, low, high)
    takes_clipped = clipped * advantages < s * advantages
    assert takes_clipped.any() and not takes_clipped.all()
    weights = np.where(takes_clipped, 0.0, s * advantages)
    loss_sum = -np.minimum(s * advantages, clipped * advantages).sum()
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    out, rl_grads = gradients(server, client, [rl], "gspo", config)
    assert out.metrics["loss:sum"] == pytest.approx(loss_sum, rel=1e-5, abs=1e-5)
    _, ce_grads = gradients(server, client, [ce_datum(ids, weights)], "cross_entropy")
    assert_same_gradients(rl_grads, ce_grads)


def test_micro_batches_give_what_one_batch_gives(server, monkeypatch):
    client = trained_client(server, seed=2)
    data = [ce_datum(s) for s in SEQUENCES]
    one, one_grads = gradients(server, client, data, "cross_entropy")
    calls = []
    real = server.worker.token_logprobs
    monkeypatch.setattr(server.worker, "token_logprobs", lambda *args: calls.append(1) or real(*args))
    monkeypatch.setattr(datum_rows, "MICRO_BATCH_TOKENS", 12)  # each datum its own micro-batch
    split, split_grads = gradients(server, client, data, "cross_entropy")
    assert len(calls) == 3
    assert split.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], abs=1e-6 * abs(one.metrics["loss:sum"]))
    for a, b in zip(split.loss_fn_outputs, one.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=0, atol=1e-6)
    for a, b in zip(split_grads, one_grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6 * float(b.abs().max()) + 1e-9)


def test_a_forward_backward_that_fails_part_way_leaves_the_client_as_if_never_sent(server, monkeypatch):
    data = [ce_datum(s) for s in SEQUENCES]
    failed, untouched = trained_client(server, seed=3), trained_client(server, seed=3)
    for client in (failed, untouched):  # gradients already pending: they must stay, exactly
        client.forward_backward(data[:2], "cross_entropy").result()
    monkeypatch.setattr(datum_rows, "MICRO_BATCH_TOKENS", 12)  # three micro-batches
    calls = []
    real = server.worker.token_logprobs

    def second_fails(*args):
        calls.append(1)
        if len(calls) == 2:  # after the first micro-batch's backward has added its gradients
            raise RuntimeError("injected failure in micro-batch 2")
        return real(*args)

    with monkeypatch.context() as patch:
        patch.setattr(server.worker, "token_logprobs", second_fails)
        with pytest.raises(tinker.RequestFailedError, match="injected failure in micro-batch 2"):
            failed.forward_backward(data, "cross_entropy").result()
    assert len(calls) == 2
    trainees = [server.worker.trainees[c.model_id] for c in (failed, untouched)]
    assert trainees[0].loss_since_step == trainees[1].loss_since_step
    for client in (failed, untouched):
        client.optim_step(ADAM).result()
    tensors = [server.worker._adapter_tensors(t) for t in trainees]
    assert tensors[0].keys() == tensors[1].keys()
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])
    assert all(p.grad is None for t in trainees for p in t.params)


def test_the_kept_decoder_samples_what_a_fresh_one_samples(server):
    client = trained_client(server, seed=4)
    worker = server.worker
    first = client.save_weights_and_get_sampling_client().result()
    first_key = worker.samplers[next(reversed(worker.unnamed))].snapshot.key  # the newest unnamed snapshot
    client.forward_backward([ce_datum(s) for s in SEQUENCES], "cross_entropy")
    client.optim_step(ADAM).result()
    second = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(SEQUENCES[1][:4])
    params = types.SamplingParams(max_tokens=8, seed=5, temperature=0.9)

    def sample(sampler):
        seqs = sampler.sample(prompt, 3, params).result().sequences
        return [(s.tokens, s.logprobs) for s in seqs]

    fresh = sample(first)
    key, view = worker.view
    assert key == first_key
    assert sample(first) == fresh and worker.view[1] is view  # the kept decoder, the same samples
    packs = worker.packer.packs_for(worker.model)  # an x86 CPU: one set of base packs under every snapshot's LoRA
    made = {k: e[2] for k, e in packs._entries.items()} if packs is not None else {}
    other = sample(second)
    assert other != fresh and worker.view[0] != first_key  # another snapshot: its own decoder
    assert (len(made) > 0) == (packs is not None) and all(packs._entries[k][2] is v for k, v in made.items())
    assert sample(first) == fresh
    worker.view = None  # built afresh: the same again
    assert sample(first) == fresh


def test_an_update_skipped_for_a_non_finite_gradient_comes_back_through_the_sdk(server):
    """docs/serve.md: a non-finite loss or gradient skips the update and says so. Its metrics (an infinite loss and
    grad norm) used to fail the JSON rendering of the result: a 500 on every poll while the SDK retried."""
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=7).result()
    before = [p.detach().clone() for p in server.worker.trainees[client.model_id].params]
    out = client.forward_backward([ce_datum(SEQUENCES[0], weights=[1e38] * 4)], "cross_entropy").result(timeout=60)
    assert out.metrics["loss:sum"] == float("inf")
    step = client.optim_step(ADAM).result(timeout=60)
    assert step.metrics["skipped_update:sum"] == 1.0 and not np.isfinite(step.metrics["grad_norm:mean"])
    after = server.worker.trainees[client.model_id].params
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # nothing moved
    client.forward_backward([ce_datum(SEQUENCES[0])], "cross_entropy")  # the client trains on afterwards
    assert client.optim_step(ADAM).result(timeout=60).metrics["skipped_update:sum"] == 0.0
