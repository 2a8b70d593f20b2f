"""The chunked log-prob path equals the full-logits path (values, entropy, gradients) and uses far less
memory; gradient checkpointing leaves gradients unchanged."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_policy_model import make_policy, perturb_adapter, sample, vary_lengths

from rlora.models import logprobs
from rlora.models.logprobs import head_logits, completion_logprobs, recomputes_logits, token_logprobs
from rlora.models.loading import causal_lm, trainable_parameters
from rlora.models.shared_prompts import set_prompt_sharing
from rlora.models.tiny import build_random_model


@pytest.fixture(scope="module")
def qwen2_untied_dir(tmp_path_factory):
    return str(build_random_model(tmp_path_factory.mktemp("q2") / "model", family="qwen2", tie=False, seed=5))


def logp_and_grads(model, micro, chunk_tokens, weights_BT):
    model.zero_grad(set_to_none=True)
    logp, entropy = completion_logprobs(model, micro, with_entropy=True, chunk_tokens=chunk_tokens)
    mask = micro.completion_mask_BTc.float()
    (logp * weights_BT * mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in trainable_parameters(model)])
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("case", ["llama-tied", "llama-lora-on-head", "qwen2-untied"])
def test_chunked_path_equals_full_path(tiny_model_dir, qwen2_untied_dir, case):
    model_dir = qwen2_untied_dir if case == "qwen2-untied" else tiny_model_dir
    targets = ["q_proj", "v_proj", "down_proj", "lm_head"] if case == "llama-lora-on-head" else "all-linear"
    tokenizer, tok, model = make_policy(model_dir, target_modules=targets)
    set_prompt_sharing(model, False)  # the full path runs every row's prompt; sharing: tests/test_shared_prompts.py
    if case == "llama-lora-on-head":
        assert any("lm_head.lora_A" in n for n, _ in model.named_parameters())
    perturb_adapter(model, scale=0.2)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=2), tok.pad_id)
    micro = rollout.select(slice(0, 8))
    micro.temperature_B = torch.linspace(0.5, 1.5, 8)
    weights = torch.randn(micro.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(0))
    full_logp, full_entropy, full_grads = logp_and_grads(model, micro, 0, weights)
    mask = micro.completion_mask_BTc.bool()
    for chunk in (7, 1024):  # several chunks, and one
        logp, entropy, grads = logp_and_grads(model, micro, chunk, weights)
        assert torch.allclose(logp[mask], full_logp[mask], atol=1e-5, rtol=0)
        assert torch.allclose(entropy[mask], full_entropy[mask], atol=1e-5, rtol=0)
        # the chunked path divides the hidden states by the temperature, the full path the logits: float32 rounds
        # them differently, so gradients agree to float32's resolution relative to the largest
        assert torch.allclose(grads, full_grads, atol=1e-6 * float(full_grads.abs().max()), rtol=1e-5)
        assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()
    assert full_grads.abs().max() > 0


PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from rlora.models.tiny import build_random_model
    from rlora.models import logprobs
    from rlora.models.logprobs import completion_logprobs
    from rlora.models.loading import attach_lora, load_base_model
    from rlora.config import LoraConfig, ModelConfig
    from rlora.types import RolloutSlice
    torch.set_num_threads(1)
    folder, chunk = sys.argv[1], int(sys.argv[2])
    logprobs.KEEP_LOGITS_BYTES_CPU = 0  # every chunk recomputed in the backward, as on a GPU: one chunk at a time
    model = attach_lora(load_base_model(ModelConfig(path=folder), folder), LoraConfig(rank=4))
    def batch(B, Tp, Tc):
        g = torch.Generator().manual_seed(0)
        return RolloutSlice(torch.randint(0, 32000, (B, Tp), generator=g), torch.ones(B, Tp, dtype=torch.long),
                            torch.randint(0, 32000, (B, Tc), generator=g), torch.ones(B, Tc, dtype=torch.long),
                            torch.ones(B))
    def run(b):
        logp, _ = completion_logprobs(model, b, with_entropy=True, chunk_tokens=chunk)
        logp.sum().backward()
    run(batch(1, 4, 8))  # one-time allocations (thread pools, kernels) happen here, not in the measurement
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    run(batch(8, 4, 384))
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mb": (after - before) / 1024}))
""")


@pytest.mark.slow  # 40 s: two processes, each with ~2 GB of full-vocabulary logits
def test_chunked_path_peak_memory_is_a_fraction_of_the_full_path(tmp_path):
    """8 x 384 completion tokens over a 32k vocabulary: full fp32 logits are 8*385*32000*4 B = 394 MB
    (plus their log-softmax and gradient); the chunked path, its logits recomputed in the backward (what a GPU does,
    and a CPU past KEEP_LOGITS_BYTES_CPU), holds one 128 x 32000 chunk (16 MB, a few copies) at a time.
    Each path runs in a fresh process and reports how much its peak resident memory grew. glibc is told
    to give freed blocks over 1 MB back at once (MALLOC_MMAP_THRESHOLD_), so peak RSS tracks the live
    tensors rather than heap fragmentation."""
    folder = build_random_model(tmp_path / "wide", hidden=64, layers=2, vocab_size=32000, seed=0)

    def growth(chunk):
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(folder), str(chunk)], capture_output=True,
                             text=True, timeout=300, check=True, env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mb"]

    full, chunked = growth(0), growth(128)
    assert full > 390, f"the full path must hold the logits ({full:.0f} MB): else this test measures nothing"
    assert chunked < 0.15 * full, (chunked, full)  # measured: 122 MB against 1917 MB


def test_which_passes_recompute_their_logits():
    # float32 logits of 1000 positions x 50,000 tokens: 200 MB (kept on a CPU); x 6000 positions: 1.2 GB (not)
    assert not recomputes_logits(1000, 50_000, torch.device("cpu"))
    assert recomputes_logits(6000, 50_000, torch.device("cpu"))
    assert recomputes_logits(1000, 50_000, torch.device("cuda", 0))  # a GPU checkpoints every chunk, as before
    assert not recomputes_logits(2**28 // 1000, 1000, torch.device("cpu"))  # exactly the budget: kept


def test_kept_logits_give_the_gradients_of_recomputed_ones(tiny_model_dir, monkeypatch):
    """On a CPU a gradient pass within KEEP_LOGITS_BYTES_CPU keeps its chunks' logits for the backward: the output
    layer runs once per chunk instead of twice (forward, then again in the backward), for the same gradient."""
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, scale=0.2)
    micro = vary_lengths(sample(model, tokenizer, tok, seed=4), tok.pad_id).select(slice(0, 8))
    weights = torch.randn(micro.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(2))
    head_calls = []
    causal_lm(model).get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    chunk = 7
    num_chunks = -(-int(micro.completion_mask_BTc.sum()) // chunk)
    logp_kept, entropy_kept, kept = logp_and_grads(model, micro, chunk, weights)
    assert len(head_calls) == num_chunks > 1
    head_calls.clear()
    monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES_CPU", 0)
    logp, entropy, recomputed = logp_and_grads(model, micro, chunk, weights)
    assert len(head_calls) == 2 * num_chunks
    assert torch.equal(logp_kept, logp) and torch.equal(entropy_kept, entropy)
    assert torch.equal(kept, recomputed) and kept.abs().max() > 0


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    set_prompt_sharing(model, False)  # checkpointing turns it off: compare like with like
    perturb_adapter(model, scale=0.2)
    rollout = vary_lengths(sample(model, tokenizer, tok, seed=3), tok.pad_id)
    micro = rollout.select(slice(0, 8))
    weights = torch.randn(micro.completion_ids_BTc.shape, generator=torch.Generator().manual_seed(1))
    model.train()
    _, _, plain = logp_and_grads(model, micro, 1024, weights)
    causal_lm(model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert causal_lm(model).is_gradient_checkpointing
    _, _, checkpointed = logp_and_grads(model, micro, 1024, weights)
    assert torch.allclose(plain, checkpointed, atol=1e-7, rtol=1e-6)


def _autograd_reference(x_NV, targets_N):
    """What token_logprobs computed before _TargetLogProb: logsumexp and gather through autograd."""
    logsumexp_N = torch.logsumexp(x_NV, dim=-1)
    return x_NV.gather(-1, targets_N[:, None]).squeeze(-1) - logsumexp_N


@pytest.mark.parametrize("shape", [(6, 50), (3, 4, 1000)])
def test_target_logprobs_and_entropy_against_float64_and_autograd(shape):
    """Log-probs and entropies against log_softmax in float64; the gradient equals autograd's bit for bit (the same
    float32 operations: exp(x - lse) * -g, then + g at the target), also where a row's target repeats."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 4).requires_grad_()
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    targets.view(-1)[1] = targets.view(-1)[0]
    temperature = torch.rand(shape[:-1], generator=g) + 0.5
    logp, entropy = token_logprobs(x, targets, temperature, with_entropy=True)
    log_softmax64 = torch.log_softmax(x.detach().double() / temperature[..., None].double(), dim=-1)
    assert torch.allclose(logp.double(), log_softmax64.gather(-1, targets[..., None]).squeeze(-1), atol=2e-6, rtol=0)
    assert torch.allclose(entropy.double(), -(log_softmax64.exp() * log_softmax64).sum(-1), atol=2e-5, rtol=0)
    weights = torch.randn(logp.shape, generator=g)
    (grad,) = torch.autograd.grad((logp * weights).sum(), x)
    flat = lambda t: t.reshape(-1, shape[-1])  # noqa: E731
    reference = _autograd_reference(flat(x / temperature[..., None]), targets.reshape(-1))
    (grad_ref,) = torch.autograd.grad((reference * weights.reshape(-1)).sum(), x)
    assert torch.equal(grad, grad_ref)
    assert torch.equal(logp.detach().reshape(-1), reference.detach())
    assert entropy.grad_fn is None  # no graph unless entropy_grad
    logp_e, entropy_e = token_logprobs(x, targets, temperature, with_entropy=True, entropy_grad=True)
    assert torch.equal(logp_e, logp) and torch.equal(entropy_e, entropy) and entropy_e.grad_fn is not None
    # the entropy's gradient (an entropy bonus: models/logprobs.py _Entropy's -p (log p + H)) against float64 autograd
    (grad_h,) = torch.autograd.grad((entropy_e * weights).sum(), x)
    x64 = x.detach().double().requires_grad_()
    log_softmax64 = torch.log_softmax(x64 / temperature[..., None].double(), dim=-1)
    (grad_h64,) = torch.autograd.grad((-(log_softmax64.exp() * log_softmax64).sum(-1) * weights.double()).sum(), x64)
    assert torch.allclose(grad_h.double(), grad_h64, atol=1e-5, rtol=0)  # seen: 3e-7 to 2e-6


def test_the_temperature_divides_the_hidden_states_where_the_output_layer_is_linear():
    """logits / T = head(h / T) for an output layer without a bias: divided over H, not vocab, elements; with a bias,
    or bfloat16 hidden states, the logits are divided (token_logprobs gets the temperature back)."""
    g = torch.Generator().manual_seed(0)
    h_CH, temperature_C = torch.randn(5, 16, generator=g), torch.rand(5, generator=g) + 0.5
    head = torch.nn.Linear(16, 300, bias=False)
    logits, left = head_logits(head, h_CH, temperature_C)
    assert left is None and torch.allclose(logits, head(h_CH) / temperature_C[:, None], atol=1e-6, rtol=1e-6)
    biased = torch.nn.Linear(16, 300)
    logits, left = head_logits(biased, h_CH, temperature_C)
    assert left is temperature_C and torch.equal(logits, biased(h_CH))
    logits, left = head_logits(head.to(torch.bfloat16), h_CH.bfloat16(), temperature_C)
    assert left is temperature_C and torch.equal(logits, head(h_CH.bfloat16()))


@pytest.mark.parametrize("lora_bias", [False, True])
def test_a_lora_output_layer_folds_the_temperature_only_without_a_bias(lora_bias):
    """peft's LoRA on the output layer: the base layer has no bias, but lora_bias gives lora_B one, and then
    head(h / T) != head(h) / T: the logits are divided instead. Either way the logits equal head(h) / T."""
    from peft import LoraConfig, get_peft_model

    g = torch.Generator().manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(16, 300, bias=False)),
                           LoraConfig(r=4, target_modules=["0"], lora_bias=lora_bias))
    head = model.base_model.model[0]
    for name, p in head.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=g)  # lora_B (and its bias) start at 0
    h_CH, temperature_C = torch.randn(5, 16, generator=g), torch.rand(5, generator=g) + 0.5
    logits, left = head_logits(head, h_CH, temperature_C)
    assert (left is temperature_C) == lora_bias
    divided = logits if left is None else logits / left[:, None]
    assert torch.allclose(divided, head(h_CH) / temperature_C[:, None], atol=1e-5, rtol=1e-5)


def test_the_entropy_stays_float32_under_autocast():
    """Under bfloat16 autocast (train.autocast) the logits arrive in bfloat16; the log-softmax, its entropy and the
    gradient are float32 (autocast would run e.g. linalg.vecdot in bfloat16: 0.1 nats off on such logits)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 32000, generator=g) * 6).bfloat16().requires_grad_()
    targets = torch.randint(0, 32000, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = token_logprobs(x, targets, torch.ones(64), with_entropy=True)
        logp_e, entropy_e = token_logprobs(x, targets, torch.ones(64), with_entropy=True, entropy_grad=True)
    log_softmax64 = torch.log_softmax(x.detach().double(), dim=-1)
    entropy64 = -(log_softmax64.exp() * log_softmax64).sum(-1)
    assert logp.dtype == entropy.dtype == torch.float32
    for value in (entropy, entropy_e):  # seen: 2.6e-6 on AVX512 and on AVX2 kernels (1.2e-4 before session 26)
        assert torch.allclose(value.double(), entropy64, atol=2e-5, rtol=0)
    assert torch.allclose(logp.double(), log_softmax64.gather(-1, targets[:, None]).squeeze(-1), atol=1e-4, rtol=0)
    (grad,) = torch.autograd.grad(entropy_e.sum(), x)
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()
