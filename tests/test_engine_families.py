"""The built-in sampler on the decoder families beyond Llama/Qwen2/Mistral (rollout/layouts.py): tiny random
Qwen3, Gemma 3 text, Phi-3, OLMo 2, OLMo 3 and SmolLM3 models (models/tiny.py switches on what sets each apart)
against transformers' own implementation: greedy decoding against `generate` token for token, sampling
log-probs against the trainer's, several policies against each alone, and what the sampler refuses."""

import pytest
import torch
from test_engine import TEXTS, assert_greedy_matches_generate, policy
from test_policies import policies_model, single_model
from transformers import AutoModelForCausalLM, GPT2Config, Phi3Config

from rlora.models.loading import causal_lm, load_tokenizer
from rlora.models.logprobs import completion_logprobs
from rlora.models.tiny import build_random_model
from rlora.rollout.decoder import unsupported_reason
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.layouts import layout_refusal
from rlora.types import SamplingParams

MODELS = {
    "qwen3": dict(family="qwen3", tie=False),
    # Gemma 3 with its final logit soft-capping on (off in the released models, which the others cover)
    "gemma3_text": dict(family="gemma3_text", final_logit_softcapping=3.0),
    "phi3": dict(family="phi3", tie=False),
    "olmo2": dict(family="olmo2", tie=False),
    "olmo3": dict(family="olmo3", tie=False),
    "smollm3": dict(family="smollm3"),
    "glm4": dict(family="glm4", tie=False),
    "ernie4_5": dict(family="ernie4_5"),
    "seed_oss": dict(family="seed_oss", tie=False),
    # mixtures of experts (models/tiny.py: 4 experts, 2 a token; Qwen2/3-MoE with a dense layer beside the sparse one)
    "mixtral": dict(family="mixtral", tie=False),
    "qwen2_moe": dict(family="qwen2_moe", tie=False),
    "qwen3_moe": dict(family="qwen3_moe", tie=False),
    "olmoe": dict(family="olmoe", tie=False),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: str(build_random_model(root / name, seed=3, **kwargs)) for name, kwargs in MODELS.items()}


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("merge, decode", [(True, "eager"), (False, "eager"), (True, "static"), (False, "static")])
def test_greedy_matches_hf_generate_token_for_token(family_dirs, family, merge, decode):
    assert_greedy_matches_generate(family_dirs[family], merge, decode, family)


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("merge", [True, False])
def test_sampling_logprobs_agree_with_the_trainer(family_dirs, family, merge):
    tokenizer, tok, model, prompts = policy(family_dirs[family])
    per_prompt = [SamplingParams(max_new_tokens=n, temperature=t, top_p=0.9, min_new_tokens=n) for n, t in
                  [(12, 0.7), (5, 1.0), (9, 1.3), (12, 0.7)]]
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=merge)
    rollout = engine.sample(model, prompts, 3, per_prompt, seed=7)
    model.eval()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
    mask = rollout.completion_mask_BTc.bool()
    gap = (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs()
    assert gap.max() < 1e-4, (family, gap.mean(), gap.max())
    with torch.no_grad(), model.disable_adapter():
        base, _ = completion_logprobs(model, rollout.select(slice(None)))
    assert (base[mask] - trainer[mask]).abs().max() > 1e-2  # the adapter moves these log-probs


def test_fused_projections_sample_each_policy_as_alone(family_dirs, tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj carry one LoRA each: with several policies, every row's own
    adapter applies to the fused output before it is split, as a one-policy model computes it."""
    model_dir = family_dirs["phi3"]
    tokenizer, tok = load_tokenizer(model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    model = policies_model(model_dir, names=["a", "b"])
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    P, G = len(prompts), 2
    together = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode="static").sample(
        model, prompts * 2, G, params, [100] * P + [101] * P, keys=list(range(P)) * 2, policies=[0] * P + [1] * P)
    for k, name in enumerate(["a", "b"]):
        alone = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, merge=False).sample(
            single_model(model_dir, model, name, tmp_path / name), prompts, G, params, 100 + k)
        rows = slice(k * P * G, (k + 1) * P * G)
        assert together.completions[rows] == alone.completions
        width = alone.sampling_logp_BTc.shape[1]
        assert torch.allclose(together.sampling_logp_BTc[rows, :width], alone.sampling_logp_BTc, rtol=0, atol=1e-5)
    assert together.completions[:P * G] != together.completions[P * G:]


def test_the_families_are_supported_within_their_limits(family_dirs):
    for family, model_dir in family_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        assert unsupported_reason(model, max_length=512) is None, family
        assert unsupported_reason(model, max_length=None) is None, family  # sliding windows too (below)


# windows of 4 tokens, shorter than the prompts (1-12 tokens) and completions (16): on every layer (Mistral's and
# Phi-3's configs), or on the sliding layers of the layer types (Qwen3's first layer is full: max_window_layers)
WINDOWED = {
    "mistral": dict(family="mistral", tie=False, sliding_window=4),
    "phi3": dict(family="phi3", tie=False, sliding_window=4),
    "qwen3": dict(family="qwen3", tie=False, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "gemma3_text": dict(family="gemma3_text", sliding_window=4),
    "olmo3": dict(family="olmo3", tie=False, sliding_window=4),
}


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("windowed")
    return {name: str(build_random_model(root / name, seed=3, **kwargs)) for name, kwargs in WINDOWED.items()}


def _widen_windows(model, window):
    """The model's windows set to `window` (config, and the attention modules that copied it when built)."""
    hf = causal_lm(model)
    hf.config.sliding_window = window
    for module in hf.modules():
        if module is not hf and getattr(module, "sliding_window", None) is not None:
            module.sliding_window = window


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize("merge, decode", [(True, "eager"), (False, "static")])
def test_sliding_windows_greedy_matches_hf_generate(windowed_dirs, family, merge, decode):
    """Rows longer than the window: transformers' generate applies it through its masks and sliding caches; the
    sampler through the masks of its prefill and of each decode step."""
    assert_greedy_matches_generate(windowed_dirs[family], merge, decode, family)


@pytest.mark.parametrize("family", WINDOWED)
@pytest.mark.parametrize("decode, max_rows", [("eager", None), ("static", None), ("eager", 2), ("static", 2)])
def test_sliding_windows_sampling_logprobs_agree_with_the_trainer(windowed_dirs, family, decode, max_rows):
    """The sampler's log-probs against the trainer's one forward (transformers' window masks) to 1e-4, all prompts
    admitted at once or one slot taking each prompt in turn (max_rows=2: a slot's prompt keys replaced); with the
    windows widened, the trainer's log-probs move by more than 1e-2, so the windows were in play."""
    tokenizer, tok, model, prompts = policy(windowed_dirs[family])
    per_prompt = [SamplingParams(max_new_tokens=n, temperature=t, min_new_tokens=n) for n, t in
                  [(16, 0.7), (5, 1.0), (9, 1.3), (16, 0.7)]]
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode=decode, max_rows=max_rows)
    rollout = engine.sample(model, prompts, 2, per_prompt, seed=7)
    model.eval()
    mask = rollout.completion_mask_BTc.bool()
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, rollout.select(slice(None)))
        gap = (trainer[mask] - rollout.sampling_logp_BTc[mask]).abs()
        assert gap.max() < 1e-4, (family, gap.mean(), gap.max())
        _widen_windows(model, 1000)
        unwindowed, _ = completion_logprobs(model, rollout.select(slice(None)))
    assert (unwindowed[mask] - trainer[mask]).abs().max() > 1e-2


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_a_continued_row_sees_its_window_by_position(windowed_dirs, decode):
    """Multi-turn: a second turn continues each row's cache, whose history and new tokens are admitted with padding
    between them. The window counts positions, not cache slots: each second-turn token's sampling log-prob equals the
    trainer's on the whole sequence (prompt, first completion but its last token, turn, second completion) run alone."""
    tokenizer, tok, model, prompts = policy(windowed_dirs["mistral"])
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id, decode=decode)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, min_new_tokens=6)
    first, caches = engine.sample_continued(model, prompts, 1, params, seed=1)
    turns = [list(range(10, 10 + 2 * (4 - i))) for i in range(len(prompts))]  # ragged: padding in the cache
    second, _ = engine.sample_continued(model, turns, 1, params, seed=2, past=caches)
    model.eval()
    for i, prompt in enumerate(prompts):
        history = prompt + first.completion_ids_BTc[i, :5].tolist() + turns[i]
        completion = second.completion_ids_BTc[i, :6]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([history + completion.tolist()])).logits[0].float()
        logp = logits[len(history) - 1:-1].log_softmax(-1).gather(-1, completion[:, None])[:, 0]
        assert (logp - second.sampling_logp_BTc[i, :6]).abs().max() < 1e-4, i


def test_what_the_sampler_cannot_run_gets_a_reason(family_dirs):
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert unsupported_reason(gpt2, max_length=64).startswith("model type 'gpt2' (built-in sampler supports llama,")
    gemma = AutoModelForCausalLM.from_pretrained(family_dirs["gemma3_text"])
    for key, value, reason in [("attn_logit_softcapping", 50.0, "attention logit soft-capping"),
                               ("use_bidirectional_attention", True, "bidirectional attention")]:
        setattr(gemma.config, key, value)
        assert unsupported_reason(gemma, max_length=64) == reason
        setattr(gemma.config, key, None if key == "attn_logit_softcapping" else False)
    assert unsupported_reason(gemma, max_length=64) is None
    # Phi-3.5/Phi-4-mini's longrope switches to its long factors past the original 4096 positions
    factors = [1.0] * 8
    longrope = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=factors, long_factor=factors,
        original_max_position_embeddings=4096))
    assert layout_refusal("phi3", longrope, 4096) is None
    assert layout_refusal("phi3", longrope, 4097) == "longrope rotary embeddings beyond 4096 positions"

