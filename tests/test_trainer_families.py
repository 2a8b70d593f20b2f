"""The trainer's fast paths on the decoder families beyond Llama (tiny random Qwen3, Gemma 3 text, Phi-3, OLMo 2/3,
SmolLM3, GLM-4, ERNIE 4.5, Seed-OSS; Qwen2 and Mistral where prompts are shared): chunked log-probs equal the
model's own forward, the frozen prefix shared across log-prob passes (models/frozen_prefix.py) equals separate full
passes, sliding-window layers included, and shared prompts (models/shared_prompts.py) and packed groups
(models/packed_groups.py) equal passes that share nothing, on every family that shares them; windows and a rotary
scaling chosen by length keep what would differ from running."""

import json

import pytest
import torch
from test_frozen_prefix import logp_and_grads
from test_packed_attention import count_structured_calls
from test_policy_model import make_policy as make_float32_policy
from test_policy_model import perturb_adapter, sample, vary_lengths

from rlora.batching import trim
from rlora.models.adapters import reference_policy
from rlora.models.frozen_prefix import FrozenPrefix, first_adapter_layer, frozen_prefix, sharing_unsupported
from rlora.models.loading import causal_lm
from rlora.models.logprobs import completion_logprobs, supports_chunked
from rlora.models import packed_groups
from rlora.models.packed_groups import group_packing_unsupported, plan_packing, set_group_packing
from rlora.models import shared_prompts
from rlora.models.shared_prompts import prompt_groups, set_prompt_sharing
from rlora.models.tiny import build_random_model

# four layers, windows of 3 tokens where the family has them, so the per-layer masks must follow the layer
# types (Gemma 3 and OLMo 3 also pick their rotary embedding by layer type)
FOUR_LAYERS = {
    "qwen3": dict(family="qwen3", tie=False, use_sliding_window=True, sliding_window=3, max_window_layers=2),
    "gemma3_text": dict(family="gemma3_text", sliding_window=3,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": dict(family="phi3", tie=False, sliding_window=3),
    "olmo2": dict(family="olmo2", tie=False),
    "olmo3": dict(family="olmo3", tie=False, sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2),
    "smollm3": dict(family="smollm3", no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=3),
    "glm4": dict(family="glm4", tie=False),
    "ernie4_5": dict(family="ernie4_5"),
    "seed_oss": dict(family="seed_oss", tie=False),
    # mixtures of experts, the sparse and dense layers alternating where the family has both
    "mixtral": dict(family="mixtral", tie=False, sliding_window=3),
    "qwen2_moe": dict(family="qwen2_moe", tie=False, mlp_only_layers=[1, 3], use_sliding_window=True, sliding_window=3,
                      max_window_layers=2),
    "qwen3_moe": dict(family="qwen3_moe", tie=False, mlp_only_layers=[0, 2], use_sliding_window=True, sliding_window=3),
    "olmoe": dict(family="olmoe", tie=False),
}


MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def make_policy(model_dir, **lora):
    """test_policy_model.make_policy, its mixture-of-experts blocks on transformers' eager expert loop: the tests
    here run in float64, which the grouped kernel (the default) does not take."""
    tokenizer, tok, model = make_float32_policy(model_dir, **lora)
    causal_lm(model).config._experts_implementation = "eager"
    return tokenizer, tok, model


@pytest.fixture(scope="module")
def four_layer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("four_families")
    return {name: str(build_random_model(root / name, layers=4, seed=5, **kwargs))
            for name, kwargs in FOUR_LAYERS.items()}


def rollout_of(model, tokenizer, tok):
    rollout = vary_lengths(sample(model, tokenizer, tok, n_prompts=2, G=4, max_new=6, seed=4), tok.pad_id)
    rollout.temperature_B = torch.linspace(0.6, 1.4, 8)
    return rollout


@pytest.mark.parametrize("family", FOUR_LAYERS)
def test_chunked_logprobs_equal_the_models_forward(four_layer_dirs, family):
    tokenizer, tok, model = make_policy(four_layer_dirs[family])
    perturb_adapter(model, scale=0.3)
    assert supports_chunked(model)
    batch = rollout_of(model, tokenizer, tok).select(slice(None))
    model.to(torch.float64).eval()
    with torch.no_grad():
        chunked, chunked_entropy = completion_logprobs(model, batch, with_entropy=True, chunk_tokens=5)
        full, full_entropy = completion_logprobs(model, batch, with_entropy=True, chunk_tokens=0)
    mask = batch.completion_mask_BTc.bool()
    assert (chunked[mask] - full[mask]).abs().max() < 1e-12
    assert (chunked_entropy[mask] - full_entropy[mask]).abs().max() < 1e-12
    if family == "gemma3_text":  # soft-capped logits are not the output layer's: the full forward applies the cap
        model.config.final_logit_softcapping = 3.0
        assert not supports_chunked(model)


@pytest.mark.parametrize("family", FOUR_LAYERS)
def test_shared_prefix_equals_separate_full_passes(four_layer_dirs, family):
    """float64 (float32 rounds a differently padded batch apart by a few ulps: tests/test_frozen_prefix.py)."""
    # a mixture's experts take their LoRA on every sparse layer (loading.check_layers_kept): the attention maps here
    targets = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if family in MIXTURES else {}
    tokenizer, tok, model = make_policy(four_layer_dirs[family], layers=[2, 3], **targets)
    perturb_adapter(model, scale=0.3)
    assert first_adapter_layer(model) == 2 and sharing_unsupported(model) is None
    set_prompt_sharing(model, False)  # the reference: separate rows (shared prompts are compared in the tests below)
    rollout = rollout_of(model, tokenizer, tok)
    model.to(torch.float64)
    prefix = FrozenPrefix(model, rollout, 2, micro_batch_size=3)  # computed in other micro-batches than used
    index = torch.tensor([1, 3, 4, 6])
    micro = trim(rollout.select(index))
    mask = micro.completion_mask_BTc.bool()
    weights = torch.randn(micro.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    full_logp, full_grads = logp_and_grads(model, micro, weights)
    shared_logp, shared_grads = logp_and_grads(model, micro, weights, prefix.rows(index, micro))
    assert (shared_logp[mask] - full_logp[mask]).abs().max() <= 1e-12
    assert torch.allclose(shared_grads, full_grads, atol=1e-12, rtol=0), (shared_grads - full_grads).abs().max()
    with torch.no_grad(), reference_policy(model):
        ref_full, _ = completion_logprobs(model, micro)
        ref_shared, _ = completion_logprobs(model, micro, prefix=prefix.rows(index, micro))
    assert (ref_shared[mask] - ref_full[mask]).abs().max() <= 1e-12
    assert (ref_full[mask] - full_logp[mask]).abs().max() > 1e-3  # the adapter matters above the prefix


def test_sharing_says_why_it_is_off(four_layer_dirs):
    _, _, model = make_policy(four_layer_dirs["phi3"], layers=[3])
    model.config.resid_pdrop = 0.1
    assert sharing_unsupported(model) == "resid_pdrop=0.1 makes the lower layers random in training"
    _, _, model = make_policy(four_layer_dirs["seed_oss"], layers=[3])
    assert sharing_unsupported(model) is None
    model.config.residual_dropout = 0.1
    assert sharing_unsupported(model) == "residual_dropout=0.1 makes the lower layers random in training"


# every family whose prompts are shared, without sliding windows (Mistral's and Phi-3's configs without one)
SHARED = {family: {"sliding_window": None} if family in ("mistral", "phi3") else {}
          for family in shared_prompts.SHAREABLE_MODEL_TYPES}


@pytest.fixture(scope="module")
def shared_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared_families")
    return {name: str(build_random_model(root / name, family=name, layers=2, seed=6, tie=name != "glm4", **kwargs))
            for name, kwargs in SHARED.items()}


@pytest.mark.parametrize("path", ["cache", "packed"])
@pytest.mark.parametrize("family", SHARED)
def test_shared_and_packed_passes_equal_unshared_ones_on_every_shared_family(shared_dirs, family, path, monkeypatch):
    """Prompts shared through a key/value cache (models/shared_prompts.py) or packed with the rows' completions
    (models/packed_groups.py, attention by the layout's structure) against rows that share nothing, float64:
    log-probs to 1e-12, gradients to float32's resolution relative to the largest (transformers' RMSNorms compute
    in float32 even in a float64 model, and their backward rounds differently where a token sits in another shape;
    as tests/test_packed_groups.py allows on Llama). The pass compared is the one named: the decoder runs twice
    (prompts, then completions) for the cache, once through the structured attention for the packed pass."""
    calls = count_structured_calls(monkeypatch)
    tokenizer, tok, model = make_policy(shared_dirs[family])
    perturb_adapter(model, scale=0.3)
    batch = trim(rollout_of(model, tokenizer, tok))
    model.to(torch.float64)
    hf = causal_lm(model)
    assert shared_prompts.sharing_prompts_unsupported(model) is None
    set_group_packing(model, path == "packed")
    assert (plan_packing(model, batch, prompt_groups(batch)) is not None) == (path == "packed")
    mask = batch.completion_mask_BTc.bool()
    weights = torch.randn(batch.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    decoder_calls = []
    handle = hf.get_decoder().register_forward_hook(lambda *args: decoder_calls.append(1))
    shared_logp, shared_grads = logp_and_grads(model, batch, weights)
    handle.remove()
    layers = len(hf.get_decoder().layers)
    assert (len(decoder_calls), len(calls)) == ((2, 0) if path == "cache" else (1, layers))
    set_prompt_sharing(model, False)
    unshared_logp, unshared_grads = logp_and_grads(model, batch, weights)
    assert (shared_logp[mask] - unshared_logp[mask]).abs().max() <= 1e-12
    scale = float(unshared_grads.abs().max())
    assert torch.allclose(shared_grads, unshared_grads, atol=2e-6 * scale, rtol=0), \
        ((shared_grads - unshared_grads).abs().max(), scale)


def test_a_window_longer_than_the_positions_shares_and_packs(tmp_path):
    """Phi-3.5/4-mini set a window (262144) longer than their positions (131072): it never applies, so prompts are
    shared and packed, although the attention modules still pass it on; here a window of 4096 on 2048 positions.
    Both passes equal separate rows (float64 log-probs)."""
    tokenizer, tok, model = make_policy(str(build_random_model(tmp_path / "phi3", family="phi3", sliding_window=4096)))
    perturb_adapter(model, scale=0.3)
    batch = trim(rollout_of(model, tokenizer, tok))
    model.to(torch.float64)
    assert shared_prompts.sharing_prompts_unsupported(model) is None and group_packing_unsupported(model, batch) is None
    mask = batch.completion_mask_BTc.bool()
    weights = torch.ones(batch.completion_ids_BTc.shape, dtype=torch.float64)
    packed, _ = logp_and_grads(model, batch, weights)
    set_group_packing(model, False)
    cache, _ = logp_and_grads(model, batch, weights)
    set_prompt_sharing(model, False)
    unshared, _ = logp_and_grads(model, batch, weights)
    assert (packed[mask] - unshared[mask]).abs().max() <= 1e-12 and (cache[mask] - unshared[mask]).abs().max() <= 1e-12


def _longrope_phi3(folder):
    """A Phi-3 with LongRoPE switching to its long factors past 8 positions (of 64)."""
    k = 4  # Phi-3's tiny model: head_dim 16, half of it rotated, in pairs
    folder = build_random_model(folder, family="phi3", layers=4, sliding_window=None, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "short_factor": [1.0] * k,
        "long_factor": [8.0, 16.0, 32.0, 64.0], "original_max_position_embeddings": 8})
    config = json.loads((folder / "config.json").read_text())
    # Phi-3 reads the switch point from the config's top level
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64,
                                                    "original_max_position_embeddings": 8}))
    return folder


def test_a_rope_chosen_by_length_shares_the_frozen_prefix_only_below_its_switch(tmp_path):
    """LongRoPE picks its frequencies from each call's longest position. The frozen prefix runs the rollout in its
    own micro-batches: where short rows were prefixed beside long ones (long factors) but a pass runs them alone
    (short factors), the prefix is not the full pass's, so a rollout that reaches the switch point gets no prefix;
    below it every call uses the original frequencies and the prefix equals full passes (float64, 1e-12)."""
    tokenizer, tok, model = make_policy(str(_longrope_phi3(tmp_path / "phi3")), layers=[2, 3])
    perturb_adapter(model, scale=0.3)
    assert first_adapter_layer(model) == 2 and sharing_unsupported(model) is None
    set_prompt_sharing(model, False)
    rollout = rollout_of(model, tokenizer, tok)
    model.to(torch.float64)
    lengths = (rollout.prompt_mask_BTp.sum(-1) + rollout.completion_mask_BTc.sum(-1)).tolist()
    short = torch.tensor([i for i, n in enumerate(lengths) if n <= 8])
    assert 0 < len(short) < len(lengths)  # rows on both sides of the switch
    micro = trim(rollout.select(short))
    mask = micro.completion_mask_BTc.bool()
    weights = torch.ones(micro.completion_ids_BTc.shape, dtype=torch.float64)
    full, _ = logp_and_grads(model, micro, weights)
    assert frozen_prefix(model, rollout, 2, micro_batch_size=3) is None
    mixed = FrozenPrefix(model, rollout, 2, micro_batch_size=3)  # what it would have given: 0.01 off
    assert (logp_and_grads(model, micro, weights, mixed.rows(short, micro))[0][mask] - full[mask]).abs().max() > 1e-3
    rope = causal_lm(model).config.rope_parameters
    rope["original_max_position_embeddings"] = causal_lm(model).config.original_max_position_embeddings = 64
    full, _ = logp_and_grads(model, micro, weights)  # every call now below the switch
    prefix = frozen_prefix(model, rollout, 2, micro_batch_size=3)
    assert prefix is not None
    assert (logp_and_grads(model, micro, weights, prefix.rows(short, micro))[0][mask] - full[mask]).abs().max() <= 1e-12


def test_a_rope_chosen_by_length_packs_but_runs_no_cache_pass(tmp_path, monkeypatch):
    """Phi-3's LongRoPE picks its long or short frequencies from each decoder call's longest position: prompts of at
    most 6 tokens fit the 8 positions of the short factors, prompt and completion together do not. The cache pass
    (prompts alone, then completions on their keys) would rotate the prompts' keys with the short factors and the
    rest with the long ones, so it does not run; the packed pass, one call as separate rows make, equals them."""
    tokenizer, tok, model = make_policy(str(_longrope_phi3(tmp_path / "phi3")))
    perturb_adapter(model, scale=0.3)
    batch = trim(rollout_of(model, tokenizer, tok))
    model.to(torch.float64)
    lengths = (batch.prompt_mask_BTp.sum(-1) + batch.completion_mask_BTc.sum(-1)).tolist()
    assert batch.prompt_ids_BTp.shape[1] <= 8 < max(lengths)  # the case where the calls' frequencies differ
    assert shared_prompts.sharing_prompts_unsupported(model) is None
    assert shared_prompts.prompt_cache_unsupported(model) == "rope_type 'longrope' (frequencies chosen by each " \
                                                             "call's length)"
    mask = batch.completion_mask_BTc.bool()
    weights = torch.ones(batch.completion_ids_BTc.shape, dtype=torch.float64)
    packed, _ = logp_and_grads(model, batch, weights)
    set_group_packing(model, False)  # what would run next: the cache pass is not allowed, so rows run unshared
    assert plan_packing(model, batch, prompt_groups(batch)) is None
    fallback, _ = logp_and_grads(model, batch, weights)
    monkeypatch.setattr(shared_prompts, "length_dependent_rope", lambda config: None)
    cache, _ = logp_and_grads(model, batch, weights)  # what the cache pass would have given
    set_prompt_sharing(model, False)
    unshared, _ = logp_and_grads(model, batch, weights)
    assert (packed[mask] - unshared[mask]).abs().max() <= 1e-12
    assert torch.equal(fallback[mask], unshared[mask])
    assert (cache[mask] - unshared[mask]).abs().max() > 1e-3  # seen 0.079


WINDOWED = ("mistral", "qwen3", "gemma3_text", "olmo3", "smollm3", "phi3")  # FOUR_LAYERS' windows, Mistral's config


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("mistral") / "m", family="mistral", layers=4, seed=5,
                                  sliding_window=3))


@pytest.mark.parametrize("recomputed", [False, True], ids=["structured", "dense"])
@pytest.mark.parametrize("family", WINDOWED)
def test_sliding_windows_share_prompts_and_pack_rows_that_fit(four_layer_dirs, mistral_dir, family, recomputed,
                                                              monkeypatch):
    """A window of W lets a token see the keys fewer than W positions before it. Rows that reach it (a window of 3
    over rows of ~10 positions, on every layer or on the sliding layers of the family's layer types) still share
    their prompts: the cache pass runs the model's own attention, window and all, and equals separate rows. A packed
    pass attends without a window, so it runs only where the micro-batch's padded rows fit the window (W = Tp + Tc),
    and there it equals separate rows too, attending by structure or with the dense mask of a pass under gradient
    checkpointing (whose packed sequences are longer than W)."""
    assert family in shared_prompts.SHAREABLE_MODEL_TYPES
    monkeypatch.setattr(packed_groups, "recomputes_forward", lambda model: recomputed)
    tokenizer, tok, model = make_policy(mistral_dir if family == "mistral" else four_layer_dirs[family])
    perturb_adapter(model, scale=0.3)
    batch = trim(rollout_of(model, tokenizer, tok))
    model.to(torch.float64)
    hf = causal_lm(model)
    positions = batch.prompt_ids_BTp.shape[1] + batch.completion_ids_BTc.shape[1]
    mask = batch.completion_mask_BTc.bool()
    weights = torch.randn(batch.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    decoder_calls = []
    hf.get_decoder().register_forward_hook(lambda *args: decoder_calls.append(1))
    for window in (3, positions - 1, positions):  # the last fits the padded rows exactly
        _set_window(hf, window)
        set_prompt_sharing(model, True)
        assert shared_prompts.sharing_prompts_unsupported(model) is None
        reached = window < positions
        assert group_packing_unsupported(model, batch) == (
            f"a sliding window of {window} positions over rows of {positions}" if reached else None)
        planned = plan_packing(model, batch, prompt_groups(batch))
        assert (planned is None) == reached
        if planned is not None:
            assert planned.structured != recomputed and planned.num_positions > window
        decoder_calls.clear()
        shared_logp, shared_grads = logp_and_grads(model, batch, weights)
        assert len(decoder_calls) == (2 if reached else 1)  # the cache pass, or the packed one
        set_prompt_sharing(model, False)
        unshared_logp, unshared_grads = logp_and_grads(model, batch, weights)
        assert (shared_logp[mask] - unshared_logp[mask]).abs().max() <= 1e-12
        scale = float(unshared_grads.abs().max())
        assert torch.allclose(shared_grads, unshared_grads, atol=2e-6 * scale, rtol=0)
    _set_window(hf, 3)
    set_prompt_sharing(model, False)
    cut, _ = logp_and_grads(model, batch, weights)
    assert (cut[mask] - unshared_logp[mask]).abs().max() > 1e-3  # the window of 3 did cut what the rows saw


def test_bidirectional_attention_shares_nothing(four_layer_dirs):
    """A Gemma 3 with bidirectional attention (EmbeddingGemma's configs) lets a prompt token see the completions in
    the model's own pass: neither the cache pass nor a packed one can, so its rows run unshared."""
    tokenizer, tok, model = make_policy(four_layer_dirs["gemma3_text"])
    assert shared_prompts.sharing_prompts_unsupported(model) is None
    causal_lm(model).config.use_bidirectional_attention = True
    assert shared_prompts.sharing_prompts_unsupported(model) == "bidirectional attention"


def test_soft_capped_attention_shares_prompts_but_does_not_pack(tmp_path):
    """Attention logit soft-capping (Gemma 2's; a Gemma 3 config may set it): the cache pass runs the model's own
    attention and equals separate rows; the packed attention has no cap, so it does not run."""
    folder = build_random_model(tmp_path / "gemma", family="gemma3_text", attn_logit_softcapping=5.0)
    tokenizer, tok, model = make_policy(str(folder))
    perturb_adapter(model, scale=0.3)
    batch = trim(rollout_of(model, tokenizer, tok))
    model.to(torch.float64)
    assert group_packing_unsupported(model, batch) == "attention logit soft-capping"
    assert plan_packing(model, batch, prompt_groups(batch)) is None
    mask = batch.completion_mask_BTc.bool()
    weights = torch.ones(batch.completion_ids_BTc.shape, dtype=torch.float64)
    cache, _ = logp_and_grads(model, batch, weights)
    set_prompt_sharing(model, False)
    unshared, _ = logp_and_grads(model, batch, weights)
    assert (cache[mask] - unshared[mask]).abs().max() <= 1e-12


def _set_window(hf, window):
    """The window in the config (masks, caches) and in the attention modules that copied it when built (Qwen3's
    sliding layers)."""
    hf.config.sliding_window = window
    for module in hf.modules():
        if module is not hf and getattr(module, "sliding_window", None) is not None:
            module.sliding_window = window


def test_the_attention_window_by_config():
    """The shortest window any layer applies: layer types, or a window without them unless longer than the model's
    positions or turned off; a layer of another kind (Llama 4's chunked attention) keeps every micro-batch unpacked."""
    class Config:
        def __init__(self, **keys):
            self.__dict__.update({"max_position_embeddings": 2048, **keys})

    assert packed_groups.attention_window(Config(sliding_window=None)) is None
    assert packed_groups.attention_window(Config(sliding_window=4096)) is None  # Phi-3.5's longer than the positions
    assert packed_groups.attention_window(Config(sliding_window=2047)) == 2047  # Phi-3-mini-4k
    assert packed_groups.attention_window(Config(sliding_window=4096, max_position_embeddings=32768)) == 4096
    assert packed_groups.attention_window(Config(sliding_window=64, use_sliding_window=False)) is None  # Qwen2
    assert packed_groups.attention_window(Config(sliding_window=512,
                                                 layer_types=["sliding_attention", "full_attention"])) == 512
    assert packed_groups.attention_window(Config(sliding_window=512, layer_types=["full_attention"] * 2)) is None
    assert packed_groups.attention_window(Config(sliding_window=4096,  # a window no sequence of the model reaches
                                                 layer_types=["sliding_attention", "full_attention"])) is None
    assert packed_groups.attention_window(Config(sliding_window=None,
                                                 layer_types=["chunked_attention", "full_attention"])) == 0


def test_rlora_train_and_merge_run_a_mixture_of_experts_on_the_builtin_sampler(tmp_path, prompts_file, capsys):
    """A tiny Qwen3-MoE end to end: sampled by the built-in engine (no fallback notice) in float32, where its
    log-probs are the trainer's; peft's LoRA on the experts trains; `rlora merge` folds it into the base."""
    from conftest import tiny_overrides
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlora.cli import main

    folder = build_random_model(tmp_path / "moe", family="qwen3_moe", tie=False, seed=3)
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(str(folder), prompts_file, str(out), **{
        "algo.beta": 0.04, "algo.num_iterations": 2, "eval.before": "false", "eval.after": "false",
        "rollout.sampler_dtype": "model"})]) == 0
    printed = capsys.readouterr()
    assert "does not support this model" not in printed.out + printed.err
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(row["sampler_logp_gap"] < 1e-5 for row in metrics), metrics
    tensors = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    experts_B = [t for name, t in tensors.items() if ".experts." in name and "lora_B" in name]
    assert experts_B and all(t.abs().max() > 0 for t in experts_B)  # B starts at 0: the update moved it
    assert main(["merge", str(out / "adapter"), "-o", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), out / "adapter").eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        base = AutoModelForCausalLM.from_pretrained(folder).eval()
        want = adapted(ids).logits
        assert (merged(ids).logits - want).abs().max() < 1e-5
        assert (base(ids).logits - want).abs().max() > 1e-3
