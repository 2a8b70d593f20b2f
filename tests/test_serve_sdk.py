"""`rlora serve` driven by the official tinker SDK (tinker==0.38.0) over HTTP, on a tiny random model: training
lowers the loss, the built-in losses compute tinker's formulas, samples are rlora's sampler's own and their
log-probs are rlora's trainer's, saved weights are PEFT folders that peft loads."""

from types import SimpleNamespace

import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from serve_helpers import KEY, running_server
from tinker import types
from transformers import AutoModelForCausalLM

from rlora.models.loading import load_tokenizer
from rlora.models.logprobs import completion_logprobs
from rlora.models.tiny import build_random_model
from rlora.rollout.engine import BuiltinGenerator
from rlora.types import SamplingParams

# peft: an output-layer LoRA on a model with tied embeddings would change the embeddings if merged (not done here)
pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings")
PROMPTS = [("What is 3 + 4?", " The answer is 7."), ("State the final answer: 9 - 2 =", " 7"),
           ("Hello, how are you today?", " a b c d e f g")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = str(build_random_model(tmp_path_factory.mktemp("serve") / "model", seed=0))
    state_dir = tmp_path_factory.mktemp("serve-state")
    with running_server(model_dir, state_dir) as (url, served):
        yield SimpleNamespace(url=url, model=model_dir, state=state_dir, served=served)


@pytest.fixture(scope="module")
def service(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    yield client
    client.close("success").result(timeout=30)


@pytest.fixture(scope="module")
def tokenizer(server):
    return load_tokenizer(server.model)


def sft_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """Tinker's layout: input = sequence[:-1], targets = sequence[1:], weight 1 on the answer's tokens only."""
    p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
    full = p + a
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)})


def local_adapter(model_dir: str, folder) -> torch.nn.Module:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(folder)).eval()


def test_cross_entropy_training_lowers_the_loss(server, service):
    tc = service.create_lora_training_client(base_model=server.model, rank=4, seed=0).result()
    info = tc.get_info()
    assert (info.lora_rank, info.model_data.model_name, info.model_data.tokenizer_id) == (4, server.model, server.model)
    tok = tc.get_tokenizer()  # the SDK loads the tokenizer the server names: the model folder
    data = [sft_datum(tok, p, a) for p, a in PROMPTS]
    losses = []
    for _ in range(6):
        fwd_bwd = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        out, stats = fwd_bwd.result(), step.result()
        # tinker's cross_entropy: the sum over every token of -weight * logp, logp per input position
        expected = sum(-(o["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
                       for o, d in zip(out.loss_fn_outputs, data))
        assert [len(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs] == [d.model_input.length for d in data]
        assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
        assert stats.metrics["grad_norm:mean"] > 0 and stats.metrics["skipped_update:sum"] == 0
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.6 * losses[0], losses
    # forward changes nothing: twice the same numbers, and they are the next forward_backward's
    first, second = (tc.forward(data, "cross_entropy").result() for _ in range(2))
    after = tc.forward_backward(data, "cross_entropy").result()
    assert first.metrics == second.metrics and first.metrics["loss:sum"] == pytest.approx(after.metrics["loss:sum"], rel=1e-6)
    assert first.metrics["loss:sum"] < losses[-1]


def test_samples_are_rlora_samplers_and_their_logprobs_rloras_trainers(server, service, tokenizer):
    hf_tokenizer, tok = tokenizer
    tc = service.create_lora_training_client(base_model=server.model, rank=8, seed=1).result()
    data = [sft_datum(hf_tokenizer, p, a) for p, a in PROMPTS]
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = tc.save_weights_for_sampler("after-2").result()
    assert saved.path == f"tinker://{tc.model_id}/sampler_weights/after-2"
    [folder] = list(server.state.glob("models/*/sampler_weights/after-2"))
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    local = local_adapter(server.model, folder)  # a plain PEFT folder: peft loads it onto the base

    sampler = service.create_sampling_client(model_path=saved.path).result()
    prompt = hf_tokenizer.encode("What is 3 + 4?")
    params = types.SamplingParams(max_tokens=10, temperature=0.8, seed=7)
    result = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result()
    rollout = BuiltinGenerator(hf_tokenizer, tok.eos_ids, tok.pad_id).sample(
        local, [prompt], 3, SamplingParams(max_new_tokens=10, temperature=0.8), seed=7)
    trainer_logp, _ = completion_logprobs(local, rollout.select(slice(None)))
    for row, seq in enumerate(result.sequences):
        n = int(rollout.completion_mask_BTc[row].sum())
        assert seq.tokens == rollout.completion_ids_BTc[row, :n].tolist()  # rlora's sampler, the same seed
        assert seq.stop_reason == rollout.finish_reasons[row]
        np.testing.assert_allclose(seq.logprobs, rollout.sampling_logp_BTc[row, :n].numpy(), atol=1e-6)
        np.testing.assert_allclose(seq.logprobs, trainer_logp[row, :n].detach().numpy(), atol=1e-4)
    assert len({tuple(s.tokens) for s in result.sequences}) > 1
    with local.disable_adapter():  # the adapter was trained: the base gives those tokens other log-probs
        base_logp, _ = completion_logprobs(local, rollout.select(slice(None)))
    assert (base_logp - trainer_logp).abs().max() > 1e-2

    # the server's own training path at the snapshot's weights gives the sampler's log-probs (temperature 1)
    result = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=8, seed=3)).result()
    datums = [types.Datum(model_input=types.ModelInput.from_ints((prompt + s.tokens)[:-1]),
                          loss_fn_inputs={"target_tokens": (prompt + s.tokens)[1:]}) for s in result.sequences]
    forward = tc.forward(datums, "cross_entropy").result()
    for seq, out in zip(result.sequences, forward.loss_fn_outputs):
        np.testing.assert_allclose(seq.logprobs, out["logprobs"].to_numpy()[len(prompt) - 1:], atol=1e-4)
    # compute_logprobs: the prompt's own log-probs (none for its first token)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]), loss_fn_inputs={"target_tokens": prompt[1:]})
    expected = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs[0] is None
    np.testing.assert_allclose(logprobs[1:], expected, atol=1e-5)


def test_importance_sampling_and_ppo_are_tinkers_formulas(server, service, tokenizer):
    hf_tokenizer, _ = tokenizer
    tc = service.create_lora_training_client(base_model=server.model, rank=4, seed=2).result()
    ids = hf_tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    inputs, targets = ids[:-1], ids[1:]
    ce = types.Datum(model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={"target_tokens": targets})
    logp = tc.forward([ce], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    rng = np.random.default_rng(0)
    sampler_logp = (logp + rng.uniform(-0.4, 0.4, len(logp))).astype(np.float32)  # ratios 0.67 .. 1.5
    advantages = rng.choice([-1.0, 0.5, 2.0], len(logp)).astype(np.float32)
    rl = types.Datum(model_input=types.ModelInput.from_ints(inputs),
                     loss_fn_inputs={"target_tokens": targets, "logprobs": sampler_logp, "advantages": advantages})
    ratio = np.exp(logp.astype(np.float64) - sampler_logp)
    out = tc.forward([rl], "importance_sampling").result()
    assert out.metrics["loss:sum"] == pytest.approx(-(ratio * advantages).sum(), rel=1e-4)
    for config, low, high in [(None, 0.8, 1.2), ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, 0.9, 1.05)]:
        out = tc.forward([rl], "ppo", config).result()
        expected = -np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages).sum()
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    # the RL loss trains: a step along its gradient lowers it
    before = tc.forward_backward([rl], "importance_sampling").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward([rl], "importance_sampling").result().metrics["loss:sum"] < before


def test_unnamed_snapshots_the_base_and_stop_tokens(server, service, tokenizer):
    hf_tokenizer, tok = tokenizer
    tc = service.create_lora_training_client(base_model=server.model, rank=4, seed=3, train_unembed=False).result()
    prompt = hf_tokenizer.encode("Hello, how are you today?")
    model_input = types.ModelInput.from_ints(prompt)
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0)
    # a fresh adapter (B = 0) is the base: an unnamed snapshot samples what the base sampler samples
    snapshot = tc.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model=server.model).result()
    [from_snapshot] = snapshot.sample(model_input, 1, greedy).result().sequences
    [from_base] = base.sample(model_input, 1, greedy).result().sequences
    assert from_snapshot.tokens == from_base.tokens and len(from_base.tokens) == 12
    plain = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32).eval()
    rollout = BuiltinGenerator(hf_tokenizer, tok.eos_ids, tok.pad_id).sample(
        plain, [prompt], 1, SamplingParams(max_new_tokens=12, greedy=True), seed=0)
    assert from_base.tokens == rollout.completion_ids_BTc[0, :int(rollout.completion_mask_BTc[0].sum())].tolist()
    # stop tokens replace EOS: a sample ends with the first one it draws, included
    stop_at = from_base.tokens[4]
    first = from_base.tokens.index(stop_at)
    [stopped] = base.sample(model_input, 1, types.SamplingParams(max_tokens=12, temperature=0.0, stop=[stop_at])).result().sequences
    assert stopped.tokens == from_base.tokens[:first + 1] and stopped.stop_reason == "stop"
    # after training the snapshot taken before still samples the old weights
    data = [sft_datum(hf_tokenizer, p, a) for p, a in PROMPTS]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert snapshot.sample(model_input, 1, greedy).result().sequences[0].tokens == from_base.tokens
    trained = tc.save_weights_and_get_sampling_client().result()
    [now] = trained.sample(model_input, 1, types.SamplingParams(max_tokens=12, temperature=0.0)).result().sequences
    assert now.logprobs != from_base.logprobs


def test_snapshots_beyond_those_kept_loaded_come_back_and_old_unnamed_ones_expire(server, service, tokenizer):
    hf_tokenizer, _ = tokenizer
    tc = service.create_lora_training_client(base_model=server.model, rank=4, seed=4).result()
    data = [sft_datum(hf_tokenizer, p, a) for p, a in PROMPTS]
    model_input = types.ModelInput.from_ints(hf_tokenizer.encode("What is 3 + 4?"))
    params = types.SamplingParams(max_tokens=6, seed=11)
    samplers, first_samples = [], []
    for i in range(6):  # more snapshots than the 4 kept loaded as adapters: the oldest is unloaded, then reloaded
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        path = tc.save_weights_for_sampler(f"lru-{i}").result().path
        samplers.append(service.create_sampling_client(model_path=path).result())
        first_samples.append(samplers[-1].sample(model_input, 2, params).result().sequences)
    again = samplers[0].sample(model_input, 2, params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in first_samples[0]]
    assert [s.logprobs for s in again] == [s.logprobs for s in first_samples[0]]
    assert first_samples[0][0].logprobs != first_samples[-1][0].logprobs  # each snapshot its own weights
    unnamed = [tc.save_weights_and_get_sampling_client().result() for _ in range(17)]  # 16 are kept
    with pytest.raises(tinker.NotFoundError, match="unknown or expired sampling session"):  # refused on arrival
        unnamed[0].sample(model_input, 1, params).result()
    assert len(unnamed[-1].sample(model_input, 1, params).result().sequences) == 1


def test_the_docs_example_runs_without_deprecation_warnings(server, monkeypatch, capsys):
    """docs/serve.md's example, on the test server's model: tinker 0.38 returns futures where clients were
    returned before, and warns (FutureWarning) when a future is used as the client; the example calls .result()."""
    import re
    import warnings
    from pathlib import Path

    docs = (Path(__file__).parent.parent / "docs" / "serve.md").read_text()
    example = re.search(r"```python\n(.*?)```", docs, re.S).group(1).replace('"smollm2-135m-instruct"', repr(server.model))
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(example, "docs/serve.md", "exec"), {})
    assert not [str(w.message) for w in caught if "Using the future as" in str(w.message)]
    assert capsys.readouterr().out.startswith(tuple("0123456789"))  # the loss, a number
