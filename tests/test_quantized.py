"""A bitsandbytes-quantized frozen base (4-bit NF4, 8-bit) with a LoRA adapter: the sampler calls the
quantized layers as modules and matches generate; gradients reach the adapter. bitsandbytes >= 0.49 runs
these on the CPU; on GPU machines the same code path runs the CUDA kernels."""

import pytest
import torch

from rlora.config import LoraConfig, ModelConfig
from rlora.models.loading import attach_lora, load_base_model, load_tokenizer, trainable_parameters
from rlora.rollout.engine import BuiltinGenerator
from rlora.rollout.generator import HFGenerator
from rlora.types import SamplingParams

pytest.importorskip("bitsandbytes", reason="the quant extra (pip install -e .[quant]) is not installed")


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_quantized_base_samples_like_generate(tiny_model_dir, bits):
    base = load_base_model(ModelConfig(path=tiny_model_dir, quantization=bits), tiny_model_dir)
    q_proj = base.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype in (torch.uint8, torch.int8), "the base must really be quantized"
    model = attach_lora(base, LoraConfig(rank=4, alpha=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    tokenizer, tok = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in ["What is 3 + 4?", "Hello", "a b c d e"]]
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    ours = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 1, greedy, 0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    for i, prompt in enumerate(prompts):
        assert ours.completion_ids_BTc[i].tolist() == hf.sample(model, [prompt], 1, greedy, 0).completion_ids_BTc[0].tolist()



def dequantized_copy(quantized_base, model_dir):
    """A plain float32 model whose linear weights are the quantized base's, dequantized."""
    import bitsandbytes as bnb

    plain = load_base_model(ModelConfig(path=model_dir), model_dir)
    for (_, q), (_, m) in zip(quantized_base.named_modules(), plain.named_modules()):
        if isinstance(q, bnb.nn.Linear4bit):
            m.weight.data = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).float()
        elif isinstance(q, bnb.nn.Linear8bitLt):
            scale = q.weight.SCB if getattr(q.weight, "SCB", None) is not None else q.state.SCB
            m.weight.data = q.weight.data.float() * scale[:, None] / 127.0
    return plain


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_adapter_gradients_through_a_quantized_base_match_the_dequantized_model(tiny_model_dir, bits):
    """The LoRA gradient must flow through the quantized layers exactly as through their dequantized
    weights (a missing backward through a quantized matmul would drop the lower layers' gradients)."""
    quantized = load_base_model(ModelConfig(path=tiny_model_dir, quantization=bits), tiny_model_dir)
    reference = dequantized_copy(quantized, tiny_model_dir)
    models = [attach_lora(base, LoraConfig(rank=4, alpha=8)) for base in (quantized, reference)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (name, a), (_, b) in zip(*(m.named_parameters() for m in models)):
            if "lora_" in name:
                value = torch.randn(a.shape, generator=g) * 0.3
                a.copy_(value)
                b.copy_(value)
    tokenizer, _ = load_tokenizer(tiny_model_dir)
    ids = torch.tensor([tokenizer("What is 3 + 4? The answer")["input_ids"]] * 2)
    grads = []
    for model in models:
        model.train()
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainable_parameters(model)]))
    assert grads[1].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)  # measured: 4-bit 0, 8-bit 1.3e-6 relative
