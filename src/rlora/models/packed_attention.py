"""The attention of a packed pass (models/packed_groups.py) computed by its structure instead of a dense mask.

A packed sequence is [prompt (Tp) | completion of row a | of row b | ...]. With a dense [Ns, Ns] mask the kernel
computes every (query, key) pair of the sequence, masked or not: a bin of G rows of length L costs (Tp + G L)^2
pairs where only G L (Tp + L) are read, and the mask itself grows with Ns^2. Here each layer runs two attentions:

- the prompts' positions over their own real tokens (causal), [S, H, Tp, Tp];
- every row's completion over its prompt's keys and its own completion's (causal), the rows padded to the
  longest completion L: [B, H, L, Tp + L], as in shared prompts' cache pass (models/shared_prompts.py);

and puts the results back at the packed positions. The linear maps still run on the packed tokens only, which is
what packing saves; attention costs what shared prompts' cache pass's does (plus S x Tp^2 for a prompt copied to
several bins), whatever the bins' lengths. On a CPU both run in float32 where the model's or autocast's dtype is a
half precision: there sdpa's bf16 kernel took twice float32's time for such row blocks (16 rows x 9 heads of 48 x
94 scores, forward and backward: 15.3 against 7.4 ms with the casts, machine C in docs/benchmarks.md); the float32
copies of the gathered q/k/v it keeps for the backward are the price.

transformers' attention modules call the function registered under config._attn_implementation with the
keyword arguments of the decoder's call: `structured_attention` switches the implementation for one decoder
call and the layout travels as the `rlora_packed` keyword. Padding positions of the gathered rows read a zero
position appended to each sequence and their outputs are dropped, so every gradient that reaches the packed
positions comes from real tokens (exact zeros from the rest) and no index repeats among real positions in the
backward (the appended position's, which repeats, is dropped).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from rlora.models.shared_prompts import PromptRows

STRUCTURED_ATTENTION = "rlora_packed"


@dataclass(frozen=True)
class PackedAttention:
    """Where a packed pass's tokens are, for the attention of each layer. S sequences of Ns positions (the first Tp
    the prompt's), B rows whose completions are at most L tokens, N completion tokens; tensors on the batch's
    device, biases in the dtype the scores are computed in (0 where a query reads a key, the dtype's min where not)."""

    prompt_len: int  # Tp
    prompt_bias_S1PP: torch.Tensor  # a prompt position reads its prompt's real tokens up to itself (and itself)
    row_bias_B1LK: torch.Tensor  # [B, 1, L, Tp + L] a completion token reads its prompt's real tokens, then its
    # own completion up to itself
    sequence_rows: PromptRows  # each row's copy of its sequence's prompt keys and values (a fixed-order backward)
    seq_BL: torch.Tensor  # [B, L] the sequence of row b's completion token t
    slot_BL: torch.Tensor  # [B, L] its position there; Ns (the appended zero position) where t is past the row's end
    row_N: torch.Tensor  # [N] the row of each completion token
    t_N: torch.Tensor  # [N] its index in the row's completion
    output_index: torch.Tensor  # [S * Tp + N] flat positions (s * Ns + slot): the prompts' positions, then the tokens'


def attention_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed pass attends in, given the one its scores would be computed in: float32 for half precision
    on a CPU."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def plan_structured_attention(prompt_mask_ST: torch.Tensor, sequence_B: list[int], seq_N: torch.Tensor,
                              slot_N: torch.Tensor, row_N: torch.Tensor, t_N: torch.Tensor, num_positions: int,
                              longest: int, dtype: torch.dtype) -> PackedAttention:
    """The plan of a packed layout (models/packed_groups.py PackedLayout's fields): S = len(prompt_mask_ST)
    sequences of num_positions, each headed by a prompt whose real tokens prompt_mask_ST marks; row b in sequence
    sequence_B[b]; completion token i of row row_N[i] at index t_N[i] of its completion sits at slot_N[i] of
    sequence seq_N[i]; `longest`: the longest completion (known on the host: no read back). dtype: the scores'
    (the model's, or autocast's); the attention runs in attention_dtype."""
    S, Tp = prompt_mask_ST.shape
    device = prompt_mask_ST.device
    dtype = attention_dtype(device, dtype)
    B = len(sequence_B)
    L = max(longest, 1)
    prompt_real_ST = prompt_mask_ST.bool()
    index = torch.arange(max(Tp, L), device=device)
    causal_PP = index[:Tp, None] >= index[None, :Tp]
    reads_SPP = (prompt_real_ST[:, None, :] & causal_PP) | torch.eye(Tp, dtype=torch.bool, device=device)
    sequence_B_t = torch.tensor(sequence_B, dtype=torch.long, device=device)
    causal_LL = index[:L, None] >= index[None, :L]
    reads_BLK = torch.cat([prompt_real_ST[sequence_B_t][:, None, :].expand(B, L, Tp), causal_LL.expand(B, L, L)], -1)
    seq_BL = sequence_B_t[:, None].expand(B, L).clone()
    slot_BL = torch.full((B, L), num_positions, dtype=torch.long, device=device)
    slot_BL[row_N, t_N] = slot_N
    prompt_positions = (torch.arange(S, device=device)[:, None] * num_positions + index[None, :Tp]).reshape(-1)
    return PackedAttention(Tp, _bias(reads_SPP[:, None], dtype), _bias(reads_BLK[:, None], dtype),
                           PromptRows(list(sequence_B), S, device), seq_BL, slot_BL, row_N, t_N,
                           torch.cat([prompt_positions, seq_N * num_positions + slot_N]))


def _bias(reads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scores' additive mask: 0 where the query reads the key, the dtype's min where not (no -inf: no NaN even in a
    row of padding whose outputs are dropped)."""
    return torch.zeros(reads.shape, dtype=dtype, device=reads.device).masked_fill(~reads, torch.finfo(dtype).min)


def _packed_attention(module: nn.Module, query_SHNd: torch.Tensor, key_SKNd: torch.Tensor, value_SKNd: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      rlora_packed: PackedAttention | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface for a packed decoder call -> ([S, Ns, H, d] outputs, no weights)."""
    plan = rlora_packed
    if plan is None:
        raise RuntimeError(f"attention '{STRUCTURED_ATTENTION}' runs only inside rlora's packed passes")
    for unsupported in ("softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"a packed pass cannot apply attention's {unsupported}: set train.pack_groups=false")
    window, span = kwargs.get("sliding_window"), plan.row_bias_B1LK.shape[-1]  # span: a row's prompt + completion
    if window is not None and window < span:  # a longer window (Phi-3.5's 262144) never applies
        raise ValueError(f"a packed pass cannot apply a sliding window of {window} to rows of up to {span} positions: "
                         "set train.pack_groups=false")
    S, H, Ns, _ = query_SHNd.shape
    Tp = plan.prompt_len
    gqa = key_SKNd.shape[1] != H
    if gqa and not _gqa_with_a_mask_is_fast(query_SHNd.device):
        key_SKNd, value_SKNd = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (key_SKNd, value_SKNd))
        gqa = False
    # under autocast q and k may come out of the rotary in float32 while v is a bf16 product: v's dtype is the
    # layer's; all three are cast to the plan's (float32 for half precision on a CPU: attention_dtype)
    given, compute = value_SKNd.dtype, plan.prompt_bias_S1PP.dtype
    query_SHNd, key_SKNd, value_SKNd = (x.to(compute) for x in (query_SHNd, key_SKNd, value_SKNd))

    def attend(q, k, v, bias):
        with torch.autocast(q.device.type, enabled=False):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout, scale=scaling,
                                                  enable_gqa=gqa)

    prompt_SHPd = attend(query_SHNd[:, :, :Tp], key_SKNd[:, :, :Tp], value_SKNd[:, :, :Tp], plan.prompt_bias_S1PP)

    def rows(x_SXNd: torch.Tensor) -> torch.Tensor:  # [S, X, Ns, d] -> each row's completion [B, X, L, d]
        return F.pad(x_SXNd, (0, 0, 0, 1))[plan.seq_BL, :, plan.slot_BL].transpose(1, 2)

    def with_prompt(x_SKNd: torch.Tensor) -> torch.Tensor:  # -> [B, K, Tp + L, d]
        return torch.cat([plan.sequence_rows(x_SKNd[:, :, :Tp]), rows(x_SKNd)], dim=2)

    rows_BHLd = attend(rows(query_SHNd), with_prompt(key_SKNd), with_prompt(value_SKNd), plan.row_bias_B1LK)
    dv = value_SKNd.shape[-1]  # the outputs' head size (v's, which may differ from q's)
    values = torch.cat([prompt_SHPd.transpose(1, 2).reshape(S * Tp, H, dv), rows_BHLd[plan.row_N, :, plan.t_N]])
    out = values.new_zeros(S * Ns, H, dv).index_put((plan.output_index,), values)  # backward: a gather
    return out.view(S, Ns, H, dv).to(given), None


def _gqa_with_a_mask_is_fast(device: torch.device) -> bool:
    """sdpa's enable_gqa with a mask runs in the CPU's flash kernel; CUDA's takes it only in its math kernel (which
    keeps the attention probabilities for the backward), so there the key/value heads are repeated instead."""
    return device.type == "cpu"


AttentionInterface.register(STRUCTURED_ATTENTION, _packed_attention)


@contextmanager
def structured_attention(hf_model: nn.Module):
    """The decoder's attention modules call _packed_attention inside (one decoder call: not across a backward that
    recomputes the forward, as gradient checkpointing does). The decoder's config is switched (the one its layers
    read); the setter also writes the sub-configs, so each config gets its own value back afterwards."""
    config = hf_model.get_decoder().config
    configs = _with_sub_configs(config)
    before = [c._attn_implementation for c in configs]
    config._attn_implementation = STRUCTURED_ATTENTION
    try:
        yield
    finally:
        for c, value in zip(configs, before):  # parents before their sub-configs: each setter's copy is overwritten
            c._attn_implementation = value


def _with_sub_configs(config) -> list:
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            found += _with_sub_configs(sub)
    return found
