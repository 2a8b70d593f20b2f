"""`rlora serve` runs the sample requests of one sampling session queued back to back (same num_samples, max_tokens and
ending tokens) as one call of rlora's sampler, and each request samples exactly what it samples alone: the engine draws a
row's tokens from (seed, key, sample index) only, and each prompt keeps its own seed, settings and key. Compared
token for token, with log-probs within 1e-5 (the same math in another batch shape: float32 rounding only)."""

import numpy as np
import pytest
from test_serve_batching import ADAM, ce_datum, held, server, wait_for  # noqa: F401 - server: the module's fixture
from tinker import types

from rlora.rollout import engine as engine_module

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
TOL = 1e-5

# (prompt, num_samples, sampling params, prompt log-probs): all but the last share num_samples, max_tokens and ending
# tokens; the first and the fifth are the same request (the same draws); the sixth gets a stop string below
REQUESTS = [
    ([5, 17, 33, 8], 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=11), False),
    ([30, 31, 32, 33, 34, 35, 36, 37, 38], 3, types.SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9, seed=12), False),
    ([9, 2], 3, types.SamplingParams(max_tokens=6, temperature=0.0), False),
    ([12, 7, 19, 60, 3], 3, types.SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=13), True),
    ([5, 17, 33, 8], 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=11), False),
    ([21, 22, 23], 3, types.SamplingParams(max_tokens=6, temperature=1.0, seed=15), False),
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
    # the sixth request stops at the text its first sample has after two tokens (a stop string that is met)
    prompt, n, params, _ = REQUESTS[5]
    first = sampled(sampler, prompt, n, params, False).result(timeout=60).sequences[0].tokens
    stop = client.get_tokenizer().decode(first[:3])[len(client.get_tokenizer().decode(first[:2])):]
    assert stop, "the third token decodes to no text: pick another seed"
    requests = list(REQUESTS)
    requests[5] = (prompt, n, params.model_copy(update={"stop": [stop]}), False)
    monkeypatch.setattr(engine_module, "MAX_ROWS", {"cpu": 6, "cuda": 6})  # 2 prompts a chunk: the call spans 3
    worker, calls = server.worker, []
    sample = worker.sample

    def counted(session_id, batch):
        calls.append(len(batch))
        return sample(session_id, batch)

    monkeypatch.setattr(worker, "sample", counted)
    jobs = server.served.jobs
    with held(server, queued=len(requests)):
        futures = [sampled(sampler, *request) for request in requests[:-1]]
        wait_for(lambda: jobs.queued() >= len(requests) - 1)  # the SDK sends concurrently: the odd one goes last
        futures.append(sampled(sampler, *requests[-1]))
    batched = [future.result(timeout=60) for future in futures]
    assert calls == [len(requests) - 1, 1]
    alone = [sampled(sampler, *request).result(timeout=60) for request in requests]
    assert calls == [len(requests) - 1, 1] + [1] * len(requests)
    for (prompt, n, params, with_prompt), together, single in zip(requests, batched, alone):
        assert len(together.sequences) == len(single.sequences) == n
        for a, b in zip(together.sequences, single.sequences):
            # the same draws; tokens equal unless float rounding of the other batch shape moves a draw across a
            # boundary, which float32 on a CPU does not here
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
    assert [s.tokens for s in batched[0].sequences] == [s.tokens for s in batched[4].sequences]  # same request
    assert batched[5].sequences[0].tokens == first[:3] and batched[5].sequences[0].stop_reason == "stop"


def test_top_k_prompt_logprobs_are_the_models_most_likely_tokens(server):
    """topk_prompt_logprobs through the official SDK: at every prompt position after the first, the k most likely
    tokens of the served adapter's distribution (temperature 1), most likely first, with their log-probs; the first
    position is empty (None). Checked against the prompt log-probs (another code path: the prompt's own token, where
    it is among the k, has the same log-prob; where not, a lower one than the k-th) and, with k = the vocabulary,
    against a distribution that sums to 1."""
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=5).result()
    client.forward_backward([ce_datum([5, 17, 33, 8, 41, 2, 9])], "cross_entropy")
    client.optim_step(ADAM).result()
    sampler = client.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    prompt = [12, 7, 19, 60, 3, 5]
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=1)
    out = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, include_prompt_logprobs=True,
                         topk_prompt_logprobs=4).result(timeout=60)
    top, own = out.topk_prompt_logprobs, out.prompt_logprobs
    assert len(top) == len(prompt) and top[0] is None and own[0] is None
    for position in range(1, len(prompt)):
        ranked = top[position]
        assert len(ranked) == 4 and [lp for _, lp in ranked] == sorted((lp for _, lp in ranked), reverse=True)
        listed = dict(ranked)
        if prompt[position] in listed:
            assert listed[prompt[position]] == pytest.approx(own[position], abs=TOL)
        else:
            assert own[position] <= ranked[-1][1] + TOL
    # prompt_logprobs_last_n: the same scores for the last 2 positions, none before (also for the top-k)
    last = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, include_prompt_logprobs=True,
                          topk_prompt_logprobs=4, prompt_logprobs_last_n=2).result(timeout=60)
    assert last.prompt_logprobs[:-2] == [None] * (len(prompt) - 2) and last.topk_prompt_logprobs[:-2] == [None] * 4
    assert last.prompt_logprobs[-2:] == pytest.approx(own[-2:], abs=TOL)
    assert [t for t, _ in last.topk_prompt_logprobs[-1]] == [t for t, _ in top[-1]]
    vocab = server.worker.vocab_size
    every = sampler.sample(types.ModelInput.from_ints(prompt), 1, params, include_prompt_logprobs=True,
                           topk_prompt_logprobs=vocab).result(timeout=60)
    for position in range(1, len(prompt)):
        listed = dict(every.topk_prompt_logprobs[position])
        assert len(listed) == vocab and sum(np.exp(list(listed.values()))) == pytest.approx(1.0, abs=1e-4)
        assert listed[prompt[position]] == pytest.approx(every.prompt_logprobs[position], abs=TOL)
