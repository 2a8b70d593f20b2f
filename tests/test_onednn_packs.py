"""oneDNN's packed base weights (rollout/packed.py OneDnnPacks): the CPU sampler's float32 and bfloat16 linear maps
run from a blocked copy of the frozen base made once, the LoRA unmerged beside it."""

import pytest
import torch
from test_engine import policy, qwen2_dir, tokens_of  # noqa: F401 (qwen2_dir: a fixture)
from test_packed_sampler import naive_map, policies_gaps

from rlora.config import RolloutConfig
from rlora.models.logprobs import completion_logprobs
from rlora.rollout.backends import build_generator
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.packed import (Fp16Packs, OneDnnPacks, PackCache, PackedLinear, onednn_packs_available,
                                  packed_fp16_available)
from rlora.types import SamplingParams

pytestmark = pytest.mark.skipif(not onednn_packs_available(torch.float32), reason="not an x86 CPU with oneDNN")


def qkv_modules(model):
    attn = model.get_base_model().model.layers[0].self_attn
    return [attn.q_proj, attn.k_proj, attn.v_proj]


def test_float32_packs_are_the_float32_map(qwen2_dir):
    """Qwen2's fused q/k/v (biases included) with a non-zero LoRA on each, from float32 packs: the float64 map of the
    float32 weights up to float32 accumulation, with no rounding of the weights (float16's would be ~100x larger)."""
    _, _, model, _ = policy(qwen2_dir)
    modules = qkv_modules(model)
    x = torch.randn(5, 7, modules[0].in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = torch.cat(PackedLinear.of(modules, PackCache(OneDnnPacks(torch.float32)))(x), dim=-1).double()
        with model.disable_adapter():
            base_only = torch.cat(PackedLinear.of(modules, PackCache(OneDnnPacks(torch.float32)))(x), dim=-1).double()
    want, scale = naive_map(modules, x, torch.float32), naive_map(modules, x, torch.float32).abs().max()
    assert (ours - want).abs().max() < 1e-6 * scale  # float32 sums of 64 products
    assert (naive_map(modules, x, torch.float16) - want).abs().max() > 20 * (ours - want).abs().max()
    with model.disable_adapter():
        want_base = naive_map(modules, x, torch.float32)
    assert (base_only - want_base).abs().max() < 1e-6 * scale and (base_only - ours).abs().max() > 1e-3 * scale


@pytest.mark.skipif(not onednn_packs_available(torch.bfloat16),
                    reason="the CPU computes no bf16 natively (AVX512-BF16/AMX)")
def test_bfloat16_packs_are_the_map_in_bfloat16(qwen2_dir):
    """bf16 packs of a float32 base: the map of bf16-rounded weights and inputs up to bf16 outputs (8 bits of
    mantissa: 2^-8 of the largest output, plus the LoRA's own bf16 products), and the adapter applied."""
    _, _, model, _ = policy(qwen2_dir)
    modules = qkv_modules(model)
    x = torch.randn(5, 7, modules[0].in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        y = PackedLinear.of(modules, PackCache(OneDnnPacks(torch.bfloat16)))(x)
        with model.disable_adapter():
            base_only = torch.cat(PackedLinear.of(modules, PackCache(OneDnnPacks(torch.bfloat16)))(x), dim=-1)
    assert all(t.dtype == torch.bfloat16 for t in y)
    ours, want = torch.cat(y, dim=-1).double(), naive_map(modules, x.float(), torch.bfloat16)
    scale = want.abs().max()
    assert (ours - want).abs().max() < 2 * 2**-8 * scale
    assert (base_only.double() - ours).abs().max() > 0.05 * scale


def test_the_float32_sampler_runs_from_the_packs_exactly_and_keeps_them(tiny_model_dir):
    """The default CPU engine samples a float32 model from oneDNN packs: its log-probs are the float32 trainer's up to
    float32 rounding (not the ~1e-3 of float16 weights), greedy picks what MKL's merged products pick, a second call
    packs nothing new, and the model's parameters stay untouched."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    before = {n: p.clone() for n, p in model.named_parameters()}
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    packs = engine.packs_for(model)
    assert isinstance(packs.format, OneDnnPacks) and packs.format.dtype == torch.float32
    rollout = engine.sample(model, prompts, 4, SamplingParams(max_new_tokens=10, temperature=1.0), seed=0)
    layers = len(model.get_base_model().model.layers)
    assert len(packs._entries) == 4 * layers + 1  # q/k/v, o, gate/up, down per layer; the output layer
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    assert (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs().max() < 1e-5
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    mkl = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, onednn=False)
    assert mkl.packs_for(model) is None
    want = mkl.sample(model, prompts, 2, greedy, seed=0)
    kept = dict(packs._entries)
    ours = engine.sample(model, prompts, 2, greedy, seed=0)
    assert [tokens_of(ours, r) for r in range(8)] == [tokens_of(want, r) for r in range(8)]
    assert all(packs._entries[k][2] is v[2] for k, v in kept.items()) and packs._entries.keys() == kept.keys()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_which_samplers_run_from_onednn_packs(tiny_model_dir, monkeypatch):
    """Packs where merged products would run on the CPU: not with merge=False (the trainer's adapter layers), not
    with float16 weights (fbgemm's packs), not for a float16 sampler, not with rollout.weight_packs=false, not for a
    sharded base."""
    from rlora.rollout import engine as engine_module

    tokenizer, tok, model, _ = policy(tiny_model_dir)
    args = (tokenizer, tok.eos_ids, tok.pad_id)
    assert BuiltinGenerator(*args, merge=False).packs_for(model) is None
    if packed_fp16_available():
        assert isinstance(BuiltinGenerator(*args, fp16_weights=True).packs_for(model).format, Fp16Packs)
    assert BuiltinGenerator(*args, dtype=torch.float16).packs_for(model) is None
    bf16 = BuiltinGenerator(*args, dtype=torch.bfloat16).packs_for(model)
    assert (bf16 is not None) == onednn_packs_available(torch.bfloat16)  # emulated bf16: MKL's merged products
    from_config = [build_generator(RolloutConfig(weight_packs=packs), model, *args, 100, 8) for packs in (True, False)]
    assert isinstance(from_config[0].packs_for(model).format, OneDnnPacks) and from_config[1].packs_for(model) is None
    monkeypatch.setattr(engine_module, "sharded_base", lambda m: object())
    assert BuiltinGenerator(*args).packs_for(model) is None


def test_several_policies_sample_from_the_packs_with_their_own_adapters(tiny_model_dir):
    """A model with 3 policy adapters, float32 packs: each row's log-probs are its own policy's (float32 trainer, to
    float32 rounding), far from another policy's."""
    engine, model, gaps = policies_gaps(tiny_model_dir)
    packs = engine.packs_for(model)
    layers = len(model.base_model.model.model.layers)
    assert isinstance(packs.format, OneDnnPacks) and len(packs._entries) == 4 * layers + 1  # the packs were used
    assert gaps[0].max() < 1e-5 and gaps[1].mean() > 1e-3


def test_a_changed_base_is_packed_again(tiny_model_dir):
    """A pack is used while its weight is unchanged: an in-place write (version counter), a new tensor behind the same
    parameter (`.data =`: new storage) and a dtype round trip each pack it again, and the map follows the new weight;
    clear() drops every pack."""
    _, _, model, _ = policy(tiny_model_dir)
    o_proj = model.get_base_model().model.layers[0].self_attn.o_proj
    base = o_proj.get_base_layer()
    cache = PackCache(OneDnnPacks(torch.float32))
    x = torch.randn(3, base.in_features, generator=torch.Generator().manual_seed(1))

    def mapped():
        with torch.no_grad():
            return PackedLinear.of([o_proj], cache)(x)[0]

    def want():
        with torch.no_grad(), model.disable_adapter():
            return o_proj(x)

    first = mapped()
    packed = cache._entries[next(iter(cache._entries))][2]
    assert mapped() is not None and cache._entries[next(iter(cache._entries))][2] is packed  # reused
    with torch.no_grad():
        base.weight.mul_(2.0)  # in place: the version counter moves
    with model.disable_adapter():
        assert torch.allclose(PackedLinear.of([base], cache)(x)[0], want(), rtol=1e-5, atol=1e-6)
    base.weight.data = base.weight.data * 0.5  # a new tensor behind the parameter: its storage moves
    with model.disable_adapter():
        assert torch.allclose(PackedLinear.of([base], cache)(x)[0], want(), rtol=1e-5, atol=1e-6)
    assert torch.allclose(mapped(), first, rtol=1e-5, atol=1e-6)  # back to the first weight (x2, then x0.5)
    assert len(cache._entries) == 1
    cache.clear()
    assert cache._entries == {}


def test_a_sampler_that_keeps_no_packs_samples_the_same(tiny_model_dir):
    """keep_packs=False (a run's evaluation sampler): packs made in each call and freed after it; the same tokens and
    log-probs as the sampler that keeps them (the same kernel on the same weights)."""
    tokenizer, tok, model, prompts = policy(tiny_model_dir)
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    kept, freed = (BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, keep_packs=keep) for keep in (True, False))
    a, b = (engine.sample(model, prompts, 3, params, seed=5) for engine in (kept, freed))
    assert torch.equal(a.completion_ids_BTc, b.completion_ids_BTc)
    assert torch.equal(a.sampling_logp_BTc, b.sampling_logp_BTc)
    layers = len(model.get_base_model().model.layers)
    assert len(kept.packs_for(model)._entries) == 4 * layers + 1 and freed.packs_for(model)._entries == {}
