"""`rlora serve` runs the sample requests of one sampling session queued back to back (same num_samples, same ending
tokens) as one call of rlora's sampler, and each request samples exactly what it samples alone: the engine draws a
row's tokens from (seed, key, sample index) only, and each prompt keeps its own seed, settings and key. Compared
token for token, with log-probs within 1e-5 (the same math in another batch shape: float32 rounding only)."""

import numpy as np
import pytest
from test_serve_batching import ADAM, ce_datum, held, server, wait_for  # noqa: F401 - server: the module's fixture
from tinker import types

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
TOL = 1e-5

# (prompt, num_samples, sampling params, prompt log-probs): the first four share num_samples and ending tokens
REQUESTS = [
    ([5, 17, 33, 8], 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=11), False),
    ([30, 31, 32, 33, 34, 35, 36, 37, 38], 3, types.SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=12), False),
    ([9, 2], 3, types.SamplingParams(max_tokens=5, temperature=0.0), False),
    ([12, 7, 19, 60, 3], 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=13), True),
    ([44, 45, 46], 2, types.SamplingParams(max_tokens=6, temperature=1.0, seed=14), False),  # another num_samples
]


def sampled(sampler, prompt, n, params, prompt_logprobs):
    return sampler.sample(types.ModelInput.from_ints(prompt), n, params, include_prompt_logprobs=prompt_logprobs)


def test_one_sessions_sample_requests_run_as_one_call_and_each_samples_what_it_does_alone(server, monkeypatch):
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=3).result()
    client.forward_backward([ce_datum([5, 17, 33, 8, 41, 2, 9])], "cross_entropy")
    client.optim_step(ADAM).result()  # the adapter is no longer the base
    sampler = client.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    worker, calls = server.worker, []
    sample = worker.sample

    def counted(session_id, requests):
        calls.append(len(requests))
        return sample(session_id, requests)

    monkeypatch.setattr(worker, "sample", counted)
    jobs = server.served.jobs
    with held(server, queued=len(REQUESTS)):
        futures = [sampled(sampler, *request) for request in REQUESTS[:4]]
        wait_for(lambda: jobs.queued() >= 4)  # the SDK sends concurrently: the odd one goes last
        futures.append(sampled(sampler, *REQUESTS[4]))
    batched = [future.result(timeout=60) for future in futures]
    assert calls == [4, 1]
    alone = [sampled(sampler, *request).result(timeout=60) for request in REQUESTS]
    assert calls == [4, 1, 1, 1, 1, 1, 1]
    for (prompt, n, params, with_prompt), together, single in zip(REQUESTS, batched, alone):
        assert len(together.sequences) == len(single.sequences) == n
        for a, b in zip(together.sequences, single.sequences):
            assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
            assert 0 < len(a.tokens) <= params.max_tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=TOL)
        if with_prompt:
            assert len(together.prompt_logprobs) == len(prompt)
            np.testing.assert_allclose(np.array(together.prompt_logprobs[1:], dtype=float),
                                       np.array(single.prompt_logprobs[1:], dtype=float), atol=TOL)
    # the greedy request's three samples are one and the same; the seeded ones differ between samples
    assert len({tuple(s.tokens) for s in batched[2].sequences}) == 1
    assert len({tuple(s.tokens) for s in batched[0].sequences}) > 1
