"""`rlora serve`'s prefix cache (serve/prefix_cache.py): sampled rows' keys and values kept by their tokens, so that an
episode's next turn runs only its new tokens. The index on its own (longest shared prefix, whole blocks, weights kept
apart, budget and recency, rows that extend others), the engine handing rows over as slots finish, and the server's
multi-turn samples with the cache against the same samples without it (tokens equal, log-probs within 1e-5)."""

import numpy as np
import pytest
import torch
import tinker
from serve_helpers import KEY, sdk_server
from test_serve_batching import ADAM, ce_datum, held, wait_for
from tinker import types

from rlora.cli import main
from rlora.models.loading import load_tokenizer
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.kvcache import RowCache
from rlora.serve.prefix_cache import BLOCK, DEFAULT_MB, PrefixCache
from rlora.types import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
TOL = 1e-5


def row(tokens: list[int], layers: int = 2) -> RowCache:
    """A stand-in row cache whose keys at position t hold (layer, t) and values (layer, -t): slices are checkable."""
    t = torch.arange(len(tokens), dtype=torch.float32)
    return RowCache([(torch.stack([t + 1000 * i, t]).T[None], torch.stack([t + 1000 * i, -t]).T[None])
                     for i in range(layers)])


def row_bytes(length: int) -> int:
    return 2 * 2 * length * 2 * 4  # layers x (K, V) x positions x 2 floats x 4 bytes


def test_a_prompt_takes_the_longest_kept_prefix_short_of_its_last_token():
    cache = PrefixCache(10**6)
    history = list(range(100, 140))  # 40 tokens: 2 whole blocks and 8 more
    cache.keep("w", history, row(history))
    cache.keep("w", history[:20] + [7] * 30, row(history[:20] + [7] * 30))  # shares 20 tokens with it
    found = cache.longest("w", history + [1, 2, 3])
    assert found.length == 40
    k, v = found.layers[1]
    assert torch.equal(k[0, :, 0], torch.arange(40.0) + 1000) and torch.equal(v[0, :, 1], -torch.arange(40.0))
    assert cache.longest("w", history).length == 39  # the prompt's last token always runs
    assert cache.longest("w", history[:35] + [9, 9]).length == 35  # the shared part, into the last partial block
    assert cache.longest("w", history[:20] + [7] * 12 + [1]).length == 32  # the other row: longer there
    assert cache.longest("other weights", history + [1]) is None
    assert cache.longest("w", history[:BLOCK - 1] + [0, 0]) is None  # fewer shared tokens than a block
    assert cache.longest("w", [5] + history) is None
    assert cache.prompt_tokens == 43 + 40 + 37 + 33 + 41 + 17 + 41
    assert cache.reused_tokens == 40 + 39 + 35 + 32


def test_a_row_that_extends_another_replaces_it_and_one_already_held_is_not_kept_twice():
    cache = PrefixCache(10**6)
    turn1 = list(range(50, 84))
    cache.keep("w", turn1, row(turn1))
    turn2 = turn1 + [3, 4, 5, 6]
    cache.keep("w", turn2, row(turn2))
    assert len(cache) == 1 and cache.nbytes == row_bytes(len(turn2))
    cache.keep("w", turn1[:20], row(turn1[:20]))  # a prefix of the kept row: nothing new
    cache.keep("other", turn1, row(turn1))  # other weights: kept apart
    assert len(cache) == 2 and cache.longest("w", turn2 + [1]).length == len(turn2)
    assert cache.longest("other", turn2 + [1]).length == len(turn1)
    cache.keep("w", list(range(10)), row(list(range(10))))  # under one block: never found, never kept
    assert len(cache) == 2
    cache.forget("w")
    assert len(cache) == 1 and cache.longest("w", turn2 + [1]) is None and cache.nbytes == row_bytes(len(turn1))
    with pytest.raises(ValueError, match="3 tokens for a cache of 4 positions"):
        cache.keep("w", [1, 2, 3], row([1, 2, 3, 4]))


def test_the_budget_drops_the_least_recently_used_rows(capsys):
    rows = [[i] * 8 + list(range(i * 100, i * 100 + 24)) for i in range(4)]  # 32 tokens each, all different
    cache = PrefixCache(3 * row_bytes(32))
    for tokens in rows[:3]:
        cache.keep("w", tokens, row(tokens))
    assert cache.longest("w", rows[0] + [1]).length == 32  # row 0 used: row 1 is now the oldest
    cache.keep("w", rows[3], row(rows[3]))
    assert len(cache) == 3 and cache.nbytes == 3 * row_bytes(32)
    assert cache.longest("w", rows[1] + [1]) is None
    assert all(cache.longest("w", rows[i] + [1]).length == 32 for i in (0, 2, 3))
    cache.keep("w", list(range(200)), row(list(range(200))))  # larger than the whole budget: not kept, nothing lost
    assert len(cache) == 3
    assert not PrefixCache(0).enabled
    with pytest.raises(ValueError, match="give 0 \\(off\\) or more"):
        PrefixCache(-1)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"(default {DEFAULT_MB}; 0: off)" in " ".join(capsys.readouterr().out.split())


def test_the_engine_hands_each_rows_cache_over_as_its_slot_finishes(tiny_model_dir):
    """keep(row, tokens, cache) gets every row once, with its sampled tokens and the cache sample_continued returns
    without it (the same call: equal bit for bit); the returned list is then empty."""
    from rlora.models.loading import load_base_model
    from rlora.config import ModelConfig
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, max_rows=2)  # 1 prompt at a time: slots reused
    prompts, params = [[5, 6, 7, 8], [9, 10], [11, 12, 13]], SamplingParams(max_new_tokens=5, temperature=1.0)
    rollout, caches = engine.sample_continued(model, prompts, 2, params, seed=3)
    handed = {}
    again, returned = engine.sample_continued(model, prompts, 2, params, seed=3,
                                              keep=lambda r, tokens, c: handed.setdefault(r, (tokens, c)))
    assert returned == [] and sorted(handed) == list(range(6))
    lengths = rollout.completion_mask_BTc.sum(-1).tolist()
    for r in range(6):
        tokens, handed_cache = handed[r]
        assert tokens == rollout.completion_ids_BTc[r, :lengths[r]].tolist()
        assert handed_cache.length == len(prompts[r // 2]) + lengths[r] - 1
        for (k, v), (k2, v2) in zip(caches[r].layers, handed_cache.layers):
            assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(again.completion_ids_BTc, rollout.completion_ids_BTc)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from sdk_server(tmp_path_factory)


def _sample(sampler, prompt, n, seed, max_tokens=10):
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    return sampler.sample(types.ModelInput.from_ints(prompt), n, params)


def _turns(sampler, first, observations, seeds):
    """An episode: each turn's prompt is the last one, its first sample, an observation -> (prompts, results)."""
    prompts, results, prompt = [], [], first
    for observation, seed in zip(observations, seeds):
        result = _sample(sampler, prompt, 2, seed).result(timeout=60)
        prompts.append(prompt)
        results.append(result)
        prompt = prompt + result.sequences[0].tokens + observation
    return prompts, results


def _same(a, b):
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences):
        assert x.tokens == y.tokens and x.stop_reason == y.stop_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOL)


def _sampling_client(client):
    sampler = client.save_weights_and_get_sampling_client()
    return sampler.result() if hasattr(sampler, "result") else sampler


def test_an_episodes_turns_run_only_their_new_tokens_and_sample_what_they_do_without_the_cache(server, monkeypatch):
    worker = server.worker
    service = tinker.ServiceClient(base_url=server.url, api_key=KEY)  # its own session: ended below
    client = service.create_lora_training_client(base_model=server.model, rank=4, seed=3).result()
    client.forward_backward([ce_datum([5, 17, 33, 8, 41, 2, 9])], "cross_entropy")
    client.optim_step(ADAM).result()  # the adapter is no longer the base
    sampler = _sampling_client(client)
    cache = worker.prefix_cache
    assert cache.enabled
    rng = np.random.default_rng(0)
    first = rng.integers(3, 90, 40).tolist()
    observations = [rng.integers(3, 90, 6).tolist() for _ in range(3)]
    reused = cache.reused_tokens
    prompts, cached = _turns(sampler, first, observations, seeds=[11, 12, 13])
    # turn k reuses turn k-1's prompt and its first sample but the last token (the one the cache never ran)
    expected = sum(len(prompts[k - 1]) + len(cached[k - 1].sequences[0].tokens) - 1 for k in (1, 2))
    assert cache.reused_tokens - reused == expected
    # a request with a kept prefix and one with none, in one sampler call (the second continues an empty row)
    fresh = rng.integers(3, 90, 40).tolist()
    calls, sample = [], worker.sample
    monkeypatch.setattr(worker, "sample", lambda session_id, batch: (calls.append(len(batch)), sample(session_id, batch))[1])
    reused = cache.reused_tokens
    with held(server, queued=2):
        futures = [_sample(sampler, prompts[2], 2, 21), _sample(sampler, fresh, 2, 22)]
        wait_for(lambda: server.served.jobs.queued() >= 2)
    together = [future.result(timeout=60) for future in futures]
    assert calls == [2] and cache.reused_tokens - reused == len(prompts[2]) - 1
    monkeypatch.undo()
    # a new snapshot is another model: nothing of the old one's rows is reused
    client.forward_backward([ce_datum([9, 8, 7, 6, 5, 4])], "cross_entropy")
    client.optim_step(ADAM).result()
    newer = _sampling_client(client)
    reused = cache.reused_tokens
    after_update = _sample(newer, prompts[2], 2, 31).result(timeout=60)
    assert cache.reused_tokens == reused
    worker.prefix_cache = PrefixCache(0)  # the same requests again, nothing kept
    try:
        _, plain = _turns(sampler, first, observations, seeds=[11, 12, 13])
        for a, b in zip(cached, plain):
            _same(a, b)
        for a, (prompt, seed) in zip(together, [(prompts[2], 21), (fresh, 22)]):
            _same(a, _sample(sampler, prompt, 2, seed).result(timeout=60))
        _same(after_update, _sample(newer, prompts[2], 2, 31).result(timeout=60))
    finally:
        worker.prefix_cache = cache
    # rows are kept by the loaded adapter's name (a snapshot loaded again gets another); a session that ends takes
    # its samplers' adapters along, and their rows
    names = [worker.loaded[s.snapshot.key] for s in list(worker.samplers.values())
             if s.snapshot is not None and s.snapshot.key in worker.loaded]
    assert len(names) == 2 and all(cache.rows_of(name) > 0 for name in names)
    service.close("success").result(timeout=30)
    wait_for(lambda: all(cache.rows_of(name) == 0 for name in names))


def test_a_named_snapshot_saved_again_and_reloaded_reuses_none_of_its_old_rows(server):
    """A sampling session on a named path reads its folder again whenever its adapter is loaded again (after 4 other
    snapshots were sampled): saved over meanwhile, its new weights must not continue the old weights' rows (rows are
    kept by the loaded adapter's name, which no other load gets). Found by review: log-probs 0.13 off."""
    worker = server.worker
    client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=7).result()
    for _ in range(2):
        client.forward_backward([ce_datum([5, 17, 33, 8, 41, 2, 9, 11, 13])], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = client.save_weights_for_sampler(name="saved-again").result().path
    named = server.service.create_sampling_client(model_path=path)
    prompt = np.random.default_rng(3).integers(3, 90, 40).tolist()
    turn = prompt + _sample(named, prompt, 1, seed=1).result(timeout=60).sequences[0].tokens + [7, 8, 9]
    client.forward_backward([ce_datum([9, 8, 7, 6, 5, 4, 3])], "cross_entropy")
    client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    client.save_weights_for_sampler(name="saved-again").result()  # the folder the session reads, saved over
    for _ in range(4):  # 4 other snapshots sampled: the named one's adapter is unloaded
        _sample(_sampling_client(client), prompt[:5], 1, seed=2).result(timeout=60)
    reused = worker.prefix_cache.reused_tokens
    cached = _sample(named, turn, 1, seed=5).result(timeout=60)  # loaded again, from the new folder
    assert worker.prefix_cache.reused_tokens == reused
    cache, worker.prefix_cache = worker.prefix_cache, PrefixCache(0)
    try:
        _same(cached, _sample(named, turn, 1, seed=5).result(timeout=60))
    finally:
        worker.prefix_cache = cache
