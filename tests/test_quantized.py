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
def test_quantized_base_samples_like_generate_and_trains_the_adapter(tiny_model_dir, bits):
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
    model.train()
    model(input_ids=torch.tensor([prompts[0]])).logits.float().logsumexp(-1).sum().backward()
    params = trainable_parameters(model)
    assert params and all(p.grad is not None and p.dtype == torch.float32 for p in params)
    assert any(p.grad.abs().sum() > 0 for p in params)
