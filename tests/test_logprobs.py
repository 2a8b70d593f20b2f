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

from rlora.models.logprobs import completion_logprobs
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
        assert torch.allclose(grads, full_grads, atol=1e-6, rtol=1e-5)
        assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()
    assert full_grads.abs().max() > 0


PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from rlora.models.tiny import build_random_model
    from rlora.models.logprobs import completion_logprobs
    from rlora.models.loading import attach_lora, load_base_model
    from rlora.config import LoraConfig, ModelConfig
    from rlora.types import RolloutSlice
    torch.set_num_threads(1)
    folder, chunk = sys.argv[1], int(sys.argv[2])
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
    (plus their log-softmax and gradient); the chunked path holds one 128 x 32000 chunk (16 MB, a few copies) at a time.
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
