"""peft's LoRA on a mixture's fused experts, computed on the activations.

peft adapts transformers' fused expert parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) with a
ParamWrapper: every forward it builds W + s * B @ A for all E experts, runs the experts on that, and its backward
forms the gradient of the whole [E, out, in] stack before reducing it to A's and B's. That is a second copy of the
experts' weights per forward and a product the size of the base's own per token in the backward, for an adapter
whose rank is 16. Here each expert's tokens take the base product and the LoRA's two thin products instead,

    h = W_e x + s * B_e (A_e x)

with expert e's factors A_e [r, in], B_e [out, r] read from peft's own parameters (its layout: lora_A [E * r, in],
lora_B [out, r * E]), so the adapter, its saved form and every other peft path stay peft's. The same numbers as
peft's forward up to rounding (tests/test_expert_lora.py: outputs and gradients in float64).

install() puts this forward on the outermost ParamWrapper of each experts module whose layout it knows (a gated,
concatenated [gate; up], untransposed, bias-free experts module of transformers' common form: tested on Mixtral,
Qwen3-MoE and OLMoE, the same form as other families peft adapts this way); any other stays on peft's path. It runs
on a CPU, where it is measured (docs/benchmarks.md); on a GPU, and with the adapters off or merged, the wrapper runs
peft's forward.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from rlora.models.sparse_blocks import is_sparse_block

PROJECTIONS = ("gate_up_proj", "down_proj")
_INSTALLED = "_rlora_activation_side"


def chain(outer: nn.Module) -> tuple[dict[str, ParamWrapper], nn.Module]:
    """The ParamWrappers nested from `outer` inward, by the parameter each adapts, and the module they wrap."""
    wrappers, module = {}, outer
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return wrappers, module


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # not peft's float8 path: F.linear reads these


def known_layout(wrappers: dict[str, ParamWrapper], experts: nn.Module) -> bool:
    layout = (getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)
              and not getattr(experts, "is_transposed", True) and not getattr(experts, "has_bias", True)
              and not getattr(experts, "has_post_expert_norm", True))
    # peft swaps in/out for parameters stored [E, out, in] (what F.linear reads); the factors below assume that
    return bool(layout) and set(wrappers) <= set(PROJECTIONS) and all(
        w._did_swap_in_out_features and w.num_experts == experts.num_experts and w.get_param().dtype in _DTYPES
        for w in wrappers.values())


def _factors(wrapper: ParamWrapper | None, names: list[str] | None = None):
    """Per adapter of `names` on one wrapper (None: the wrapper's active adapters): (each expert's A [r, in], each
    expert's B [out, r], scale); [] when none is on it. Unbound once per forward: indexing a factor per expert would
    make each index's backward a zero-filled gradient of the whole stack."""
    if wrapper is None:
        return []
    out = []
    for name in wrapper.active_adapters if names is None else names:
        if name not in wrapper.lora_A:
            continue
        A = wrapper.lora_A[name].weight  # [E * r, in], expert-major
        B = wrapper.lora_B[name].weight  # [out, r * E], rank-major: column j * E + e is expert e's j-th
        E = wrapper.num_experts
        out.append((A.view(E, -1, A.shape[-1]).unbind(0), B.view(B.shape[0], -1, E).permute(2, 0, 1).unbind(0),
                    wrapper.scaling[name]))
    return out


def _lora(x_NI: torch.Tensor, factors, expert: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The sum of the adapters' s B_e (A_e x) for expert e, in `dtype`; None where no adapter is on."""
    delta = None
    for A_RI, B_OR, scale in factors:
        lora_in = x_NI.to(A_RI[expert].dtype)  # the adapter's own dtype, as peft's Linear casts its input
        # the scale on the rank's r columns, not the output's
        term = F.linear(F.linear(lora_in, A_RI[expert]) * scale, B_OR[expert]).to(dtype)
        delta = term if delta is None else delta + term
    return delta


def _project(x_NI: torch.Tensor, weight_OI: torch.Tensor, factors_per_slot, expert: int,
             slot_counts: list[int]) -> torch.Tensor:
    """One expert's product W_e x for all its rows at once, plus each slot's LoRA on that slot's rows (consecutive,
    slot_counts of them each)."""
    y_NO = F.linear(x_NI, weight_OI)
    if len(slot_counts) == 1:
        delta = _lora(x_NI, factors_per_slot[0], expert, y_NO.dtype)
        return y_NO if delta is None else y_NO.add_(delta)  # in place: a product's backward needs no output
    deltas = [_lora(x, factors, expert, y_NO.dtype) if len(x) else None
              for x, factors in zip(x_NI.split(slot_counts), factors_per_slot)]
    if all(d is None for d in deltas):
        return y_NO
    return y_NO + torch.cat([y_NO.new_zeros(n, y_NO.shape[-1]) if d is None else d
                             for d, n in zip(deltas, slot_counts)])


def experts_forward(experts: nn.Module, wrappers: dict[str, ParamWrapper], hidden_SH: torch.Tensor,
                    top_k_index_SK: torch.Tensor, top_k_weights_SK: torch.Tensor,
                    slots: list[str] | None = None, slot_S: torch.Tensor | None = None) -> torch.Tensor:
    """The experts module's output [S, H] for its S tokens' top-K choices, each projection with its LoRA on the
    activations. slots / slot_S: token s runs through adapter slots[slot_S[s]] alone (rlora serve's batched pass of
    several clients); None: every token through the wrappers' active adapters. Tokens are sorted by (expert, slot):
    each expert's rows are one slice (one split: its backward concatenates the slices' gradients once), its base
    product one call, and each slot's rows a slice within it."""
    S, K = top_k_index_SK.shape
    E, G = experts.num_experts, 1 if slots is None else len(slots)
    expert_ids = top_k_index_SK.reshape(-1)
    key = expert_ids if slot_S is None else expert_ids * G + slot_S.repeat_interleave(K)
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=E * G).tolist()[:E * G]  # host sizes to split by
    routed = order[:sum(counts)]  # ids past the last expert (an expert-parallel sentinel) sort last and are dropped
    token_of = routed // K
    out = hidden_SH.new_zeros(S, hidden_SH.shape[-1])
    if len(routed) == 0:
        return out
    names = [None] if slots is None else [[name] for name in slots]
    gate_up = [_factors(wrappers.get("gate_up_proj"), n) for n in names]
    down = [_factors(wrappers.get("down_proj"), n) for n in names]
    per_expert = [sum(counts[e * G:(e + 1) * G]) for e in range(E)]
    pieces = []
    for expert, x_NH in enumerate(hidden_SH[token_of].split(per_expert)):
        if len(x_NH) == 0:
            continue
        slot_counts = counts[expert * G:(expert + 1) * G]
        h_N2I = _project(x_NH, experts.gate_up_proj[expert], gate_up, expert, slot_counts)
        pieces.append(_project(experts._apply_gate(h_N2I), experts.down_proj[expert], down, expert, slot_counts))
    # the routing weights as the router gave them (float32 on Mixtral): one rounding, into the output's dtype
    y_sorted = torch.cat(pieces) * top_k_weights_SK.reshape(-1)[routed, None]
    return out.index_add(0, token_of, y_sorted.to(out.dtype))


def activation_side_forward(self: ParamWrapper, hidden_SH: torch.Tensor, top_k_index_SK: torch.Tensor,
                             top_k_weights_SK: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The outermost experts wrapper's forward (bound to it, so that a copy of the model computes with its own)."""
    wrappers, experts = chain(self)
    off = any(w.disable_adapters or w.merged for w in wrappers.values())
    # a CPU only: on a GPU transformers' grouped kernel against this loop over experts is not measured yet
    if (off or args or kwargs or hidden_SH.device.type != "cpu"
            or not any(_factors(w) for w in wrappers.values())):
        return ParamWrapper.forward(self, hidden_SH, top_k_index_SK, top_k_weights_SK, *args, **kwargs)
    return experts_forward(experts, wrappers, hidden_SH, top_k_index_SK, top_k_weights_SK)


def experts_wrapper(module: nn.Module) -> bool:
    """Whether `module` is an outermost experts wrapper running the activation-side forward."""
    return getattr(module, _INSTALLED, False)


def install(model: nn.Module) -> int:
    """The activation-side forward on every adapted experts module of known layout in the model's sparse blocks
    (idempotent; reads the adapters at each call, so adapters added later on the same wrappers are included).
    -> how many experts modules run it."""
    count = 0
    for block in model.modules():
        outer = getattr(block, "experts", None) if is_sparse_block(block) else None
        if not isinstance(outer, ParamWrapper):
            continue
        # a forward set on the instance by someone else (several policies, models/multi_lora.py) stays theirs
        if not experts_wrapper(outer) and "forward" not in vars(outer) and known_layout(*chain(outer)):
            outer.forward = types.MethodType(activation_side_forward, outer)
            setattr(outer, _INSTALLED, True)
        count += experts_wrapper(outer)
    return count


def uninstall(model: nn.Module) -> None:
    """peft's own forward back on every experts module (benchmarks compare the two; tests check parity)."""
    for module in model.modules():
        if getattr(module, _INSTALLED, False):
            del module.forward
            delattr(module, _INSTALLED)
