"""A group's prompt and its rows' completions packed into one sequence in a log-prob pass (train.pack_groups).

Shared prompts (models/shared_prompts.py) run each distinct prompt once, but the completions still run as a
[B, Tc] batch padded to the longest: in the demo 40 % of those positions are padding, and every linear map
computes them. Packed, each distinct prompt of a micro-batch becomes one sequence

    [prompt (Tp, left-padded as in the batch) | completion of its 1st row | of its 2nd row | ...]

without the completions' padding, and a 4-D attention mask lets each completion token see the prompt's real
tokens and the earlier tokens of its own completion, nothing else. Position ids are those of the unpacked row,
so every real token computes what it computes in its own row (up to the rounding of differently shaped
products: float64 hidden states agree to 1e-12 in tests/test_packed_groups.py).

The price: attention is computed for every (query, key) pair of a sequence, masked or not, so a group of long
completions costs more attention than its padded rows did. `packing_pays` compares both layouts' arithmetic
(linear maps per token, attention per pair) and packs only when that is smaller. The mask is a dense tensor
the attention reads as given (transformers' "sdpa" and "eager" attention; others are not packed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlora.models.loading import causal_lm
from rlora.models.shared_prompts import PromptRows, prompt_cache_unsupported
from rlora.tensors import position_ids_from_mask
from rlora.types import RolloutSlice

PACKABLE_ATTENTION = ("sdpa", "eager")
MAX_MASK_ELEMENTS = 1 << 26  # a [U, Ns, Ns] mask of at most 2^26 scores (256 MiB in float32): no longer packs
_PAD, _PROMPT = -2, -1  # owner codes of a packed position; a completion token's owner is its row (>= 0)
_OFF_ATTR = "_rlora_no_group_packing"


def set_group_packing(model: nn.Module, enabled: bool) -> None:
    """train.pack_groups for the log-prob passes of this model (on by default; applies where prompts are shared)."""
    setattr(causal_lm(model), _OFF_ATTR, not enabled)


def group_packing_unsupported(model: nn.Module) -> str | None:
    """Why this model's passes cannot pack groups (None: they can, where prompts are shared and it pays)."""
    hf = causal_lm(model)
    if getattr(hf, _OFF_ATTR, False):
        return "train.pack_groups=false"
    attention = getattr(hf.config, "_attn_implementation", None)
    if attention not in PACKABLE_ATTENTION:
        return f"attention '{attention}' takes no custom mask"
    if any(t != "full_attention" for t in getattr(hf.config, "layer_types", None) or []):
        return "sliding-window attention"  # the mask given as is would replace the window
    return None


@dataclass(frozen=True)
class PackedLayout:
    """Where each token of a micro-batch sits once its groups are packed; every tensor is on the batch's device.
    U sequences (one per distinct prompt) of Ns positions, N completion tokens."""

    num_positions: int  # Ns: the longest sequence (the prompt's Tp + its rows' completion lengths)
    owner_UN: torch.Tensor  # [U, Ns] _PAD, _PROMPT or the row whose completion the token belongs to
    token_seq_N: torch.Tensor  # [N] the sequence of each completion token (tokens of row 0 first, in order)
    token_slot_N: torch.Tensor  # [N] its position in that sequence
    token_row_N: torch.Tensor  # [N] its row
    token_t_N: torch.Tensor  # [N] its index in the row's completion
    # the M tokens followed by another of their row: where each sits in the flattened [U * Ns] output, and the
    # (row, t) whose next token its output predicts (completion_hidden's position t + 1)
    source_M: torch.Tensor
    target_row_M: torch.Tensor
    target_t_M: torch.Tensor
    inverse_B: tuple[int, ...]  # each row's prompt, on the host


def plan_packing(model: nn.Module, batch: RolloutSlice, groups: tuple[torch.Tensor, torch.Tensor]
                 ) -> PackedLayout | None:
    """The packed layout of a micro-batch whose rows share prompts (`groups`: models/shared_prompts.py
    prompt_groups), or None where it is not built: packing off or unsupported, a completion mask that is not a
    prefix of ones (a token after padding would be dropped), or more arithmetic than the padded layout."""
    if group_packing_unsupported(model) is not None:
        return None
    first_U, inverse_B = groups
    mask_BT = batch.completion_mask_BTc.bool()
    B, Tc = mask_BT.shape
    lengths_B = mask_BT.sum(-1)
    is_prefix = ((torch.arange(Tc, device=mask_BT.device)[None] < lengths_B[:, None]) == mask_BT).all()
    host = torch.cat([lengths_B, inverse_B, is_prefix[None].long()]).tolist()  # one read back
    if not host[-1]:
        return None
    lengths, inverse = host[:B], host[B:2 * B]
    U, Tp = len(first_U), batch.prompt_ids_BTp.shape[1]
    num_positions = Tp + max(sum(n for n, u in zip(lengths, inverse) if u == g) for g in range(U))
    if not packing_pays(U, Tp, num_positions, B, Tc, *layer_flops(model),
                        cache_pass=prompt_cache_unsupported(model) is None):
        return None
    return packed_layout(inverse, lengths, U, Tp, mask_BT.device)


def packed_layout(inverse_B: list[int], lengths_B: list[int], num_prompts: int, prompt_len: int,
                  device: torch.device) -> PackedLayout:
    """The packed layout of rows whose distinct prompt is inverse_B[b] and completion length lengths_B[b]; each
    sequence holds its prompt's Tp = prompt_len positions, then its rows' completions in row order."""
    seq_lengths = [prompt_len] * num_prompts
    offset_B = []
    for u, length in zip(inverse_B, lengths_B):
        offset_B.append(seq_lengths[u])
        seq_lengths[u] += length
    lengths = torch.tensor(lengths_B, dtype=torch.long)
    token_row_N = torch.repeat_interleave(torch.arange(len(lengths_B)), lengths)
    row_start_B = torch.cumsum(lengths, 0) - lengths
    token_t_N = torch.arange(len(token_row_N)) - row_start_B[token_row_N]
    token_seq_N = torch.tensor(inverse_B, dtype=torch.long)[token_row_N]
    token_slot_N = torch.tensor(offset_B, dtype=torch.long)[token_row_N] + token_t_N
    num_positions = max(seq_lengths)
    owner_UN = torch.full((num_prompts, num_positions), _PAD, dtype=torch.long)
    owner_UN[:, :prompt_len] = _PROMPT
    owner_UN[token_seq_N, token_slot_N] = token_row_N
    predicts_N = token_t_N < lengths[token_row_N] - 1
    source_M = (token_seq_N * num_positions + token_slot_N)[predicts_N]
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return PackedLayout(num_positions, move(owner_UN), move(token_seq_N), move(token_slot_N), move(token_row_N),
                        move(token_t_N), move(source_M), move(token_row_N[predicts_N]), move(token_t_N[predicts_N]),
                        tuple(inverse_B))


def packed_attention_mask(owner_UN: torch.Tensor, prompt_mask_UT: torch.Tensor) -> torch.Tensor:
    """[U, 1, Ns, Ns] boolean, True where query position q may read key position k: a real prompt token reads the
    real prompt tokens up to itself, a completion token the prompt's real tokens and its own completion up to
    itself, every position itself (so that no row of the attention is empty; padding reads nothing else)."""
    U, Ns = owner_UN.shape
    Tp = prompt_mask_UT.shape[1]
    owner = owner_UN.clone()
    owner[:, :Tp] = torch.where(prompt_mask_UT.bool(), _PROMPT, _PAD)  # the prompt's left padding
    index = torch.arange(Ns, device=owner.device)
    causal_NN = index[:, None] >= index[None, :]
    query, key = owner[:, :, None], owner[:, None, :]
    reads_prompt = (key == _PROMPT) & ((query >= 0) | ((query == _PROMPT) & causal_NN))
    own_completion = (query >= 0) & (query == key) & causal_NN
    return (reads_prompt | own_completion | torch.eye(Ns, dtype=torch.bool, device=owner.device))[:, None]


def packing_pays(num_prompts: int, prompt_len: int, num_positions: int, num_rows: int, completion_len: int,
                 flops_per_token: float, flops_per_pair: float, cache_pass: bool = True) -> bool:
    """Whether the packed layout costs less arithmetic per decoder layer than the pass that runs otherwise: linear
    maps cost flops_per_token for every position, attention flops_per_pair for every (query, key) pair the
    kernel computes, masked or not. cache_pass: shared prompts' pass (U prompts of Tp, then B rows of Tc on their
    prompts' keys); where it may not run (models/shared_prompts.py prompt_cache_unsupported), the unshared pass
    (B rows of Tp + Tc)."""
    packed_pairs = num_prompts * num_positions ** 2
    if packed_pairs > MAX_MASK_ELEMENTS:
        return False
    packed = num_prompts * num_positions * flops_per_token + packed_pairs * flops_per_pair
    if cache_pass:
        other = ((num_prompts * prompt_len + num_rows * completion_len) * flops_per_token
                 + (num_prompts * prompt_len ** 2 + num_rows * completion_len * (prompt_len + completion_len))
                 * flops_per_pair)
    else:
        row_len = prompt_len + completion_len
        other = num_rows * row_len * flops_per_token + num_rows * row_len ** 2 * flops_per_pair
    return packed < other


def layer_flops(model: nn.Module) -> tuple[float, float]:
    """(per token, per attention pair) multiply-adds x 2 of one decoder layer: its weights once per token, and
    QK^T plus the weighted sum of V per (query, key) pair over the heads."""
    hf = causal_lm(model)
    layer = hf.get_decoder().layers[0]
    config = hf.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weights = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
    return 2.0 * weights, 4.0 * config.num_attention_heads * head_dim


def packed_prompt_hidden(model: nn.Module, batch: RolloutSlice, groups: tuple[torch.Tensor, torch.Tensor],
                         layout: PackedLayout) -> torch.Tensor:
    """completion_hidden of `batch` with each prompt and its rows' completions run as one packed sequence ->
    [B, Tc, H]: position t holds the final hidden state that predicts completion token t. Position 0 holds the
    prompt's last state in every row (also a row without completion tokens); later padding positions hold 0."""
    first_U, _ = groups
    decoder = causal_lm(model).get_decoder()
    B, Tc = batch.completion_ids_BTc.shape
    Tp = batch.prompt_ids_BTp.shape[1]
    U, Ns = layout.owner_UN.shape
    prompt_mask_UT = batch.prompt_mask_BTp[first_U]
    ids_UN = batch.prompt_ids_BTp.new_zeros(U, Ns)
    ids_UN[:, :Tp] = batch.prompt_ids_BTp[first_U]
    positions_UN = ids_UN.new_zeros(U, Ns)
    positions_UN[:, :Tp] = position_ids_from_mask(prompt_mask_UT)
    seq_N, slot_N, row_N, t_N = layout.token_seq_N, layout.token_slot_N, layout.token_row_N, layout.token_t_N
    ids_UN[seq_N, slot_N] = batch.completion_ids_BTc[row_N, t_N]
    positions_UN[seq_N, slot_N] = prompt_mask_UT.sum(-1)[seq_N] + t_N  # a completion continues its prompt
    # added to the scores, built once in the dtype they are computed in: eager attention adds it as it is, and
    # sdpa would otherwise turn a boolean mask into such a tensor in every layer and keep each for the backward
    device = ids_UN.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else \
        decoder.get_input_embeddings().weight.dtype
    bias_U1NN = torch.zeros((U, 1, Ns, Ns), dtype=dtype, device=device).masked_fill(
        ~packed_attention_mask(layout.owner_UN, prompt_mask_UT), torch.finfo(dtype).min)
    hidden_UNH = decoder(input_ids=ids_UN, attention_mask=bias_U1NN, position_ids=positions_UN,
                         use_cache=False).last_hidden_state
    # completion token t > 0 is predicted by the position of token t - 1; each such source is read once, so the
    # backward is a gather, not an accumulation into repeated indices (whose order varies between CPU threads)
    later_BTH = hidden_UNH.new_zeros(B, max(Tc - 1, 0), hidden_UNH.shape[-1]).index_put(
        (layout.target_row_M, layout.target_t_M), hidden_UNH.reshape(U * Ns, -1)[layout.source_M])
    # completion token 0 is predicted by the prompt's last position (prompts are left-padded), shared by the rows
    first_BH = PromptRows(list(layout.inverse_B), U, device)(hidden_UNH[:, Tp - 1:Tp])
    return torch.cat([first_BH, later_BTH], dim=1)
