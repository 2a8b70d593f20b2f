"""A group's prompt computed once in a log-prob pass (train.share_prompts).

A GRPO step samples G completions of each prompt, and every log-prob pass (reference, old policy, each policy
update, PPO's values) runs prompt + completion for every row: the same prompt G times. Here the distinct
prompts of a micro-batch run once, with a key/value cache; the cache is copied to the rows that share each
prompt (PromptRows, whose backward sums the rows' gradients into the prompt's pass: the same gradient as G
separate prompt passes), and the completions run on top of it. On the demo (46-token prompts, G = 8, short
completions) that is about 40 % fewer tokens in every pass.

The numbers equal the unshared pass up to the rounding of differently shaped products and sums (a float64
model's hidden states agree to 1e-12, its gradients to float32's resolution since transformers' RMSNorm runs in
float32; a float32 model's log-probs to ~1e-6: tests/test_shared_prompts.py). Where that cannot hold the pass is not shared:
several policies or a MoLoRA router on the model (a row's adapter or routing is its own), LoRA or attention
dropout in training (one prompt pass would draw one dropout mask for G rows), bidirectional attention, and families
outside SHAREABLE_MODEL_TYPES. Sliding windows need nothing here: the cache pass runs the model's own attention,
whose masks apply them as in an unshared pass (the prompts' cache keeps the W - 1 keys before the completions, all
that a window of W lets them see). The cache pass itself (not a packed one, models/packed_groups.py) does not run
under gradient checkpointing (which turns the cache off) or on a sharded base (prompt_cache_unsupported).
"""

from __future__ import annotations

import torch
from torch import nn

from rlora.models import molora as ml
from rlora.models.dropouts import FUNCTIONAL_DROPOUT_KEYS
# the families the frozen prefix runs layer by layer: each tested here as there (tests/test_trainer_families.py)
from rlora.models.frozen_prefix import SHAREABLE_MODEL_TYPES
from rlora.models.loading import LENGTH_DEPENDENT_ROPE, activation_checkpointing, causal_lm, rope_parameter_sets
from rlora.models.multi_lora import policy_state
from rlora.models.sharded_base import sharded_base
from rlora.tensors import position_ids_from_mask
from rlora.types import RolloutSlice

# the families whose shared and packed passes are tested against unshared ones (tests/test_trainer_families.py)
_OFF_ATTR = "_rlora_no_prompt_sharing"


def set_prompt_sharing(model: nn.Module, enabled: bool) -> None:
    """train.share_prompts for the log-prob passes of this model (on by default)."""
    setattr(causal_lm(model), _OFF_ATTR, not enabled)


def length_dependent_rope(config) -> str | None:
    """The rotary scaling of a model whose frequencies depend on the longest position of a decoder call
    (transformers' dynamic_rope_update), None for any other: one call per pass computes what separate rows do, two
    calls (prompts, then completions on their cache) would rotate the prompts' keys with other frequencies."""
    return next((p["rope_type"] for p in rope_parameter_sets(config) if p.get("rope_type") in LENGTH_DEPENDENT_ROPE),
                None)


def sharing_prompts_unsupported(model: nn.Module) -> str | None:
    """Why this model's log-prob passes cannot share prompts (None: they can)."""
    hf = causal_lm(model)
    config = hf.config
    if getattr(hf, _OFF_ATTR, False):
        return "train.share_prompts=false"
    if config.model_type not in SHAREABLE_MODEL_TYPES:
        return f"model type '{config.model_type}'"
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        return "bidirectional attention"  # a prompt token would see the completions: no pass here lets it
    if policy_state(model) is not None or ml.has_molora(model):
        return "a row's adapter or routing is its own"
    if hf.training and (any(getattr(config, key, 0.0) for key in FUNCTIONAL_DROPOUT_KEYS) or _lora_dropout(model)):
        return "dropout in training"
    return None


def _lora_dropout(model: nn.Module) -> bool:
    return any(isinstance(d, nn.Dropout) and d.p > 0 for m in model.modules() if hasattr(m, "lora_dropout")
               for d in m.lora_dropout.values())


def prompt_cache_unsupported(model: nn.Module) -> str | None:
    """Why the shared prompts' key/value-cache pass (two decoder calls: prompts, then completions) must not run
    where sharing is otherwise allowed (None: it may). A sharded base (train.fsdp) all-gathers each layer per call,
    and every rank must make the same calls: its passes are packed (models/packed_groups.py) or unshared, one
    decoder call each, as in the padding passes of ranks with fewer micro-batches (train/fsdp.py zero_pass).
    Gradient checkpointing turns transformers' cache off; a packed pass needs none. A rotary scaling chosen by each
    call's longest position (length_dependent_rope) would rotate the prompts' cached keys differently."""
    hf = causal_lm(model)
    if sharded_base(model) is not None:
        return "a sharded base (train.fsdp)"
    rope = length_dependent_rope(hf.config)
    if rope is not None:
        return f"rope_type '{rope}' (frequencies chosen by each call's length)"
    if activation_checkpointing(hf) and hf.training and torch.is_grad_enabled():
        return "gradient checkpointing"  # transformers checkpoints (and drops the cache) only then
    return None


def prompt_groups(batch: RolloutSlice) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(first row of each distinct prompt [U], each row's distinct prompt [B]), or None when no two rows share
    a prompt. Rows share a prompt when their padded prompt ids and masks are equal."""
    key_BT = torch.cat([batch.prompt_ids_BTp, batch.prompt_mask_BTp.to(batch.prompt_ids_BTp.dtype)], dim=1)
    unique_UT, inverse_B = torch.unique(key_BT, dim=0, return_inverse=True)
    if len(unique_UT) == len(key_BT):
        return None
    first_U = torch.full((len(unique_UT),), len(key_BT), dtype=torch.long, device=key_BT.device)
    first_U = first_U.scatter_reduce(0, inverse_B, torch.arange(len(key_BT), device=key_BT.device), "amin")
    return first_U, inverse_B


def shared_prompt_hidden(model: nn.Module, batch: RolloutSlice, groups: tuple[torch.Tensor, torch.Tensor]
                         ) -> torch.Tensor:
    """completion_hidden of `batch` with each distinct prompt run once -> [B, Tc, H]: position t holds the final
    hidden state (after the last norm) that predicts completion token t."""
    first_U, inverse_B = groups
    decoder = causal_lm(model).get_decoder()
    prompt_mask_UT = batch.prompt_mask_BTp[first_U]
    prompt = decoder(input_ids=batch.prompt_ids_BTp[first_U], attention_mask=prompt_mask_UT,
                     position_ids=position_ids_from_mask(prompt_mask_UT), use_cache=True)
    cache = prompt.past_key_values
    to_rows = PromptRows(inverse_B, len(first_U))
    for layer in cache.layers:  # each row reads its prompt's keys and values; the backward sums over the rows
        layer.keys, layer.values = to_rows(layer.keys), to_rows(layer.values)
    mask_BT = torch.cat([batch.prompt_mask_BTp, batch.completion_mask_BTc], dim=1)
    Tp = batch.prompt_ids_BTp.shape[1]
    completion = decoder(input_ids=batch.completion_ids_BTc, attention_mask=mask_BT,
                         position_ids=position_ids_from_mask(mask_BT)[:, Tp:], past_key_values=cache, use_cache=True)
    # completion token 0 is predicted by the prompt's last position, token t > 0 by completion position t - 1
    return torch.cat([to_rows(prompt.last_hidden_state[:, -1:]), completion.last_hidden_state[:, :-1]], dim=1)


class PromptRows:
    """x_U[inverse_B] (each row's copy of its prompt's tensor) with a backward that sums each prompt's rows in a
    fixed order. Plain indexing's backward accumulates into repeated indices, which on a CPU with several threads
    adds them in whatever order the threads reach them: runs then differ at the last bits. Here each prompt's rows
    are an expand (whose backward is a reduction), and putting the rows back in order is a permutation (no index
    repeats)."""

    def __init__(self, inverse_B: torch.Tensor | list[int], num_prompts: int, device: torch.device | None = None):
        """inverse_B: each row's prompt, a tensor, or a list on the host (then no read back; `device`: where the
        permutation goes)."""
        host = isinstance(inverse_B, list)
        inverse_B = torch.tensor(inverse_B, dtype=torch.long) if host else inverse_B
        order_B = torch.argsort(inverse_B, stable=True)  # rows grouped by prompt, in row order within each
        self.counts = torch.bincount(inverse_B, minlength=num_prompts).tolist()
        # rows already grouped (a step's rows come prompt by prompt): no permutation needed
        self.back_B = None if bool((order_B == torch.arange(len(order_B), device=order_B.device)).all()) \
            else torch.argsort(order_B)  # grouped position of each row
        if host and self.back_B is not None:
            self.back_B = self.back_B.to(device, non_blocking=True)

    def __call__(self, x_U: torch.Tensor) -> torch.Tensor:
        grouped = torch.cat([x_U[u:u + 1].expand(n, *x_U.shape[1:]) for u, n in enumerate(self.counts) if n])
        return grouped if self.back_B is None else grouped[self.back_B]
