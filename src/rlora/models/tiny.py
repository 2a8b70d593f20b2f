"""Small random-initialised models with their own byte-level BPE tokenizer, built by rlora's code, for
tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM, Ernie4_5Config, Gemma3TextConfig, Glm4Config, LlamaConfig, MistralConfig, MixtralConfig,
    Olmo2Config, Olmo3Config, OlmoeConfig, Phi3Config, PreTrainedTokenizerFast, Qwen2Config, Qwen2MoeConfig,
    Qwen3Config, Qwen3MoeConfig, SeedOssConfig, SmolLM3Config,
)

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "What is 3 + 4? The answer is 7.", "State the final answer: 9 - 2 = 7", "a b c d e f g h i j k l m n o p",
    "The quick brown fox jumps over the lazy dog.", "0 1 2 3 4 5 6 7 8 9 10 11 12 -1 -2 -3 + - * / =",
    "user assistant system answer <answer> </answer> think", "aaaa bbbb abab baba", "Hello, how are you today?",
]


def build_tokenizer(vocab_size: int = 512):
    """Byte-level BPE trained on a small built-in corpus, with a ChatML-style template; EOS = <|im_end|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "qwen3": Qwen3Config,
           "gemma3_text": Gemma3TextConfig, "phi3": Phi3Config, "olmo2": Olmo2Config, "olmo3": Olmo3Config,
           "smollm3": SmolLM3Config, "glm4": Glm4Config, "ernie4_5": Ernie4_5Config, "seed_oss": SeedOssConfig,
           "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig, "olmoe": OlmoeConfig}
# What makes each newer family differ from Llama, switched on in its tiny model so that tests see it (for
# 2 layers; config_extra overrides): Qwen3's head_dim apart from hidden / heads; Gemma 3's attention scale
# apart from head_dim and one sliding layer (its window beyond the tests' lengths, its own rotary theta)
# and one global layer; Phi-3 rotary on half of each head; SmolLM3 a NoPE second layer; the mixtures of experts 4
# experts, 2 per token (Qwen2/3-MoE with one dense layer, as their mlp_only_layers allow; Qwen2-MoE's shared expert).
FAMILY_CONFIG = {
    "qwen3": dict(head_dim=32),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=512,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "olmo2": {},
    # OLMo 3: a sliding layer (its window beyond the tests' lengths) and a global one, each with its own theta
    "olmo3": dict(sliding_window=512, layer_types=["sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 500000.0}}),
    "smollm3": dict(no_rope_layers=[1, 0]),
    # GLM-4 (rotary on half of each head, interleaved; q/k/v biases), ERNIE 4.5 and Seed-OSS with every bias on
    "glm4": dict(head_dim=32),
    "ernie4_5": dict(head_dim=16, use_bias=True),
    # (Seed-OSS's config defaults to attention and residual dropout 0.1: the tests compare deterministic passes)
    "seed_oss": dict(head_dim=32, attention_out_bias=True, mlp_bias=True, attention_dropout=0.0, residual_dropout=0.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                      mlp_only_layers=[1]),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0]),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
}


def build_random_model(folder: str | Path, family: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, ffn: int = 128, vocab_size: int | None = None, tie: bool = True,
                       seed: int = 0, tokenizer=None, **config_extra) -> Path:
    """Save a random-initialised causal LM of one of CONFIGS' families and a tokenizer to `folder`; returns
    the folder. config_extra: further config keys (e.g. sliding_window)."""
    tokenizer = tokenizer or build_tokenizer()
    config = CONFIGS[family](
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
        max_position_embeddings=2048, tie_word_embeddings=tie, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **{**FAMILY_CONFIG.get(family, {}), **config_extra},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in FAMILY_CONFIG:
        # Norms start as the identity map and biases at zero, where a norm applied in the wrong place, or the
        # wrong one of a layer's four, or a bias left out computes the same thing; random weights tell them apart.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    param.add_(torch.randn_like(param) * 0.3)
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
