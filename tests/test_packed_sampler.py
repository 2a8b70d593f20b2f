"""The sampler's packed base weights, the LoRA unmerged beside them (rollout/packed.py): `rollout.sampler_dtype:
float16_weights` (fbgemm's float16 copies, float32 compute). oneDNN's packs: tests/test_onednn_packs.py."""

import pytest
import torch
from test_engine import policy, qwen2_dir, tokens_of  # noqa: F401 (qwen2_dir: a fixture)

from rlora.models.logprobs import completion_logprobs
from rlora.rollout.decoder import DecoderView
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.packed import PackCache, PackedLinear, packed_fp16_available
from rlora.types import SamplingParams

needs_fbgemm = pytest.mark.skipif(not packed_fp16_available(), reason="torch without the fbgemm engine (non-x86)")


def naive_map(modules, x, weight_dtype):
    """Each module's map written out: base weight rounded to weight_dtype, bias, each active adapter's s * B A x."""
    outs = []
    for m in modules:
        base = m.get_base_layer()
        y = x.double() @ base.weight.to(weight_dtype).double().T
        if base.bias is not None:
            y = y + base.bias.double()
        for name in [] if m.disable_adapters else m.active_adapters:
            A, B = m.lora_A[name].weight.double(), m.lora_B[name].weight.double()
            y = y + m.scaling[name] * (x.double() @ A.T) @ B.T
        outs.append(y)
    return torch.cat(outs, dim=-1)


@needs_fbgemm
def test_packed_qkv_equals_the_naive_map_with_float16_weights(qwen2_dir):
    """Qwen2's fused q/k/v (biases included) with a non-zero LoRA on each: equal to the map with float16-rounded base
    weights up to float32 accumulation, and measurably not the float32 map (so the test sees the rounding)."""
    _, _, model, _ = policy(qwen2_dir)
    attn = model.get_base_model().model.layers[0].self_attn
    modules = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(5, 7, modules[0].in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q, k, v = PackedLinear.of(modules, PackCache())(x)
    ours = torch.cat([q, k, v], dim=-1).double()
    want_fp16 = naive_map(modules, x, torch.float16)
    want_fp32 = naive_map(modules, x, torch.float32)
    scale = want_fp32.abs().max()
    assert (ours - want_fp16).abs().max() < 1e-6 * scale  # float32 accumulation of a 64-term dot product
    assert (ours - want_fp32).abs().max() > 20 * (ours - want_fp16).abs().max()
    with model.disable_adapter(), torch.no_grad():
        base_only = torch.cat(PackedLinear.of(modules, PackCache())(x), dim=-1).double()
        want_base = naive_map(modules, x, torch.float16)
    assert (base_only - want_base).abs().max() < 1e-6 * scale and (base_only - ours).abs().max() > 1e-3 * scale


@needs_fbgemm
def test_the_packed_base_is_kept_between_calls_and_redone_when_it_changes(tiny_model_dir):
    _, _, model, _ = policy(tiny_model_dir)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    cache = PackCache()
    first = cache.packed([q_proj.get_base_layer()])
    assert cache.packed([q_proj.get_base_layer()]) is first
    x = torch.randn(3, q_proj.in_features)
    before = PackedLinear.of([q_proj], cache)(x)[0]
    with torch.no_grad():
        q_proj.get_base_layer().weight.mul_(2.0)  # an in-place change bumps the version counter
    assert cache.packed([q_proj.get_base_layer()]) is not first
    with model.disable_adapter(), torch.no_grad():
        after = PackedLinear.of([q_proj], cache)(x)[0]
        want = naive_map([q_proj], x, torch.float16)
    assert (after.double() - want).abs().max() < 1e-6 * want.abs().max() and not torch.allclose(before, after)


@needs_fbgemm
def test_sampled_logprobs_are_the_trainers_up_to_float16_weights(tiny_model_dir):
    """The sampler's log-probs of its own tokens: close to the float32 trainer's with the adapter on (the
    adapter is applied), far from them with it off; the model's parameters stay float32 and untouched."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    before = {n: p.clone() for n, p in model.named_parameters()}
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, fp16_weights=True)
    rollout = engine.sample(model, prompts, 4, SamplingParams(max_new_tokens=10, temperature=1.0), seed=0)
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
        with model.disable_adapter():
            base, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    gap = (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs()
    assert 1e-7 < gap.mean() and gap.max() < 5e-3, (gap.mean(), gap.max())
    assert (base[mask] - rollout.sampling_logp_BTc[mask]).abs().mean() > 100 * gap.mean()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@needs_fbgemm
def test_greedy_equals_the_float32_samplers_and_reuses_the_packs(tiny_model_dir):
    """Greedy decoding from float16 weights picks the float32 sampler's tokens here (no near-ties in this tiny
    model at these prompts), and a second call packs nothing new."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    exact = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 2, greedy, seed=0)
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, fp16_weights=True)
    ours = engine.sample(model, prompts, 2, greedy, seed=0)
    assert [tokens_of(ours, r) for r in range(8)] == [tokens_of(exact, r) for r in range(8)]
    packed = dict(engine.packs._entries)
    engine.sample(model, prompts, 2, greedy, seed=0)
    assert engine.packs._entries.keys() == packed.keys()
    assert all(engine.packs._entries[k][2] is v[2] for k, v in packed.items())


@needs_fbgemm
def test_packs_refuse_a_model_off_the_cpu(tiny_model_dir):
    _, _, model, _ = policy(tiny_model_dir)
    with pytest.raises(ValueError, match="CPU only"):
        DecoderView.of(model.to("meta"), merge=True, packs=PackCache())


@needs_fbgemm
def test_packs_refuse_a_sharded_base(tiny_model_dir, monkeypatch):
    """A sharded base is gathered anew each pass: packs would be rebuilt every call (slower than float32)."""
    from rlora.rollout import decoder

    _, _, model, _ = policy(tiny_model_dir)
    monkeypatch.setattr(decoder, "sharded_base", lambda m: object())
    with pytest.raises(ValueError, match="stays put"):
        DecoderView.of(model, merge=True, packs=PackCache())


def policies_gaps(tiny_model_dir, **engine_args):
    """A model with 3 policy adapters sampled by BuiltinGenerator(**engine_args) -> (the engine, the model, |trainer -
    sampler| log-prob gaps of every completion token: [each row under its own policy, under another policy])."""
    from test_policies import policies_model

    from rlora.models.loading import load_tokenizer
    from rlora.models.multi_lora import policy_rows

    tokenizer, tok = load_tokenizer(tiny_model_dir)
    model = policies_model(tiny_model_dir, dtype=torch.float32)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Hello there")]
    K, G = 3, 4
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, **engine_args)
    rollout = engine.sample(model, prompts * K, G, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0,
                            keys=list(range(len(prompts))) * K, policies=[k for k in range(K) for _ in prompts])
    policy_B = torch.arange(K).repeat_interleave(len(prompts) * G)
    mask = rollout.completion_mask_BTc.bool()
    gaps = []
    for rows_policy in (policy_B, (policy_B + 1) % K):  # each row's own policy, then another one
        with torch.no_grad(), policy_rows(model, rows_policy):
            trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
        gaps.append((trainer[mask] - rollout.sampling_logp_BTc[mask]).abs())
    return engine, model, gaps


@needs_fbgemm
def test_several_policies_sample_from_the_packed_base_with_their_own_adapters(tiny_model_dir):
    """A model with 3 policy adapters: each row's log-probs are its own policy's (float32 trainer, up to the float16
    base weights), far from another policy's."""
    engine, model, gaps = policies_gaps(tiny_model_dir, fp16_weights=True)
    assert 1e-7 < gaps[0].mean() and gaps[0].max() < 5e-3 and gaps[1].mean() > 100 * gaps[0].mean()
    layers = len(model.get_base_model().model.layers)
    assert len(engine.packs._entries) == 4 * layers + 1  # q/k/v, o, gate/up, down per layer; the output layer
