"""What a sample request may ask beside its samples, through the official SDK against `rlora serve` on a tiny random
model with a trained adapter: `target_prompt_logprobs` (dense, and sparse CSR as tinker-cookbook's decision recipe
sends it), `prompt_alt_tokens_k` and `topk_sample_logprobs`.

Each is checked against another code path: the whole next-token distribution at every prompt position from
`topk_prompt_logprobs` with k = the vocabulary (itself checked against the prompt log-probs in
test_serve_sample_batching.py), and a sample's own log-probs from rlora's sampler. Log-probs of one forward agree
within 1e-5 (float32 rounding of another output-layer chunk shape); sampler against a teacher-forced pass within 1e-4,
the tolerance the server's sample log-probs are tested to (docs/serve.md)."""

from types import SimpleNamespace

import numpy as np
import pytest
import tinker
import torch
from serve_helpers import KEY, running_server
from test_serve_batching import ADAM, ce_datum, held, server, wait_for  # noqa: F401 - server: the module's fixture
from tinker import types
from transformers import AutoModelForCausalLM

from rlora.models.tiny import build_random_model
from rlora.serve import prompt_scores

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
TOL, SAMPLER_TOL = 1e-5, 1e-4
PROMPT = [12, 7, 19, 60, 3, 5, 41]


@pytest.fixture(scope="module")
def sampler(server):
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=5).result()
    client.forward_backward([ce_datum([5, 17, 33, 8, 41, 2, 9])], "cross_entropy")
    client.optim_step(ADAM).result()  # the adapter is no longer the base
    made = client.save_weights_and_get_sampling_client()
    return made.result() if hasattr(made, "result") else made


def sample(sampler, prompt=PROMPT, n=1, params=None, **asks):
    params = params or types.SamplingParams(max_tokens=2, temperature=1.0, seed=1)
    return sampler.sample(types.ModelInput.from_ints(prompt), n, params, **asks).result(timeout=60)


@pytest.fixture(scope="module")
def distribution(sampler, server):
    """log p(token | prompt[:i + 1]) of every token at every prompt position after the first, temperature 1 ->
    [len(prompt) - 1, vocab] float64, from the top-k with k = the vocabulary."""
    vocab = server.worker.vocab_size
    top = sample(sampler, topk_prompt_logprobs=vocab).topk_prompt_logprobs
    logp = np.full((len(PROMPT) - 1, vocab), np.nan)
    for position in range(1, len(PROMPT)):
        ids, values = zip(*top[position])
        logp[position - 1, list(ids)] = values
    assert not np.isnan(logp).any() and np.allclose(np.exp(logp).sum(-1), 1.0, atol=1e-4)
    return logp


def test_target_prompt_logprobs_are_the_named_tokens_log_probs_dense_and_sparse(sampler, distribution):
    rows, vocab = distribution.shape
    rng = np.random.default_rng(0)
    ids = torch.as_tensor(rng.integers(0, vocab, size=(rows, 3)), dtype=torch.int64)
    ids[1, 2] = ids[4, 0] = -1  # placeholders: nothing asked, answered 0.0
    dense = sample(sampler, target_prompt_logprobs=types.TensorData.from_torch(ids)).target_prompt_logprobs
    assert dense.sparse_crow_indices is None and dense.shape == [rows, 3] and dense.dtype == "float32"
    got = dense.to_numpy()
    want = np.where(ids.numpy() >= 0, np.take_along_axis(distribution, ids.clamp(min=0).numpy(), axis=1), 0.0)
    np.testing.assert_allclose(got, want, atol=TOL)
    assert got[1, 2] == got[4, 0] == 0.0
    # as the cookbook's decision recipe asks: one row of labels, every other cell -1, sent sparse
    labels = torch.full((rows, 4), -1, dtype=torch.int64)
    labels[rows - 1] = torch.tensor([7, 8, 9, 300])
    asked = types.TensorData.from_torch_sparse(labels, pad_value=-1)
    assert asked.sparse_crow_indices is not None  # the SDK chose the CSR layout: the sparse path is what runs
    sparse = sample(sampler, target_prompt_logprobs=asked).target_prompt_logprobs
    assert sparse.sparse_crow_indices == asked.sparse_crow_indices
    assert sparse.sparse_col_indices == asked.sparse_col_indices
    np.testing.assert_allclose(sparse.to_torch()[rows - 1].numpy(), distribution[rows - 1, [7, 8, 9, 300]], atol=TOL)
    assert not sparse.to_torch()[:rows - 1].any()


def test_prompt_alt_tokens_are_draws_of_the_next_token_distribution(sampler, distribution):
    """k = 1024 draws at temperature 0.4 at every position: their log-probs are the temperature-scaled distribution's;
    the draws fit that distribution (a chi-square statistic over all positions, and the draws' mean log-prob against
    its expectation, -entropy, pooled over positions: both within 4 standard deviations; a fixed seed makes the check
    deterministic, and draws from the temperature-1 distribution fail the second by far: checked here); a seed gives
    the same draws again, another seed others; temperature 0 draws the most likely token k times."""
    k, temperature = 1024, 0.4
    params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=21)
    draws = sample(sampler, params=params, prompt_alt_tokens_k=k).prompt_alt_tokens
    tokens, logprobs = draws.tokens.to_numpy(), draws.logprobs.to_numpy()
    rows = len(PROMPT) - 1
    assert tokens.shape == logprobs.shape == (rows, k) and tokens.dtype == np.int64

    def scaled(temp):
        logp = distribution / temp
        return logp - np.logaddexp.reduce(logp, axis=-1, keepdims=True)

    right = scaled(temperature)
    np.testing.assert_allclose(logprobs, np.take_along_axis(right, tokens, axis=1), atol=1e-4)

    def mean_logp_z(logp):  # the draws' mean log-prob under logp against its expectation, pooled over positions
        p = np.exp(logp)
        expected = (p * logp).sum(-1)
        sd = np.sqrt(((p * logp ** 2).sum(-1) - expected ** 2) / k)
        return ((np.take_along_axis(logp, tokens, axis=1).mean(-1) - expected) / sd).sum() / np.sqrt(rows)

    counts = np.stack([np.bincount(row, minlength=right.shape[1]) for row in tokens])
    chi2, dof = ((counts - k * np.exp(right)) ** 2 / (k * np.exp(right))).sum(), right.size - rows
    assert abs(chi2 - dof) / np.sqrt(2 * dof) < 4 and abs(mean_logp_z(right)) < 4
    assert abs(mean_logp_z(scaled(1.0))) > 10  # seen: 1.3 for the right temperature, 20 for temperature 1
    again = sample(sampler, params=params, prompt_alt_tokens_k=k).prompt_alt_tokens.tokens.to_numpy()
    other = sample(sampler, params=params.model_copy(update={"seed": 22}), prompt_alt_tokens_k=k)
    assert (again == tokens).all() and not (other.prompt_alt_tokens.tokens.to_numpy() == tokens).all()
    greedy = sample(sampler, params=types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=3)
    best = distribution.argmax(-1)
    assert (greedy.prompt_alt_tokens.tokens.to_numpy() == best[:, None]).all()
    np.testing.assert_allclose(greedy.prompt_alt_tokens.logprobs.to_numpy()[:, 0], distribution.max(-1), atol=1e-4)


def test_topk_sample_logprobs_rank_the_distribution_each_sampled_token_came_from(sampler, server, monkeypatch):
    params = types.SamplingParams(max_tokens=5, temperature=0.8, seed=3, stop=[])
    out = sample(sampler, n=3, params=params, topk_sample_logprobs=4)
    monkeypatch.setattr(prompt_scores, "SAMPLE_TOPK_TOKENS", 1)  # one sample a forward: the same top-k
    for seq, alone in zip(out.sequences, sample(sampler, n=3, params=params, topk_sample_logprobs=4).sequences):
        assert [[t for t, _ in r] for r in seq.topk_logprobs] == [[t for t, _ in r] for r in alone.topk_logprobs]
        np.testing.assert_allclose([[lp for _, lp in r] for r in seq.topk_logprobs],
                                   [[lp for _, lp in r] for r in alone.topk_logprobs], atol=TOL)
    monkeypatch.undo()
    again = sample(sampler, n=3, params=params)
    for seq, plain in zip(out.sequences, again.sequences):
        assert seq.tokens == plain.tokens and len(seq.topk_logprobs) == len(seq.tokens) == 5  # asking changes no draw
        assert plain.topk_logprobs is None
        for token, own, ranked in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
            values = [lp for _, lp in ranked]
            assert len(ranked) == 4 and values == sorted(values, reverse=True)
            listed = dict(ranked)
            if token in listed:
                assert listed[token] == pytest.approx(own, abs=SAMPLER_TOL)
            else:
                assert own <= values[-1] + SAMPLER_TOL
    # k = the vocabulary: each position's distribution (at temperature 0.8) sums to 1 and holds the sampled token
    vocab = server.worker.vocab_size
    every = sample(sampler, n=2, params=params, topk_sample_logprobs=vocab)
    for seq in every.sequences:
        for token, own, ranked in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
            listed = dict(ranked)
            assert len(listed) == vocab and sum(np.exp(list(listed.values()))) == pytest.approx(1.0, abs=1e-4)
            assert listed[token] == pytest.approx(own, abs=SAMPLER_TOL)
    # greedy: the sampled token is the most likely one at every position
    greedy = sample(sampler, params=types.SamplingParams(max_tokens=5, temperature=0.0, stop=[]), topk_sample_logprobs=2)
    for token, ranked in zip(greedy.sequences[0].tokens, greedy.sequences[0].topk_logprobs):
        assert ranked[0][0] == token


def test_an_empty_sample_takes_no_position_of_the_others(tiny_model_dir):
    """sampled_topk with an empty sample (transformers generate can return one) beside others: each other sample's
    top-k is what it gets alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt, samples = [12, 7, 19], [[5, 6, 7], [], [8, 9]]
    together = prompt_scores.sampled_topk(model, prompt, samples, 1.0, 3)
    assert [len(ids) for ids, _ in together] == [3, 0, 2]
    for sample_ids, (ids, logp) in zip([samples[0], samples[2]], [together[0], together[2]]):
        [(ids_alone, logp_alone)] = prompt_scores.sampled_topk(model, prompt, [sample_ids], 1.0, 3)
        assert (ids == ids_alone).all()
        np.testing.assert_allclose(logp, logp_alone, atol=TOL)


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    """A server on a model rlora's sampler refuses (attention logit soft-capping: transformers generate samples it)
    and whose logits are not the output layer's (final soft-capping: every score comes from the full logits)."""
    model_dir = str(build_random_model(tmp_path_factory.mktemp("fallback") / "model", family="gemma3_text", seed=0,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    with running_server(model_dir, tmp_path_factory.mktemp("fallback-state")) as (url, served):
        assert served.worker.engine_refusal is not None
        service = tinker.ServiceClient(base_url=url, api_key=KEY)
        yield SimpleNamespace(model=model_dir, served=served, service=service)
        service.close("success").result(timeout=30)


def test_every_ask_on_a_model_sampled_by_transformers_generate(fallback):
    """The same asks where transformers generate samples (its log-probs: its draw's, rollout/generate_draw.py) and the scores come
    from the model's full logits: each sample's own log-prob is its top-k entry (one pass of each kind: 1e-5); the
    targets are the top-k over the vocabulary; the draws come with the scaled distribution's log-probs."""
    training = fallback.service.create_lora_training_client(base_model=fallback.model, rank=4, seed=1).result()
    sampler = training.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    vocab = fallback.served.worker.vocab_size
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=5, stop=[])
    targets = torch.tensor([[3, 9], [-1, 40], [7, 7], [100, 2], [5, -1], [1, 0]], dtype=torch.int64)
    out = sample(sampler, n=2, params=params, topk_sample_logprobs=vocab, topk_prompt_logprobs=vocab,
                 target_prompt_logprobs=types.TensorData.from_torch(targets), prompt_alt_tokens_k=5)
    for seq in out.sequences:
        assert len(seq.tokens) == 4
        for token, own, ranked in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
            assert dict(ranked)[token] == pytest.approx(own, abs=TOL)
    distribution = np.array([[lp for _, lp in sorted(row)] for row in out.topk_prompt_logprobs[1:]])
    got = out.target_prompt_logprobs.to_numpy()
    want = np.where(targets.numpy() >= 0, np.take_along_axis(distribution, targets.clamp(min=0).numpy(), 1), 0.0)
    np.testing.assert_allclose(got, want, atol=TOL)
    draws = out.prompt_alt_tokens
    np.testing.assert_allclose(draws.logprobs.to_numpy(),
                               np.take_along_axis(distribution, draws.tokens.to_numpy(), 1), atol=TOL)


def test_sample_requests_on_a_model_sampled_by_transformers_generate_run_as_one_call(fallback):
    """generate draws each row's tokens from (seed, key, sample index) as rlora's engine does, so the server batches
    its sample requests too: queued together they run as one call, and each samples what it samples alone."""
    training = fallback.service.create_lora_training_client(base_model=fallback.model, rank=4, seed=2).result()
    sampler = training.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    requests = [([5, 17, 33, 8], types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)),
                ([30, 31, 32, 33, 34, 35], types.SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=12)),
                ([9, 2], types.SamplingParams(max_tokens=5, temperature=0.0)),
                ([5, 17, 33, 8], types.SamplingParams(max_tokens=5, temperature=1.0, seed=11))]
    worker, calls = fallback.served.worker, []
    original = worker.sample

    def counted(session_id, batch):
        calls.append(len(batch))
        return original(session_id, batch)

    worker.sample = counted
    try:
        with held(fallback, queued=len(requests)):
            futures = [sampler.sample(types.ModelInput.from_ints(p), 3, params) for p, params in requests]
        batched = [future.result(timeout=60) for future in futures]
        alone = [sampler.sample(types.ModelInput.from_ints(p), 3, params).result(timeout=60) for p, params in requests]
    finally:
        worker.sample = original
    assert calls == [len(requests)] + [1] * len(requests)
    for together, single in zip(batched, alone):
        for a, b in zip(together.sequences, single.sequences):
            assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)
    assert len({tuple(s.tokens) for s in batched[0].sequences}) > 1  # seeded samples differ from one another
    assert [s.tokens for s in batched[0].sequences] == [s.tokens for s in batched[3].sequences]  # the same request
