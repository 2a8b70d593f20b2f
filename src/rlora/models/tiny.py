"""Small random-initialised models with their own byte-level BPE tokenizer, built by rlora's code, for
tests and benchmarks (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

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


def build_random_model(folder: str | Path, family: str = "llama", hidden: int = 64, layers: int = 2, heads: int = 4,
                       kv_heads: int = 2, ffn: int = 128, vocab_size: int | None = None, tie: bool = True,
                       seed: int = 0, tokenizer=None, **config_extra) -> Path:
    """Save a random-initialised Llama, Qwen2 or Mistral causal LM and a tokenizer to `folder`; returns the
    folder. config_extra: further config keys (e.g. sliding_window)."""
    tokenizer = tokenizer or build_tokenizer()
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[family]
    config = config_cls(
        vocab_size=vocab_size or len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
        max_position_embeddings=2048, tie_word_embeddings=tie, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **config_extra,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
