"""LoRA invariants, micro-batching invariance and the PEFT adapter format, on a tiny random Llama."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from rlora.algos.advantages import per_token
from rlora.algos.registry import get_algorithm
from rlora.config import AlgoConfig, LoraConfig, ModelConfig, TrainConfig
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer, save_adapter, trainable_parameters
from rlora.models.adapters import reference_policy
from rlora.models.logprobs import completion_logprobs
from rlora.rollout.generator import HFGenerator
from rlora.train.optim import build_optimizer
from rlora.train.optim import optimizer_step
from rlora.train.update import ScoredRollout, accumulate_policy_gradient, batched_logprobs
from rlora.types import SamplingParams


def make_policy(model_dir, **lora):
    tokenizer, tok = load_tokenizer(model_dir)
    model = attach_lora(load_base_model(ModelConfig(path=model_dir), model_dir), LoraConfig(rank=4, alpha=8, **lora))
    return tokenizer, tok, model


def sample(model, tokenizer, tok, n_prompts=2, G=4, max_new=6, seed=0):
    prompts = [tokenizer(f"What is {i} + {i}?")["input_ids"] for i in range(1, n_prompts + 1)]
    prompts[0] = prompts[0][:3]  # different prompt lengths exercise the left padding
    gen = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    return gen.sample(model, prompts, G, SamplingParams(max_new_tokens=max_new, temperature=1.0), seed=seed)


def vary_lengths(rollout, pad_id, lengths=(6, 2, 5, 1, 6, 3, 4, 6)):
    """A random tiny model rarely samples EOS; cut completions as if it had, to get ragged lengths."""
    for row, length in enumerate(lengths):
        rollout.completion_mask_BTc[row, length:] = 0
        rollout.completion_ids_BTc[row, length:] = pad_id
    return rollout


def perturb_adapter(model, scale=0.05, seed=1):
    """Give lora_B non-zero values (it starts at zero) so the adapter changes the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_before_first_update_ratio_is_one_and_kl_is_zero(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    rollout = sample(model, tokenizer, tok)
    policy = batched_logprobs(model, rollout, 8)
    with reference_policy(model):
        reference = batched_logprobs(model, rollout, 8)
    mask = rollout.completion_mask_BTc.bool()
    # lora_B starts at zero: the policy is the reference, exactly
    assert torch.equal(policy[mask], reference[mask])
    # old log-probs from a different micro-batching (3 rows at a time): the num_iterations > 1 path
    old = batched_logprobs(model, rollout, 3)
    scored = ScoredRollout(rollout, per_token(torch.linspace(-1, 1, 8), rollout.completion_mask_BTc),
                           rollout.completion_mask_BTc, old, reference)
    stats = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(beta=0.04), scored, 8, 6)
    assert stats["kl"] == 0.0 and stats["clip_frac"] == 0.0
    assert abs(stats["ratio_mean"] - 1.0) < 1e-6


def test_update_moves_adapter_and_keeps_base_bit_identical(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapter_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    rollout = sample(model, tokenizer, tok)
    scored = ScoredRollout(rollout, per_token(torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), rollout.completion_mask_BTc),
                           rollout.completion_mask_BTc)
    params = trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, TrainConfig(lr=1e-2), total_updates=3)
    for _ in range(3):
        stats = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(), scored, 4, 6)
        optimizer_step(params, optimizer, scheduler, 1.0, stats["loss"])
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        assert torch.equal(p, base_before[name]), name
    moved = [n for n, p in model.named_parameters() if "lora_" in n and not torch.equal(p, adapter_before[n])]
    assert len(moved) == len(adapter_before)
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)


def gradient_of(model, scored, micro_batch_size, loss_agg, beta=0.0):
    model.zero_grad(set_to_none=True)
    accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(loss_agg=loss_agg, beta=beta), scored,
                               micro_batch_size, constant_len=6)
    return torch.cat([p.grad.flatten() for p in trainable_parameters(model)])


def test_micro_batching_does_not_change_the_gradient(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=3), tok.pad_id)
    with reference_policy(model):
        ref = batched_logprobs(model, rollout, 8)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, 0.0, -0.3, 0.2])
    old = batched_logprobs(model, rollout, 8) + 0.05 * torch.randn_like(ref)  # ratio != 1: clipping in play
    for agg in ("token_mean", "seq_mean", "constant"):
        scored = ScoredRollout(rollout, per_token(advantages, rollout.completion_mask_BTc), rollout.completion_mask_BTc,
                               old, ref)
        one_of_eight = gradient_of(model, scored, 8, agg, beta=0.04)
        eight_of_one = gradient_of(model, scored, 1, agg, beta=0.04)
        assert one_of_eight.abs().max() > 0
        # float32 sums over other padded shapes: rounding is relative to the largest terms summed, so the
        # absolute tolerance scales with the gradient (1e-5 of its largest entry, ~100 ulps of it)
        scale = float(one_of_eight.abs().max())
        assert torch.allclose(one_of_eight, eight_of_one, rtol=1e-5, atol=1e-5 * scale), agg


def test_skipping_zero_advantage_rows_gives_the_same_gradient(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=4), tok.pad_id)
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.5, -0.5])  # group 0 has zero variance
    scored = ScoredRollout(rollout, per_token(advantages, rollout.completion_mask_BTc), rollout.completion_mask_BTc)
    skipping = gradient_of(model, scored, 4, "token_mean")
    # the same loss written without the skip: an explicit forward over all 8 rows
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, rollout.select(slice(0, 8)))
    mask = rollout.completion_mask_BTc.float()
    loss = -(torch.exp(logp - logp.detach()) * advantages[:, None] * mask).sum() / mask.sum()
    loss.backward()
    full = torch.cat([p.grad.flatten() for p in trainable_parameters(model)])
    assert torch.allclose(skipping, full, rtol=1e-5, atol=1e-5 * float(full.abs().max()))  # as above


def test_non_finite_loss_skips_the_update(tiny_model_dir):
    _, _, model = make_policy(tiny_model_dir)
    params = trainable_parameters(model)
    before = [p.detach().clone() for p in params]
    optimizer, scheduler = build_optimizer(params, TrainConfig(lr=1e-2), total_updates=2)
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    out = optimizer_step(params, optimizer, scheduler, 1.0, float("nan"))
    assert out["skipped_update"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, params))


def test_saved_adapter_loads_in_peft_with_identical_logits(tiny_model_dir, tmp_path):
    tokenizer, tok, model = make_policy(tiny_model_dir, target_modules="all-linear")
    perturb_adapter(model)
    save_adapter(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
    ids = torch.tensor([tokenizer("What is 2 + 2? The answer")["input_ids"]])
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        theirs = loaded(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    with torch.no_grad(), loaded.disable_adapter():
        plain = loaded(input_ids=ids).logits
    assert not torch.allclose(ours, plain), "the adapter must change the outputs"


def test_lora_layers_and_rslora_options(tiny_model_dir):
    _, _, model = make_policy(tiny_model_dir, layers=[1], use_rslora=True, target_modules=["q_proj", "v_proj"])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".layers.1." in n and ("q_proj" in n or "v_proj" in n) for n in names)
    assert model.peft_config["default"].use_rslora


@pytest.mark.parametrize("chunk_tokens", [0, 5])
def test_logprobs_divide_by_the_sampling_temperature(tiny_model_dir, chunk_tokens):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=5), tok.pad_id)
    micro = rollout.select(slice(0, 8))
    micro.temperature_B = torch.tensor([2.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.5, 0.5])
    with torch.no_grad():
        logp, entropy = completion_logprobs(model, micro, with_entropy=True, chunk_tokens=chunk_tokens)
        ids = torch.cat([micro.prompt_ids_BTp, micro.completion_ids_BTc], 1)
        mask = torch.cat([micro.prompt_mask_BTp, micro.completion_mask_BTc], 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        Tc = micro.completion_ids_BTc.shape[1]
        naive = torch.log_softmax(logits[:, -Tc - 1:-1] / micro.temperature_B[:, None, None], -1)
    want = naive.gather(-1, micro.completion_ids_BTc.unsqueeze(-1)).squeeze(-1)
    real = micro.completion_mask_BTc.bool()
    assert torch.allclose(logp[real], want[real], atol=1e-5)
    assert torch.allclose(entropy[real], -(naive.exp() * naive).sum(-1)[real], atol=1e-4)


def test_a_checkpoints_generation_settings_change_nothing_generate_samples(tiny_model_dir):
    """transformers fills every generate setting left unset from the model's generation_config, and a checkpoint's
    (penalties, suppressed or biased tokens, forced EOS, stop strings, min lengths, sampling knobs) would become
    processors before rlora's draw: the fallback samples the same tokens, log-probs and ends with any of them set,
    and leaves the model's own config as it was."""
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.3)
    prompts = [tokenizer(t)["input_ids"] for t in ("What is 1 + 1?", "Hello there, friend")]
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.95, min_new_tokens=2)
    gen = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    clean = gen.sample(model, prompts, 4, params, seed=3)
    base = model.get_base_model()
    common = [int(t) for t in clean.completion_ids_BTc[clean.completion_mask_BTc.bool()].unique()[:4]]
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, top_k=5, top_p=0.5, temperature=0.3,
                    do_sample=True, min_new_tokens=8, min_length=30, suppress_tokens=common[:2],
                    begin_suppress_tokens=common[2:3], bad_words_ids=[[common[3]]],
                    sequence_bias={(common[0],): 5.0}, forced_eos_token_id=tok.eos_ids[0],
                    exponential_decay_length_penalty=(1, 1.5), stop_strings=[" "])
    base.generation_config.update(**settings)
    with_settings = gen.sample(model, prompts, 4, params, seed=3)
    assert torch.equal(with_settings.completion_ids_BTc, clean.completion_ids_BTc)
    assert torch.equal(with_settings.completion_mask_BTc, clean.completion_mask_BTc)
    assert torch.equal(with_settings.sampling_logp_BTc, clean.sampling_logp_BTc)
    assert with_settings.finish_reasons == clean.finish_reasons
    assert all(getattr(base.generation_config, k) == v for k, v in settings.items() if k != "sequence_bias")


def test_a_stop_string_that_began_in_the_prompt_does_not_end_a_row(tiny_model_dir):
    """The engine looks for stop strings in the completion's text only; generate's own check also reads the prompt.
    A prompt ending in half of a stop string: generate's rows run on as the engine's (their tokens, masks, ends)."""
    from rlora.rollout.engine import BuiltinGenerator

    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.3)
    prompt = tokenizer("Say x")["input_ids"] + tokenizer("@@")["input_ids"]
    engine = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    free = engine.sample(model, [prompt], 4, SamplingParams(max_new_tokens=8, temperature=1.0), seed=1)
    first = tokenizer.decode(free.completion_ids_BTc[0, :1])  # row 0's first token's text: after the prompt's "@@"
    stop = "@@" + first
    assert stop not in tokenizer.decode(free.completion_ids_BTc[0]), "the completion itself writes it: pick another"
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop=(stop,))
    want = engine.sample(model, [prompt], 4, params, seed=1)
    generate = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, [prompt], 4, params, seed=1)
    assert want.completion_mask_BTc[0].sum() > 1  # the engine runs row 0 on past its first token
    assert torch.equal(generate.completion_ids_BTc, want.completion_ids_BTc.cpu())
    assert torch.equal(generate.completion_mask_BTc, want.completion_mask_BTc.cpu())
    assert generate.finish_reasons == want.finish_reasons


def test_model_generation_config_eos_ids_are_added(tiny_model_dir):
    from rlora.models.loading import add_model_eos_ids

    _, tok, model = make_policy(tiny_model_dir)
    base = model.get_base_model()
    base.generation_config.eos_token_id = [tok.eos_ids[0], 7]
    add_model_eos_ids(tok, base)
    assert tok.eos_ids == [tok.eos_ids[0], 7]


def test_no_gradients_and_no_clipping_norm(tiny_model_dir):
    _, _, model = make_policy(tiny_model_dir)
    params = trainable_parameters(model)
    optimizer, scheduler = build_optimizer(params, TrainConfig(lr=1e-2, max_grad_norm=None), total_updates=1)
    assert optimizer_step(params, optimizer, scheduler, None, 0.0) == {"grad_norm": 0.0, "skipped_update": 0}


def test_the_update_reads_its_sums_back_once_however_many_micro_batches(tiny_model_dir):
    """With the model and the rollout on a (simulated) device, the update reads from it in train/update.py as
    often with 8 micro-batches of one row as with one of eight: each micro-batch's loss and metric sums stay on
    the device until the metrics are read, so a GPU is not stalled between micro-batches. The metrics agree."""
    from dataclasses import fields

    from device_guard import SimulatedDevice

    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=3), tok.pad_id)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.3, 0.0, -0.3, 0.2])
    scored = ScoredRollout(rollout, per_token(advantages, rollout.completion_mask_BTc), rollout.completion_mask_BTc,
                           None, None)
    on_device = [getattr(x, f.name) for x in (rollout, scored) for f in fields(x)]
    reads, metrics = {}, {}
    for micro_batch_size in (8, 1):
        model.zero_grad(set_to_none=True)
        with SimulatedDevice().place(model, *(t for t in on_device if isinstance(t, torch.Tensor))) as guard:
            metrics[micro_batch_size] = accumulate_policy_gradient(model, get_algorithm("grpo"), AlgoConfig(), scored,
                                                                   micro_batch_size, constant_len=6)
        reads[micro_batch_size] = [t for t in guard.to_host if "rlora/train/update.py" in t.where]
    assert not guard.mixed and len(reads[1]) == len(reads[8]) >= 1, [t.where for t in reads[1]]
    assert metrics[1].keys() == metrics[8].keys()
    for key, value in metrics[8].items():
        assert metrics[1][key] == (value if value is None else pytest.approx(value, rel=1e-5, abs=1e-6)), key
