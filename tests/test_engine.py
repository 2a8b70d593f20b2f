"""The built-in sampler against Hugging Face generate and against the trainer's log-probs, on tiny random
Llama and Qwen2 models (Qwen2 has q/k/v biases, so fused projections must carry them)."""

import pytest
import torch
from test_policy_model import make_policy, perturb_adapter

from rlora.models.logprobs import completion_logprobs
from rlora.models.tiny import build_random_model
from rlora.rollout.backends import build_generator
from rlora.config import RolloutConfig
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.types import SamplingParams

TEXTS = ["What", "What is 3 + 4? The answer", "Hello, how are you today? a b c", "0 1 2"]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("qwen2") / "model", family="qwen2", tie=False, seed=3))


def policy(model_dir, scale=0.3, seed=1, **lora):
    tokenizer, tok, model = make_policy(model_dir, **lora)
    perturb_adapter(model, scale=scale, seed=seed)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    return tokenizer, tok, model, prompts


def tokens_of(rollout, row):
    return rollout.completion_ids_BTc[row][rollout.completion_mask_BTc[row].bool()].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("decode", ["eager", "static"])
def test_greedy_matches_hf_generate_token_for_token(tiny_model_dir, qwen2_dir, family, merge, decode):
    assert_greedy_matches_generate(tiny_model_dir if family == "llama" else qwen2_dir, merge, decode, family)


def assert_greedy_matches_generate(model_dir: str, merge: bool, decode: str, label: str) -> None:
    """Rows of different prompt lengths decoded together (left padding) against one prompt at a time in
    transformers, with a LoRA adapter on every linear layer whose B factors are random (and that changes some
    completion: otherwise the comparison would not see the adapter)."""
    tokenizer, tok, model, prompts = policy(model_dir)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=merge, decode=decode)
    ours = engine.sample(model, prompts, 2, greedy, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    base_differs = False
    for i, prompt in enumerate(prompts):
        want = hf.sample(model, [prompt], 1, greedy, seed=0)  # one prompt at a time: no padding at all
        assert tokens_of(ours, 2 * i) == tokens_of(want, 0) == tokens_of(ours, 2 * i + 1), (label, merge, decode, i)
        with model.disable_adapter():
            base = hf.sample(model, [prompt], 1, greedy, seed=0)
        base_differs |= tokens_of(base, 0) != tokens_of(want, 0)
    assert base_differs, "the adapter must change some greedy completion, or this test proves nothing"


@pytest.mark.parametrize("merge", [True, False])
def test_sampling_logprobs_agree_with_the_trainer(tiny_model_dir, merge):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    per_prompt = [SamplingParams(max_new_tokens=n, temperature=t, top_p=0.9, min_new_tokens=n) for n, t in
                  [(12, 0.7), (5, 1.0), (9, 1.3), (12, 0.7)]]  # ragged lengths (EOS held off), per-prompt temperatures
    rollout = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=merge).sample(model, prompts, 3, per_prompt, seed=7)
    assert rollout.completion_mask_BTc.sum(-1).tolist() == [12] * 3 + [5] * 3 + [9] * 3 + [12] * 3
    assert rollout.temperature_B.tolist() == pytest.approx([0.7] * 3 + [1.0] * 3 + [1.3] * 3 + [0.7] * 3)
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    gap = (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs()
    assert gap.mean() < 1e-4 and gap.max() < 1e-3, (gap.mean(), gap.max())
    assert (rollout.sampling_logp_BTc[~mask] == 0).all()


@pytest.mark.parametrize("merge", [True, False])
def test_static_decode_samples_what_the_eager_step_samples(tiny_model_dir, merge):
    """The fixed-shape step (the one CUDA graphs replay) against the row-dropping eager step: rows that end
    early (EOS) and per-prompt settings, same tokens, same reasons, log-probs to float rounding."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    per_prompt = [SamplingParams(max_new_tokens=n, temperature=t, top_p=p) for n, t, p in
                  [(14, 0.7, 0.9), (6, 1.0, 1.0), (11, 1.3, 0.8), (14, 0.5, 1.0)]]
    # a token that row 0 draws third, declared EOS: row 0 then stops there (the draws before it are the same),
    # and other rows wherever they draw it, so rows finish at ragged steps
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 3, per_prompt, seed=5)
    eos = int(free.completion_ids_BTc[0, 2])
    eager, static = (BuiltinGenerator(tokenizer, [eos], tok.pad_id, merge=merge, decode=mode).sample(
        model, prompts, 3, per_prompt, seed=5) for mode in ("eager", "static"))
    assert torch.equal(eager.completion_ids_BTc, static.completion_ids_BTc)
    assert torch.equal(eager.completion_mask_BTc, static.completion_mask_BTc)
    assert eager.finish_reasons == static.finish_reasons and "stop" in eager.finish_reasons
    assert len(set(eager.completion_mask_BTc.sum(-1).tolist())) > 2, "rows must end at different steps"
    assert (eager.sampling_logp_BTc - static.sampling_logp_BTc).abs().max() < 1e-5


def test_the_adapter_changes_the_samples(tiny_model_dir):
    """A sampler that silently ignored the adapter would give the base model's samples."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    adapted = engine.sample(model, prompts, 4, params, seed=3)
    with model.disable_adapter():
        base = engine.sample(model, prompts, 4, params, seed=3)
    differs = (adapted.completion_ids_BTc != base.completion_ids_BTc).any(-1).float().mean()
    assert differs > 0.5
    # with the adapter off, the engine samples the base model: its log-probs match the base's
    with torch.no_grad(), model.disable_adapter():
        model.eval()
        base_logp, _ = completion_logprobs(model, base.select(slice(None)))
    mask = base.completion_mask_BTc.bool()
    assert (base_logp[mask] - base.sampling_logp_BTc[mask]).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_weights_bit_identical_after_50_merge_cycles(tiny_model_dir, dtype):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    model.to(dtype)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True)
    for cycle in range(50):
        perturb_adapter(model, scale=0.5, seed=cycle)  # a new adapter every cycle, as after each update
        engine.sample(model, prompts[:2], 2, SamplingParams(max_new_tokens=2), seed=cycle)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base_before.items())


def test_seeded_and_reproducible(tiny_model_dir):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    a, b = (engine.sample(model, prompts, 4, params, seed=11) for _ in range(2))
    c = engine.sample(model, prompts, 4, params, seed=12)
    assert torch.equal(a.completion_ids_BTc, b.completion_ids_BTc)
    assert torch.equal(a.sampling_logp_BTc, b.sampling_logp_BTc)
    assert not torch.equal(a.completion_ids_BTc, c.completion_ids_BTc)


def test_per_prompt_settings_and_finished_rows(tiny_model_dir):
    """Greedy rows next to sampled rows and rows that stop early: the greedy ones still equal generate."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    settings = [SamplingParams(max_new_tokens=14, greedy=True), SamplingParams(max_new_tokens=3, temperature=1.5),
                SamplingParams(max_new_tokens=14, greedy=True), SamplingParams(max_new_tokens=6, temperature=0.5)]
    rollout = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 2, settings, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    for i in (0, 2):
        want = tokens_of(hf.sample(model, [prompts[i]], 1, settings[i], seed=0), 0)
        assert tokens_of(rollout, 2 * i) == want and tokens_of(rollout, 2 * i + 1) == want
    assert rollout.completion_mask_BTc.sum(-1).tolist() == [14, 14, 3, 3, 14, 14, 6, 6]
    assert rollout.finish_reasons == ["length"] * 8


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_generate_samples_what_the_engine_samples(tiny_model_dir, qwen2_dir, family):
    """transformers generate with rollout/generate_draw.py's draw: per-prompt temperatures, top-k, top-p, min-p,
    greedy and min_new_tokens, a seed and a key per prompt, in calls of 5 rows: the engine's tokens and finish
    reasons, log-probs within 1e-5 of the engine's and of the trainer's, and a prompt sampled alone (its key kept)
    draws what it draws among the others."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir if family == "llama" else qwen2_dir)
    settings = [SamplingParams(max_new_tokens=24, temperature=1.3, top_k=20, min_new_tokens=6),
                SamplingParams(max_new_tokens=24, greedy=True),
                SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, min_p=0.05),
                SamplingParams(max_new_tokens=24, temperature=1.0)]
    seeds, keys = [5, 6, 5, 8], [10, 11, 12, 13]
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 3, settings, seed=seeds, keys=keys)
    # the random model rarely draws its EOS: a token it draws often ends rows instead (and min_new_tokens bans it)
    eos = int(free.completion_ids_BTc[free.completion_mask_BTc.bool()].mode().values)
    engine = BuiltinGenerator(tokenizer, [eos], tok.pad_id, merge=False, decode="eager")
    want = engine.sample(model, prompts, 3, settings, seed=seeds, keys=keys)
    hf = HFGenerator(tokenizer, [eos], tok.pad_id, batch_size=5)
    got = hf.sample(model, prompts, 3, settings, seed=seeds, keys=keys)
    assert [tokens_of(got, r) for r in range(12)] == [tokens_of(want, r) for r in range(12)]
    assert got.finish_reasons == want.finish_reasons and got.completion_ids_BTc.shape == want.completion_ids_BTc.shape
    assert 0 < got.finish_reasons.count("stop") < 12, "EOS must end some rows and not others"
    assert all(len(tokens_of(got, r)) >= 6 for r in range(3))  # prompt 0's min_new_tokens
    mask = got.completion_mask_BTc.bool()
    assert (got.sampling_logp_BTc - want.sampling_logp_BTc.cpu())[mask].abs().max() < 1e-5
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, got.select(slice(None)))
    assert (got.sampling_logp_BTc - trainer)[mask].abs().max() < 1e-5
    assert (got.sampling_logp_BTc[~mask] == 0).all()
    alone = hf.sample(model, prompts[2:3], 3, settings[2], seed=5, keys=[12])
    assert [tokens_of(alone, r) for r in range(3)] == [tokens_of(got, r) for r in range(6, 9)]


def test_generate_calls_back_with_each_token_as_the_engine_does(tiny_model_dir):
    """on_token through generate (rlora chat streams with it): every row's tokens up to its end, EOS or the token
    that completes a stop string, in the order drawn, as the engine reports them; with several policies too."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(
        model, prompts, 2, SamplingParams(max_new_tokens=12, temperature=1.0), seed=4)
    eos = int(free.completion_ids_BTc[free.completion_mask_BTc.bool()].mode().values)
    stop = tokenizer.decode(tokens_of(free, 2)[2:4])
    settings = [SamplingParams(max_new_tokens=12, temperature=1.0),
                SamplingParams(max_new_tokens=12, temperature=1.0, stop=(stop,))] * 2
    reports = {}
    for name, sampler in (("engine", BuiltinGenerator(tokenizer, [eos], tok.pad_id)),
                          ("generate", HFGenerator(tokenizer, [eos], tok.pad_id, batch_size=3))):
        seen: dict[int, list[int]] = {}
        rollout = sampler.sample(model, prompts, 2, settings, seed=4, on_token=lambda row, t: seen.setdefault(row, []).append(t))
        assert [seen[row] for row in range(8)] == [tokens_of(rollout, row) for row in range(8)], name
        reports[name] = seen, rollout.finish_reasons
    assert reports["generate"] == reports["engine"]
    seen, reasons = reports["engine"]
    ends = {"eos" if row_tokens[-1] == eos else reasons[row] for row, row_tokens in seen.items()}
    assert ends == {"eos", "stop", "length"}  # rows ended by EOS, by the stop string and by the length limit


def test_stop_strings_end_completions_like_generate(tiny_model_dir):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    free = engine.sample(model, prompts[1:2], 1, greedy, seed=0)
    ids = tokens_of(free, 0)
    stop = tokenizer.decode(ids[4:6])  # a string the greedy completion produces at its 6th token
    assert stop.strip(), "pick a stop string with visible characters"
    params = SamplingParams(max_new_tokens=16, greedy=True, stop=(stop,))
    stopped = engine.sample(model, prompts[1:2], 1, params, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts[1:2], 1, params, seed=0)
    first_hit = next(t for t in range(1, 17) if stop in tokenizer.decode(ids[:t]))
    assert tokens_of(stopped, 0) == ids[:first_hit] == tokens_of(hf, 0)
    assert stopped.finish_reasons == ["stop"] == hf.finish_reasons
    assert stopped.completions[0].endswith(stop)


def test_backend_choice_falls_back_for_unsupported_models(tiny_model_dir):
    tokenizer, tok, model, _ = policy(tiny_model_dir)
    builtin = build_generator(RolloutConfig(), model, tokenizer, tok.eos_ids, tok.pad_id, 100, 8)
    assert builtin.name == "builtin"
    assert build_generator(RolloutConfig(engine="hf"), model, tokenizer, tok.eos_ids, tok.pad_id, 100, 8).name == "hf"
    model.get_base_model().config.model_type = "gpt2"  # an architecture the engine does not implement
    try:
        assert build_generator(RolloutConfig(), model, tokenizer, tok.eos_ids, tok.pad_id, 100, 8).name == "hf"
    finally:
        model.get_base_model().config.model_type = "llama"


def test_quantized_or_variant_layers_are_called_as_modules(tiny_model_dir):
    """DoRA cannot be merged as W + BA: those layers run as modules and still match generate."""
    tokenizer, tok, model = make_policy(tiny_model_dir)
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from rlora.models.loading import load_base_model
    from rlora.config import ModelConfig
    base = load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir)
    dora = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    perturb_adapter(dora, scale=1.0)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    ours = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=True).sample(dora, prompts, 1, greedy, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    changed = False
    for i, prompt in enumerate(prompts):
        assert tokens_of(ours, i) == tokens_of(hf.sample(dora, [prompt], 1, greedy, seed=0), 0)
        with dora.disable_adapter():
            changed |= tokens_of(hf.sample(dora, [prompt], 1, greedy, seed=0), 0) != tokens_of(ours, i)
    assert changed, "the DoRA adapter must change some greedy completion, or this test proves nothing"


def test_bf16_sampler_on_an_fp32_model(tiny_model_dir):
    """Sampling from bf16 copies: close to the fp32 trainer, not equal; the model itself stays fp32."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, dtype=torch.bfloat16)
    rollout = engine.sample(model, prompts, 4, SamplingParams(max_new_tokens=10, temperature=1.0), seed=0)
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    gap = (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs().mean()
    assert 1e-4 < gap < 0.1, gap
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_eos_ends_a_row_like_generate(tiny_model_dir):
    """A random tiny model rarely samples its EOS; declare a token it does produce to be EOS instead."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    free = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 1, greedy, seed=0)
    eos = tokens_of(free, 1)[3]  # the 4th token of prompt 1's completion
    ours = BuiltinGenerator(tokenizer, [eos], tok.pad_id).sample(model, prompts, 2, greedy, seed=0)
    hf = HFGenerator(tokenizer, [eos], tok.pad_id)
    stopped = 0
    for i, prompt in enumerate(prompts):
        want = hf.sample(model, [prompt], 1, greedy, seed=0)
        assert tokens_of(ours, 2 * i) == tokens_of(want, 0) and ours.finish_reasons[2 * i] == want.finish_reasons[0]
        if ours.finish_reasons[2 * i] == "stop":
            stopped += 1
            assert tokens_of(ours, 2 * i)[-1] == eos and eos not in tokens_of(ours, 2 * i)[:-1]  # EOS kept, once
    assert stopped >= 1 and ours.finish_reasons[2] == "stop" and len(tokens_of(ours, 2)) <= 4


def test_several_chunks_and_pad_equal_to_eos(tiny_model_dir):
    """More rows than max_rows: prompts are decoded in chunks; the pad id is the EOS id (common when a
    tokenizer has no pad token): masks still end where each row ended."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    eos = tok.eos_ids[0]
    settings = [SamplingParams(max_new_tokens=n, greedy=True) for n in (9, 4, 12, 6)]
    ours = BuiltinGenerator(tokenizer, tok.eos_ids, eos, max_rows=4).sample(model, prompts, 2, settings, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, eos, batch_size=3).sample(model, prompts, 2, settings, seed=0)
    lengths = [9, 9, 4, 4, 12, 12, 6, 6]
    assert ours.completion_mask_BTc.sum(-1).tolist() == lengths == hf.completion_mask_BTc.sum(-1).tolist()
    assert ours.finish_reasons == ["length"] * 8 == hf.finish_reasons
    for row in range(8):
        assert tokens_of(ours, row) == tokens_of(hf, row)
    sampled = [SamplingParams(max_new_tokens=8, temperature=1.0)] * 4
    a, b = (BuiltinGenerator(tokenizer, tok.eos_ids, eos, max_rows=4).sample(model, prompts, 2, sampled, seed=5)
            for _ in range(2))
    assert torch.equal(a.completion_ids_BTc, b.completion_ids_BTc)


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_on_token_sees_every_token_as_it_is_drawn(tiny_model_dir, decode):
    """on_token(row, token) over 4 prompts x 3 rows in chunks of 2 prompts, rows ending at ragged steps (a token the
    model produces is declared EOS): each row's tokens arrive in order and are its completion (its EOS included),
    rows interleave step by step, and the samples are those drawn without the callback."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    first = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(
        model, prompts, 1, SamplingParams(max_new_tokens=16, greedy=True), seed=0)
    eos = tokens_of(first, 1)[3]
    engine = BuiltinGenerator(tokenizer, [eos], tok.pad_id, max_rows=6, decode=decode)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    seen = []
    streamed = engine.sample(model, prompts, 3, params, seed=2, on_token=lambda row, token: seen.append((row, token)))
    plain = engine.sample(model, prompts, 3, params, seed=2)
    assert torch.equal(streamed.completion_ids_BTc, plain.completion_ids_BTc)
    lengths = streamed.completion_mask_BTc.sum(-1).tolist()
    assert len(set(lengths)) > 1 and "stop" in streamed.finish_reasons
    for row in range(12):
        tokens = [token for r, token in seen if r == row]
        assert tokens == streamed.completion_ids_BTc[row, :lengths[row]].tolist() == tokens_of(streamed, row)
    assert [r for r, _ in seen[:6]] == list(range(6))  # the first chunk's rows, one token each, then the next step


def test_per_prompt_stop_strings(tiny_model_dir):
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    free = engine.sample(model, prompts, 1, greedy, seed=0)
    stop_for = {i: tokenizer.decode(tokens_of(free, i)[2:4]) for i in (0, 2)}  # prompts 1 and 3: no stop string
    settings = [SamplingParams(max_new_tokens=16, greedy=True, stop=(stop_for[i],) if i in stop_for else ())
                for i in range(4)]
    ours = engine.sample(model, prompts, 1, settings, seed=0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 1, settings, seed=0)
    for i in range(4):
        assert tokens_of(ours, i) == tokens_of(hf, i), i
    assert [r for r in ours.finish_reasons] == ["stop", "length", "stop", "length"] == hf.finish_reasons
    assert tokens_of(ours, 1) == tokens_of(free, 1) and len(tokens_of(ours, 0)) <= 4


def test_the_demo_settings_run_unchanged_on_a_model_that_falls_back(tmp_path, prompts_file, capsys):
    """A model the engine does not support (Gemma 3 with attention logit soft-capping, as Gemma 2 has) samples with
    generate in the model's dtype: the demo's sampler_dtype then does not apply, which one notice says once, and
    algo.sampler_is_cap weighs tokens by generate's own log-probs (rollout/generate_draw.py), which in the model's
    dtype equal the trainer's to float32 rounding: weights of 1 (its log-prob passes share prompts through the
    model's own attention, which applies the cap; they do not pack)."""
    import json

    from conftest import tiny_overrides

    from rlora.cli import main

    model_dir = build_random_model(tmp_path / "gemma", family="gemma3_text", attn_logit_softcapping=50.0)
    out = tmp_path / "run"
    code = main(["train", *tiny_overrides(str(model_dir), prompts_file, str(out), **{
        "algo.sampler_is_cap": 2.0, "rollout.sampler_dtype": "bfloat16", "eval.before": "false"})])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("does not support this model (attention logit soft-capping)") == 1, err
    assert "(rollout.sampler_dtype and merge_adapter do not apply)" in err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(abs(r["is_weight_mean"] - 1) < 1e-5 and r["sampler_logp_gap"] < 1e-5 for r in rows), rows
    assert all(r["grad_norm"] > 0 for r in rows)
