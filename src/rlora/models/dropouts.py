"""The base's and the adapter's dropout: which config keys hold a rate, and turning the adapter's off. rlora train
runs every pass without dropout (the sampler's function is the update's), and passes that run rows or layers apart
(shared prompts, the frozen prefix) are only exact without it."""

from __future__ import annotations

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoConfig

# The dropout rates of a base's own config: attention (attn_pdrop: GPT-2 and its kin), residual (Seed-OSS; Phi-3's
# resid_pdrop), embedding, hidden (Falcon, GPT-NeoX, StableLM), OPT's `dropout` and `activation_dropout`, and
# Mixtral's router jitter (noise on the router's input in training: another draw in every pass, as a dropout)
BASE_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "residual_dropout", "resid_pdrop", "embd_pdrop",
                     "hidden_dropout", "dropout", "activation_dropout", "router_jitter_noise")


def base_dropouts(path: str, trust_remote_code: bool = False) -> dict[str, float]:
    """The dropout rates above 0 in the model config (read without loading the weights): {key: rate}."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    rates = {key: getattr(config, key, 0.0) for key in BASE_DROPOUT_KEYS}
    return {key: float(rate) for key, rate in rates.items() if isinstance(rate, (int, float)) and rate > 0}


# dropouts of the base that transformers applies functionally inside the layers (attention; Phi-3's resid_pdrop,
# Seed-OSS's residual_dropout): a pass that runs rows or layers apart from a training pass would not draw them alike
FUNCTIONAL_DROPOUT_KEYS = ("attention_dropout", "resid_pdrop", "residual_dropout", "router_jitter_noise")


def no_adapter_dropout(model: torch.nn.Module) -> None:
    """Every peft LoRA layer's dropout set to rate 0, in place (the modules stay: the batched forward of several
    policies holds them)."""
    for module in model.modules():
        for dropout in getattr(module, "lora_dropout", {}).values() if isinstance(module, BaseTunerLayer) else ():
            if isinstance(dropout, torch.nn.Dropout):
                dropout.p = 0.0
