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
    _assert_greedy_equals_generate(model, tiny_model_dir)


def _assert_greedy_equals_generate(model, model_dir):
    """The built-in sampler's greedy completions of three prompts equal transformers generate's."""
    tokenizer, tok = load_tokenizer(model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in ["What is 3 + 4?", "Hello", "a b c d e"]]
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    ours = BuiltinGenerator(tokenizer, tok.eos_ids, tok.pad_id).sample(model, prompts, 1, greedy, 0)
    hf = HFGenerator(tokenizer, tok.eos_ids, tok.pad_id)
    for i, prompt in enumerate(prompts):
        assert ours.completion_ids_BTc[i].tolist() == hf.sample(model, [prompt], 1, greedy, 0).completion_ids_BTc[0].tolist()



def _sample_first(model, ids) -> None:
    """A no-grad eval forward, as sampling and evaluation run before an update: bitsandbytes 0.50 would repack a 4-bit
    weight there for a CPU kernel without backward (on AVX512-BF16 CPUs), and the gradients after it were wrong."""
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)


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
        _sample_first(model, ids)
        model.train()
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in trainable_parameters(model)]))
    assert grads[1].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)  # measured: 4-bit 0, 8-bit 1.3e-6 relative


def _molora_on(base, seed: int = 0):
    """A mixture (token router, 3 experts, top 2) on the base, with random non-zero B: the same weights for the same
    seed whatever the base's layers are."""
    from rlora.models import molora as ml

    torch.manual_seed(seed)
    ml.attach_molora(base, ml.MoLoRAConfig(num_experts=3, top_k=2, rank=2, router="token", router_init_std=0.3))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("molora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return base


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_a_mixture_on_a_quantized_base_trains_as_on_its_dequantized_weights(tiny_model_dir, bits):
    """MoLoRA on a bitsandbytes-quantized base (QLoRA's memory with a mixture of experts): the quantized layers are
    called as modules inside the MoLoRA layers, so the experts' and routers' gradients equal those on the dequantized
    weights (the LoRA test's tolerance), and the sampler's greedy completions equal transformers generate's."""
    from rlora.models import molora as ml

    quantized = _molora_on(load_base_model(ModelConfig(path=tiny_model_dir, quantization=bits), tiny_model_dir))
    reference = _molora_on(dequantized_copy(load_base_model(ModelConfig(path=tiny_model_dir, quantization=bits),
                                                            tiny_model_dir), tiny_model_dir))
    q_proj = quantized.model.layers[0].self_attn.q_proj.base_layer
    assert q_proj.weight.dtype in (torch.uint8, torch.int8), "the base must really be quantized"
    tokenizer, _ = load_tokenizer(tiny_model_dir)
    ids = torch.tensor([tokenizer("What is 3 + 4? The answer")["input_ids"]] * 2)
    grads = []
    for model in (quantized, reference):
        _sample_first(model, ids)
        model.train()
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for n, p in model.named_parameters() if ml.PARAM_TAG in n]))
    assert grads[1].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-5)

    _assert_greedy_equals_generate(quantized.eval(), tiny_model_dir)


@pytest.mark.parametrize("router", ["sequence", "token"])
def test_rlora_train_and_sft_run_a_mixture_on_a_4bit_base(router, tiny_model_dir, prompts_file, tmp_path):
    """`rlora train` (GRPO) and `rlora sft` with a molora section on a 4-bit base: both run and move the mixture."""
    import json

    from conftest import tiny_overrides
    from safetensors.torch import load_file
    from test_molora_sft import ROWS, molora_config, write_jsonl

    from rlora.cli import main
    from rlora.models import molora as ml

    molora = {"num_experts": 3, "top_k": 2, "rank": 4, "router": router, "router_init_std": 0.3}
    rl = tmp_path / "rl"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(rl), **{
        "lora.rank": 16, "molora": json.dumps(molora), "model.quantization": "4bit", "rollout.sampler_dtype": "model",
        "algo.sampler_is_cap": "null", "train.lr": 0.01, "eval.before": "false"})]) == 0
    config = molora_config(tmp_path, tiny_model_dir, write_jsonl(tmp_path / "rows.jsonl", ROWS), molora)
    assert main(["sft", config, "model.quantization=4bit"]) == 0
    for folder in (rl / "adapter", tmp_path / "run" / "adapter"):
        weights = load_file(str(folder / ml.WEIGHTS_FILE))
        assert any(float(v.abs().max()) > 0 for k, v in weights.items() if k.endswith("molora_B")), folder


def test_only_a_base_that_trains_goes_without_bitsandbytes_cpu_repacking(tiny_model_dir):
    """`rlora eval` (trains=False) keeps bitsandbytes' faster CPU kernel for a 4-bit base; every command that trains
    through the base turns its repacking off (the gradient tests above)."""
    import bitsandbytes as bnb
    from bitsandbytes.nn.modules import has_avx512bf16

    def layers(model):
        return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]

    config = ModelConfig(path=tiny_model_dir, quantization="4bit")
    trains, evaluates = load_base_model(config, tiny_model_dir), load_base_model(config, tiny_model_dir, trains=False)
    assert layers(trains) and not any(m.support_avx512bf16_for_cpu for m in layers(trains))
    assert layers(evaluates) and all(m.support_avx512bf16_for_cpu == has_avx512bf16() for m in layers(evaluates))
