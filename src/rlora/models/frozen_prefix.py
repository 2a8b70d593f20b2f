"""Frozen lower layers computed once for the policy and the reference.

When the LoRA sits only on decoder layers k..L-1, layers 0..k-1 compute the same thing with the adapter
on (policy) or off (reference), and nothing below layer k needs a gradient. So a step runs layers 0..k-1
once per completion, without gradient, and every log-prob pass of the step (reference, old policy, each
policy update) starts at layer k from those hidden states.

The decoder is run layer by layer here, replicating the model's own forward for the families of
SHAREABLE_MODEL_TYPES (Llama, OLMo 2 and OLMoE always causal; Qwen2/Qwen3, Qwen2-MoE, SmolLM3, Gemma 3 and OLMo 3
with their per-layer full/sliding masks; Mistral, Phi-3, Mixtral and Qwen3-MoE with one sliding window; Gemma 3 and OLMo 3 with a rotary
embedding per layer type): embeddings, rotary embeddings, masks, layers, final norm. tests/test_frozen_prefix.py and
tests/test_trainer_families.py check that this equals the model's forward.

The cache holds the hidden states of the whole rollout in its padded layout [B, Tp + Tc, H]; a
micro-batch (any rows, trimmed of all-padding columns) reads its rows and columns from it. Positions
that were padding when their rows were computed hold zeros: they are masked as keys and their own
outputs are never read, so real positions see the inputs of the unshared path (up to the rounding of a
differently padded batch: float64 agrees to 1e-12, float32 to 1e-6 in the tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from rlora.batching import trim
from rlora.models.dropouts import FUNCTIONAL_DROPOUT_KEYS
from rlora.models.loading import causal_lm, rope_switch_length
from rlora.tensors import position_ids_from_mask
from rlora.types import Rollout, RolloutSlice

SHAREABLE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "olmo2", "olmo3", "smollm3",
                         "gemma3_text", "glm4", "ernie4_5", "seed_oss", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# a rotary embedding per layer type: rotary_emb(x, positions, layer_type) (Gemma 3: local and global thetas)
_ROPE_BY_LAYER_TYPE = ("gemma3_text", "olmo3")
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def first_adapter_layer(model) -> int:
    """Index of the lowest decoder layer holding a LoRA module or a trainable parameter: layers below it are
    frozen and identical for policy and reference. 0 when anything adapted or trained sits below the
    decoder layers (a LoRA on the embeddings, peft's modules_to_save or trainable tokens); the number of
    layers when adapters sit only above them (e.g. on lm_head)."""
    adapted = [name for name, module in model.named_modules() if hasattr(module, "lora_A")]
    adapted += [name for name, param in model.named_parameters() if param.requires_grad]
    first = causal_lm(model).config.num_hidden_layers
    for name in adapted:
        match = _LAYER_INDEX.search(name + ".")
        if match is None:
            if "lm_head" not in name:
                return 0  # below (or beside) the decoder layers: nothing can be shared
            continue
        first = min(first, int(match.group(1)))
    return first


def sharing_unsupported(model) -> str | None:
    """Why the frozen prefix cannot be shared for this model, or None."""
    config = causal_lm(model).config
    if config.model_type not in SHAREABLE_MODEL_TYPES:
        return f"model type '{config.model_type}' is not one of {', '.join(SHAREABLE_MODEL_TYPES)}"
    # the prefix runs without dropout, training passes with it
    for key in FUNCTIONAL_DROPOUT_KEYS:
        if getattr(config, key, 0.0):
            return f"{key}={getattr(config, key)} makes the lower layers random in training"
    if getattr(config, "use_bidirectional_attention", False):  # Gemma 3's encoder variant: other masks
        return "bidirectional attention"
    return None


@dataclass
class _LayerInputs:
    """What every decoder layer takes besides the hidden states."""

    masks: list  # one attention mask per layer (full or sliding window)
    position_embeddings: list[tuple[torch.Tensor, torch.Tensor]]  # cos, sin per layer
    position_ids: torch.Tensor


def _batch_inputs(batch: RolloutSlice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    input_ids = torch.cat([batch.prompt_ids_BTp, batch.completion_ids_BTc], dim=1)
    attention_mask = torch.cat([batch.prompt_mask_BTp, batch.completion_mask_BTc], dim=1)
    return input_ids, attention_mask, position_ids_from_mask(attention_mask)


def _layer_inputs(decoder, hidden_BTH: torch.Tensor, attention_mask: torch.Tensor, position_ids) -> _LayerInputs:
    config = decoder.config
    mask_args = dict(config=config, inputs_embeds=hidden_BTH, attention_mask=attention_mask, past_key_values=None,
                     position_ids=position_ids)
    num_layers = config.num_hidden_layers
    if config.model_type in ("mistral", "phi3", "mixtral", "qwen3_moe"):  # one mask for every layer, sliding when set
        make = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
        masks = [make(**mask_args)] * num_layers
    elif config.model_type in ("qwen2", "qwen3", "qwen2_moe", "smollm3", "gemma3_text", "olmo3"):  # by layer_types
        by_type = {"full_attention": create_causal_mask(**mask_args)}
        if "sliding_attention" in config.layer_types:
            by_type["sliding_attention"] = create_sliding_window_causal_mask(**mask_args)
        masks = [by_type[kind] for kind in config.layer_types[:num_layers]]
    else:  # llama, olmo2, olmoe, glm4, ernie4_5, seed_oss: always causal (llama ignores layer_types)
        masks = [create_causal_mask(**mask_args)] * num_layers
    if config.model_type in _ROPE_BY_LAYER_TYPE:  # one rotary embedding per layer type
        tables = {kind: decoder.rotary_emb(hidden_BTH, position_ids, kind) for kind in set(config.layer_types)}
        position_embeddings = [tables[kind] for kind in config.layer_types[:num_layers]]
    else:
        position_embeddings = [decoder.rotary_emb(hidden_BTH, position_ids)] * num_layers
    return _LayerInputs(masks, position_embeddings, position_ids)


def _run_layers(decoder, hidden_BTH: torch.Tensor, inputs: _LayerInputs, start: int, stop: int) -> torch.Tensor:
    for index in range(start, stop):
        hidden_BTH = decoder.layers[index](
            hidden_BTH, attention_mask=inputs.masks[index], position_embeddings=inputs.position_embeddings[index],
            position_ids=inputs.position_ids, past_key_values=None, use_cache=False,
        )
    return hidden_BTH


@torch.no_grad()
def prefix_hidden(model, batch: RolloutSlice, num_frozen: int) -> torch.Tensor:
    """Hidden states after the first `num_frozen` decoder layers, [B, Tp + Tc, H] (no gradient)."""
    decoder = causal_lm(model).get_decoder()
    input_ids, attention_mask, position_ids = _batch_inputs(batch.to(decoder.embed_tokens.weight.device))
    hidden_BTH = decoder.embed_tokens(input_ids)
    inputs = _layer_inputs(decoder, hidden_BTH, attention_mask, position_ids)
    return _run_layers(decoder, hidden_BTH, inputs, 0, num_frozen)


def suffix_hidden(model, batch: RolloutSlice, hidden_BTH: torch.Tensor, num_frozen: int) -> torch.Tensor:
    """The decoder's last hidden states (final norm applied) from the output of layer num_frozen - 1."""
    decoder = causal_lm(model).get_decoder()
    _, attention_mask, position_ids = _batch_inputs(batch)
    inputs = _layer_inputs(decoder, hidden_BTH, attention_mask, position_ids)
    hidden_BTH = _run_layers(decoder, hidden_BTH, inputs, num_frozen, decoder.config.num_hidden_layers)
    return decoder.norm(hidden_BTH)


def frozen_prefix(model, rollout: Rollout, num_frozen: int, micro_batch_size: int) -> "FrozenPrefix | None":
    """The rollout's FrozenPrefix, or None where its rows would not compute what full passes compute
    (prefix_fits)."""
    return FrozenPrefix(model, rollout, num_frozen, micro_batch_size) if prefix_fits(model, rollout) else None


def prefix_fits(model, rollout: Rollout) -> bool:
    """False where a rotary scaling chosen by each call's length (Phi-3.5/4-mini's longrope, dynamic scaling) has a
    switch point the rollout's rows reach. The prefix's micro-batches and the passes' would then pick their
    frequencies from different longest rows (a Phi-3 whose short rows were prefixed beside long ones: log-probs
    0.01 off)."""
    limit = rope_switch_length(causal_lm(model).config)
    return limit is None or rollout.prompt_ids_BTp.shape[1] + rollout.completion_ids_BTc.shape[1] < limit


class FrozenPrefix:
    """The frozen layers' output for every completion of one rollout, computed once."""

    def __init__(self, model, rollout: Rollout, num_frozen: int, micro_batch_size: int):
        self.num_frozen = num_frozen
        self.prompt_width = rollout.prompt_ids_BTp.shape[1]
        B, width = rollout.num_completions, self.prompt_width + rollout.completion_ids_BTc.shape[1]
        self.hidden_BTH: torch.Tensor | None = None
        was_training = model.training
        model.eval()
        try:
            for start in range(0, B, micro_batch_size):
                micro = trim(rollout.select(slice(start, start + micro_batch_size)))
                hidden = prefix_hidden(model, micro, num_frozen)
                if self.hidden_BTH is None:
                    self.hidden_BTH = hidden.new_zeros(B, width, hidden.shape[-1])
                self.hidden_BTH[start:start + len(hidden), self._columns(micro)] = hidden
        finally:
            model.train(was_training)

    def _columns(self, micro: RolloutSlice) -> slice:
        """Where a trimmed micro-batch's columns sit in the rollout's padded layout."""
        return slice(self.prompt_width - micro.prompt_ids_BTp.shape[1],
                     self.prompt_width + micro.completion_ids_BTc.shape[1])

    def rows(self, index: slice | torch.Tensor, micro: RolloutSlice) -> "PrefixSlice":
        """The cached hidden states of the micro-batch made of rollout rows `index`, trimmed like `micro`."""
        if isinstance(index, torch.Tensor):
            index = index.to(self.hidden_BTH.device)  # row indices come from the CPU-side rollout
        return PrefixSlice(self.hidden_BTH[index][:, self._columns(micro)], self.num_frozen)


@dataclass
class PrefixSlice:
    """A micro-batch's hidden states after the frozen layers, and how many layers that is."""

    hidden_BTH: torch.Tensor
    num_frozen: int
