"""Rows' own adapters inside a mixture's sparse block, where the layers see tokens.

A sparse block (models/sparse_blocks.py) flattens its [B, T, H] rows to [B * T, H] tokens, row by row, before its
router, experts or shared expert run: a module inside sees tokens, not rows. Two features send each row through its
own adapter in one forward: several policies on one base (models/multi_lora.py, the row's policy) and rlora serve's
batched pass of several clients (models/routed_adapters.py, the row's client). Both give every token a slot (the
index of its row's adapter in a list of adapter names: the row's slot repeated T times) and call the two forwards
here for the modules peft puts in the block:

- a router's LoRA on its [E, H] weight: each slot's tokens through the family's own router module on W + that
  adapter's delta (peft's forward for that adapter alone; the router scores each token by itself);
- the fused experts' LoRA (models/expert_lora.py's layout): each token's LoRA on the activations, its expert's base
  product shared by every slot.

A linear map in the block (Qwen2-MoE's shared expert) is routed by each feature's own linear forward, given the
tokens as rows of T. The router runs once per slot present: transformers' recording of router logits (a model
called with output_router_logits=True, for its load-balancing loss) would see several calls of a layer's router
in one forward; rlora's passes never ask for them.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from rlora.models import expert_lora


def token_slots(slot_N: torch.Tensor, tokens: int) -> torch.Tensor:
    """[N * T] each token's slot, from [N] each row's, for a block fed N rows of T tokens (T = tokens // N)."""
    if tokens % max(len(slot_N), 1):
        raise RuntimeError(f"{tokens} tokens in a sparse block for {len(slot_N)} rows: rows route whole")
    return slot_N.repeat_interleave(tokens // max(len(slot_N), 1))


def token_routable(module: nn.Module, block: nn.Module) -> bool:
    """Whether the adapters on `module` (a LoRA layer inside the sparse block `block`) can be routed per token: a
    linear map, a router's [E, H] weight, or a wrapper of experts of the layout models/expert_lora.py computes."""
    if not isinstance(module, ParamWrapper) or module.num_experts == 1:
        return True
    outer = getattr(block, "experts", None)
    if not isinstance(outer, ParamWrapper):
        return False
    wrappers, experts = expert_lora.chain(outer)
    return module in wrappers.values() and expert_lora.known_layout(wrappers, experts)


def is_router(module: nn.Module) -> bool:
    """peft's LoRA on a router's [E, H] weight (a 2-D parameter; fused experts' are 3-D)."""
    return isinstance(module, ParamWrapper) and module.num_experts == 1


def is_experts(module: nn.Module, block: nn.Module) -> bool:
    """The outermost peft wrapper of the block's experts."""
    return isinstance(module, ParamWrapper) and getattr(block, "experts", None) is module


def _scattered(outputs: list, index: list[torch.Tensor], tokens: int):
    """One forward's outputs over groups of tokens, put back in token order (a tuple element by element)."""
    if isinstance(outputs[0], torch.Tensor):
        first = outputs[0]
        joined = first.new_empty((tokens, *first.shape[1:]))
        return joined.index_copy(0, torch.cat(index), torch.cat(outputs))
    return type(outputs[0])(_scattered(list(parts), index, tokens) for parts in zip(*outputs))


def router_forward(module: ParamWrapper, x_SH: torch.Tensor, slot_S: torch.Tensor, slots: list[str], *args,
                   **kwargs):
    """The router's output for tokens x_SH, token s scored on W + the delta of adapter slots[slot_S[s]] (W alone
    where that adapter is not on the router)."""
    router = module.get_base_layer()
    groups = slot_S.unique().tolist()
    if not any(slots[g] in module.lora_A for g in groups):
        return router(x_SH, *args, **kwargs)
    outputs, index = [], []
    for g in groups:
        rows = (slot_S == g).nonzero().squeeze(-1)
        if slots[g] in module.lora_A:
            weight = module.get_param() + module.get_delta_weight(slots[g])
            out = torch.func.functional_call(router, {module.parameter_name: weight}, (x_SH[rows], *args), kwargs)
        else:
            out = router(x_SH[rows], *args, **kwargs)
        outputs.append(out)
        index.append(rows)
    return _scattered(outputs, index, len(x_SH))


def experts_forward(module: ParamWrapper, hidden_SH: torch.Tensor, top_k_index_SK: torch.Tensor,
                    top_k_weights_SK: torch.Tensor, slot_S: torch.Tensor, slots: list[str]) -> torch.Tensor:
    """The experts' output with token s through adapter slots[slot_S[s]] (module: the experts' outermost wrapper)."""
    wrappers, experts = expert_lora.chain(module)
    if not any(name in w.lora_A for w in wrappers.values() for name in slots):
        return experts(hidden_SH, top_k_index_SK, top_k_weights_SK)
    return expert_lora.experts_forward(experts, wrappers, hidden_SH, top_k_index_SK, top_k_weights_SK,
                                       slots=slots, slot_S=slot_S.to(hidden_SH.device))
