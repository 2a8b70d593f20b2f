"""`rlora serve`'s cross_entropy with K targets per token: `target_tokens` and `weights` of shape [n, K] (what the tinker
SDK's `forward_backward_custom` sends for a loss on several tokens' log-probs at a position, e.g. tinker-cookbook's
decision recipe's `decision_dist_datums`). Its loss is -sum(weights * logp) over every (position, column).

A datum with K columns is K datums of one column each, the same input: a client and its twin (the same rank, seed and
warm-up, so the same adapter) get the two forms; log-probs, loss:sum and gradients agree within 1e-5 (float32
rounding of another output-layer shape). The log-probs come back as [n, K]; a request mixing [n] and [n, K] data
answers each in its own shape."""

import httpx
import numpy as np
import pytest
import tinker
import torch
from serve_helpers import KEY
from test_serve_batching import assert_close, ce_datum, grads, server, twins  # noqa: F401 - server: the module's fixture
from test_serve_errors import fb_body
from tinker.proto import tinker_public_pb2 as pb
from tinker import types

from rlora.serve import proto

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
TOL = 1e-5
TOKENS = [5, 17, 33, 8, 41, 2, 9]


def columns_datum(targets_TK: np.ndarray, weights_TK: np.ndarray | None) -> types.Datum:
    inputs = {"target_tokens": types.TensorData.from_numpy(targets_TK.astype(np.int64))}
    if weights_TK is not None:
        inputs["weights"] = types.TensorData.from_numpy(weights_TK.astype(np.float32))
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=inputs)


def column(targets_TK, weights_TK, k: int) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": targets_TK[:, k].astype(np.int64).tolist(),
                                       "weights": weights_TK[:, k].astype(np.float32)})


@pytest.mark.parametrize("weighted", [True, False])
def test_k_targets_per_token_are_k_datums_of_one(server, weighted):
    rng = np.random.default_rng(0)
    n, K = len(TOKENS) - 1, 3
    targets = rng.integers(0, 300, size=(n, K))
    weights = rng.normal(size=(n, K)) if weighted else np.ones((n, K))  # unweighted: weight 1 each, as 1-D data
    if weighted:
        weights[2, 1] = 0.0
    [client], [twin] = ([c[0]] for c in twins(server, seed=700 + weighted))
    together = client.forward_backward([columns_datum(targets, weights if weighted else None)], "cross_entropy").result()
    apart = twin.forward_backward([column(targets, weights, k) for k in range(K)], "cross_entropy").result()
    logp = together.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logp.shape == (n, K)
    np.testing.assert_allclose(logp, np.stack([o["logprobs"].to_numpy() for o in apart.loss_fn_outputs], 1), atol=TOL)
    assert together.metrics["loss:sum"] == pytest.approx(apart.metrics["loss:sum"], rel=TOL)
    assert together.metrics["loss:sum"] == pytest.approx(-(weights * logp).sum(), rel=1e-4)
    assert_close(grads(server, client), grads(server, twin))


def test_a_request_mixing_one_and_k_targets_answers_each_in_its_shape(server):
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=9).result()
    targets, weights = np.array([[6, 7], [8, 9], [1, 2], [3, 4], [5, 6], [7, 8]]), np.ones((6, 2))
    narrow = np.array([[6, 7, 8], [8, 9, 1], [1, 2, 3], [3, 4, 5], [5, 6, 7], [7, 8, 9]])
    data = [ce_datum(TOKENS), columns_datum(targets, weights), columns_datum(narrow, None), ce_datum(TOKENS[:4])]
    out = client.forward_backward(data, "cross_entropy").result()
    logps = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert [lp.shape for lp in logps] == [(6,), (6, 2), (6, 3), (3,)]
    # every weight 1: the loss is minus the sum of every answered log-prob (padding columns add nothing)
    assert out.metrics["loss:sum"] == pytest.approx(-sum(float(lp.sum()) for lp in logps), rel=1e-5)
    alone = client.forward_backward([ce_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), alone.to_numpy(), atol=TOL)
    # column 0 of the [6, 2] datum scores TOKENS[1:]'s first targets: the same as a datum of those targets
    first = client.forward_backward([column(targets, weights, 0)], "cross_entropy").result().loss_fn_outputs[0]
    np.testing.assert_allclose(out.loss_fn_outputs[1]["logprobs"].to_numpy()[:, 0], first["logprobs"].to_numpy(), atol=TOL)


@pytest.mark.parametrize("rows", ["every", "last"])
def test_a_custom_loss_on_k_log_probs_a_position_runs_through_the_sdk(server, monkeypatch, rows):
    """forward_backward_custom with [n, K] target_tokens (the SDK's own example: a target distribution over K tokens
    at a position): the loss gets [n, K] log-probs, and the SDK's backward (weights = -dloss/dlogp, [n, K]) gives
    the gradient of -sum(target * logp): the same as cross_entropy with those weights. With the distribution on the
    last position only (as the cookbook's decision recipe has it) the SDK sends those weights sparse (CSR)."""
    [client], [twin] = ([c[0]] for c in twins(server, seed=800 + (rows == "last")))
    n, K = len(TOKENS) - 1, 4
    targets = np.tile(np.array([[10, 20, 30, 40]]), (n, 1))
    distribution = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).repeat(n, 1)
    if rows == "last":
        distribution[:-1] = 0.0
    seen, sparse = [], []
    densify = proto._dense_from_csr
    monkeypatch.setattr(proto, "_dense_from_csr", lambda *args: sparse.append(args[3]) or densify(*args))

    def loss_fn(data, logprobs_list):
        seen.append(tuple(logprobs_list[0].shape))
        return -(distribution * logprobs_list[0]).sum(), {}

    client.forward_backward_custom([columns_datum(targets, None)], loss_fn).result()
    twin.forward_backward([columns_datum(targets, distribution.numpy())], "cross_entropy").result()
    assert seen == [(n, K)] and sparse == (["weights"] if rows == "last" else [])
    assert_close(grads(server, client), grads(server, twin))


def test_k_targets_are_refused_where_they_mean_nothing(server):
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=10).result()
    n = len(TOKENS) - 1
    two = types.TensorData.from_numpy(np.ones((n, 2), np.float32))
    rl = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.ones((n, 2), np.int64)), "logprobs": two, "advantages": two})
    with pytest.raises(tinker.BadRequestError, match="only cross_entropy's target_tokens and weights may"):
        client.forward_backward([rl], "importance_sampling").result()
    mismatched = columns_datum(np.ones((n, 2)), np.ones((n, 3)))
    with pytest.raises(tinker.BadRequestError, match="need weights of the same"):
        client.forward_backward([mismatched], "cross_entropy").result()
    one_column_targets = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={
        "target_tokens": TOKENS[1:], "weights": types.TensorData.from_numpy(np.ones((n, 2), np.float32))})
    with pytest.raises(tinker.BadRequestError, match="need weights of the same"):
        client.forward_backward([one_column_targets], "cross_entropy").result()
    def sparse_weights(shape, crow, copies: int = 1) -> httpx.Response:
        """A request whose datum's weights are sparse with this shape and these row pointers (no values)."""
        message = pb.ForwardBackwardRequest()
        message.ParseFromString(fb_body(client.model_id, [columns_datum(np.ones((n, 2)), np.ones((n, 2)))] * copies))
        for datum in message.data:
            weights = datum.loss_fn_inputs["weights"]
            weights.ClearField("dense")
            del weights.shape[:]
            weights.shape.extend(shape)
            weights.sparse_csr.crow_indices = np.array(crow, np.int64).tobytes()
        return httpx.post(f"{server.url}/api/v1/forward_backward", content=message.SerializeToString(),
                          headers={"X-API-Key": KEY, "content-type": "application/x-protobuf"})

    # a shape that is not the datum's: refused before anything is allocated
    response = sparse_weights([1 << 40, 2], [0, 0])
    assert response.status_code == 400 and f"a sparse tensor of shape [{1 << 40}, 2]: it must be [{n}, K]" in response.text
    # row pointers whose int64 differences wrap around (they made numpy's repeat crash the process)
    response = sparse_weights([n, 2], [0, 2**63 - 1, -2**63, -1, 0, 0, 0])
    assert response.status_code == 400 and "the sparse CSR indices do not describe 0 values" in response.text
    # [n, K] inputs past 2^24 values in one request (made dense, answered as [n, K]): refused, whatever the body's size
    response = sparse_weights([n, 1024], [0] * (n + 1), copies=(1 << 24) // (n * 1024) + 1)
    assert response.status_code == 400 and "hold more than 16777216 values together" in response.text
    outside = columns_datum(np.full((n, 2), 10**6), None)
    with pytest.raises(tinker.BadRequestError, match="a token id outside the vocabulary"):
        client.forward_backward([outside], "cross_entropy").result()
