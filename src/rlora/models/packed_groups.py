"""A group's prompt and its rows' completions packed into sequences in a log-prob pass (train.pack_groups).

Shared prompts (models/shared_prompts.py) run each distinct prompt once, but the completions still run as a
[B, Tc] batch padded to the longest: in the demo 40 % of those positions are padding, and every linear map
computes them. Packed, each distinct prompt of a micro-batch becomes one sequence or a few ("bins")

    [prompt (Tp, left-padded as in the batch) | completion of one of its rows | of another | ...]

without the completions' padding; each completion token sees the prompt's real tokens and the earlier tokens of
its own completion, nothing else. Position ids are those of the unpacked row, so every real token computes what it
computes in its own row (up to the rounding of differently shaped products: float64 hidden states agree to 1e-12 in
tests/test_packed_groups.py).

Attention runs by the layout's structure (models/packed_attention.py: the prompts over themselves, each row over
its prompt and itself), so it costs what shared prompts' cache pass's does. A pass whose backward recomputes the forward
(gradient checkpointing) attends with a dense 4-D mask instead, which transformers' "sdpa" and "eager" attention
read as given (others are not packed); there every (query, key) pair of a sequence is computed, masked or not, so a
group of long completions in one sequence costs more attention than its padded rows did. Long rows may therefore
go into several bins of a prompt, each holding at most `capacity` completion tokens (first-fit, longest rows first;
a copy of the prompt heads each bin). `cheapest_capacity` weighs the layouts' arithmetic (linear maps per token,
attention per pair) for a few capacities and packs only when the cheapest costs less than the pass that runs
otherwise. Neither way applies a sliding window, so a micro-batch whose padded rows reach one is not packed
(window_reached; the cache pass applies it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlora.models.loading import activation_checkpointing, causal_lm, reachable_window
from rlora.models.packed_attention import plan_structured_attention, structured_attention
from rlora.models.shared_prompts import PromptRows, prompt_cache_unsupported
from rlora.tensors import position_ids_from_mask
from rlora.types import RolloutSlice

PACKABLE_ATTENTION = ("sdpa", "eager")
MAX_MASK_ELEMENTS = 1 << 26  # an [S, Ns, Ns] mask of at most 2^26 scores (256 MiB in float32): no longer packs
_PAD, _PROMPT = -2, -1  # owner codes of a packed position; a completion token's owner is its row (>= 0)
_OFF_ATTR = "_rlora_no_group_packing"


def set_group_packing(model: nn.Module, enabled: bool) -> None:
    """train.pack_groups for the log-prob passes of this model (on by default; applies where prompts are shared)."""
    setattr(causal_lm(model), _OFF_ATTR, not enabled)


def group_packing_unsupported(model: nn.Module, batch: RolloutSlice) -> str | None:
    """Why this model's pass over `batch` cannot pack groups (None: it can, where prompts are shared and it pays)."""
    hf = causal_lm(model)
    if getattr(hf, _OFF_ATTR, False):
        return "train.pack_groups=false"
    attention = getattr(hf.config, "_attn_implementation", None)
    if attention not in PACKABLE_ATTENTION:
        return f"attention '{attention}' takes no custom mask"
    if getattr(hf.config, "attn_logit_softcapping", None) is not None:  # the packed attention has no cap
        return "attention logit soft-capping"
    return window_reached(hf.config, batch)  # the packed attention has no window


def attention_window(config) -> int | None:
    """The shortest window a layer attends within (None: every layer attends over the whole row; 0: a layer of
    another kind than full or sliding-window attention). From the layer types, or a window set without them
    (Mistral's and Phi-3's configs; use_sliding_window=false turns Qwen2's off) that is shorter than the model's
    positions (Phi-3.5/4-mini's 262144 against 131072 positions never applies)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind not in ("full_attention", "sliding_attention") for kind in layer_types):
        return 0
    window = getattr(config, "sliding_window", None)
    if layer_types and "sliding_attention" not in layer_types:
        return None
    if not layer_types and getattr(config, "use_sliding_window", True) is False:
        return None
    return reachable_window(config, window)


def window_reached(config, batch: RolloutSlice) -> str | None:
    """Why a window would cut what `batch`'s rows attend to (None: it would not). A window of W lets a token see the
    keys fewer than W positions before it; a row's real tokens sit side by side in its padded row, so in a micro-batch
    of Tp + Tc <= W positions (padded prompt and completion widths: no row is longer) no window cuts, and its packed
    pass, which attends without one, equals its unshared one. RL rows are mostly far shorter than the 2047-4096
    token windows of Phi-3-mini-4k or Mistral-7B-v0.1; longer ones run the cache pass (models/shared_prompts.py),
    whose attention is the model's own, window included."""
    window = attention_window(config)
    positions = batch.prompt_ids_BTp.shape[1] + batch.completion_ids_BTc.shape[1]
    if window is None or positions <= window:
        return None
    if window == 0:
        return "attention layers of another kind than full or sliding-window"
    return f"a sliding window of {window} positions over rows of {positions}"


@dataclass(frozen=True)
class PackedLayout:
    """Where each token of a micro-batch sits once its groups are packed; every tensor is on the batch's device.
    S sequences (bins: one or more per distinct prompt) of Ns positions, N completion tokens."""

    num_positions: int  # Ns: the longest sequence (the prompt's Tp + the completion lengths of its bin's rows)
    owner_SN: torch.Tensor  # [S, Ns] _PAD, _PROMPT or the row whose completion the token belongs to
    prompt_S: torch.Tensor  # [S] the distinct prompt (index into prompt_groups' first rows) that heads each sequence
    token_seq_N: torch.Tensor  # [N] the sequence of each completion token (tokens of row 0 first, in order)
    token_slot_N: torch.Tensor  # [N] its position in that sequence
    token_row_N: torch.Tensor  # [N] its row
    token_t_N: torch.Tensor  # [N] its index in the row's completion
    # the M tokens followed by another of their row: where each sits in the flattened [S * Ns] output, and the
    # (row, t) whose next token its output predicts (completion_hidden's position t + 1)
    source_M: torch.Tensor
    target_row_M: torch.Tensor
    target_t_M: torch.Tensor
    sequence_B: tuple[int, ...]  # each row's sequence, on the host
    longest: int  # the longest completion, on the host
    structured: bool = True  # attention by the layout's structure (models/packed_attention.py), else a dense mask


def plan_packing(model: nn.Module, batch: RolloutSlice, groups: tuple[torch.Tensor, torch.Tensor]
                 ) -> PackedLayout | None:
    """The packed layout of a micro-batch whose rows share prompts (`groups`: models/shared_prompts.py
    prompt_groups), or None where it is not built: packing off or unsupported, a completion mask that is not a
    prefix of ones (a token after padding would be dropped), or more arithmetic than the padded layout."""
    if group_packing_unsupported(model, batch) is not None:
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
    structured = not recomputes_forward(model)
    capacity = cheapest_capacity(inverse, lengths, U, Tp, Tc, *layer_flops(model),
                                 cache_pass=prompt_cache_unsupported(model) is None, structured=structured)
    if capacity is None:
        return None
    return packed_layout(inverse, lengths, U, Tp, mask_BT.device, capacity, structured)


def recomputes_forward(model: nn.Module) -> bool:
    """Whether this pass's backward runs the decoder layers again (gradient checkpointing, in passes with gradient):
    they would then attend as the model's own attention does, so such a pass keeps the dense mask."""
    hf = causal_lm(model)
    return bool(activation_checkpointing(hf) and hf.training and torch.is_grad_enabled())


def assign_bins(inverse_B: list[int], lengths_B: list[int], num_prompts: int, capacity: int | None
                ) -> tuple[list[int], list[int], list[int]]:
    """Rows into bins of at most `capacity` completion tokens (None: one bin per prompt), each bin holding rows of
    one prompt: first-fit with each prompt's rows longest first (ties in row order), a row longer than the capacity
    alone in its bin, a row without completion tokens in its prompt's first bin -> (each row's bin, each bin's
    prompt, each bin's completion tokens); bins are numbered prompt by prompt, in the order they were opened."""
    rows_U: list[list[int]] = [[] for _ in range(num_prompts)]
    for b, u in enumerate(inverse_B):
        rows_U[u].append(b)
    bin_B = [0] * len(inverse_B)
    prompt_S: list[int] = []
    fill_S: list[int] = []
    for u, rows in enumerate(rows_U):
        first_bin = len(prompt_S)
        for b in sorted(rows, key=lambda b: -lengths_B[b]):  # a stable sort: ties stay in row order
            length = lengths_B[b]
            s = next((s for s in range(first_bin, len(prompt_S))
                      if capacity is None or length == 0 or fill_S[s] + length <= capacity), None)
            if s is None:
                s = len(prompt_S)
                prompt_S.append(u)
                fill_S.append(0)
            bin_B[b] = s
            fill_S[s] += length
    return bin_B, prompt_S, fill_S


def cheapest_capacity(inverse_B: list[int], lengths_B: list[int], num_prompts: int, prompt_len: int,
                      completion_len: int, flops_per_token: float, flops_per_pair: float, cache_pass: bool = True,
                      structured: bool = False) -> int | None:
    """The bin capacity (completion tokens per packed sequence) whose layout costs the least arithmetic, tried at
    1, 2, 4, ... times the longest completion up to a whole prompt's rows in one bin; None where even that costs
    more than the pass that runs otherwise (packing_pays) or, with the dense mask, its mask would be too large.
    structured: attention by the layout (packed_attention.py), whose pairs depend on the bins only through the
    prompt's copies, else with a dense mask."""
    longest = max(max(lengths_B, default=0), 1)
    most = max((sum(n for n, u in zip(lengths_B, inverse_B) if u == p) for p in range(num_prompts)), default=0)
    best: tuple[float, int] | None = None
    capacity = longest
    while True:
        _, prompt_S, fill_S = assign_bins(inverse_B, lengths_B, num_prompts, capacity)
        if structured:
            cost = structured_cost(len(prompt_S), prompt_len + max(fill_S), len(lengths_B), prompt_len, longest,
                                   flops_per_token, flops_per_pair)
        else:
            cost = packed_cost(len(prompt_S), prompt_len + max(fill_S), flops_per_token, flops_per_pair)
        if cost is not None and (best is None or cost < best[0]):
            best = (cost, capacity)
        if capacity >= most:
            break
        capacity *= 2
    if best is None or not packing_pays(best[0], num_prompts, prompt_len, len(lengths_B), completion_len,
                                        flops_per_token, flops_per_pair, cache_pass):
        return None
    return best[1]


def packed_layout(inverse_B: list[int], lengths_B: list[int], num_prompts: int, prompt_len: int,
                  device: torch.device, capacity: int | None = None, structured: bool = True) -> PackedLayout:
    """The packed layout of rows whose distinct prompt is inverse_B[b] and completion length lengths_B[b], in bins
    of at most `capacity` completion tokens (assign_bins; None: one sequence per prompt). Each sequence holds its
    prompt's Tp = prompt_len positions, then the completions of its bin's rows in row order."""
    sequence_B, prompt_S, _ = assign_bins(inverse_B, lengths_B, num_prompts, capacity)
    seq_lengths = [prompt_len] * len(prompt_S)
    offset_B = []
    for s, length in zip(sequence_B, lengths_B):
        offset_B.append(seq_lengths[s])
        seq_lengths[s] += length
    lengths = torch.tensor(lengths_B, dtype=torch.long)
    token_row_N = torch.repeat_interleave(torch.arange(len(lengths_B)), lengths)
    row_start_B = torch.cumsum(lengths, 0) - lengths
    token_t_N = torch.arange(len(token_row_N)) - row_start_B[token_row_N]
    token_seq_N = torch.tensor(sequence_B, dtype=torch.long)[token_row_N]
    token_slot_N = torch.tensor(offset_B, dtype=torch.long)[token_row_N] + token_t_N
    num_positions = max(seq_lengths)
    owner_SN = torch.full((len(prompt_S), num_positions), _PAD, dtype=torch.long)
    owner_SN[:, :prompt_len] = _PROMPT
    owner_SN[token_seq_N, token_slot_N] = token_row_N
    predicts_N = token_t_N < lengths[token_row_N] - 1
    source_M = (token_seq_N * num_positions + token_slot_N)[predicts_N]
    move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
    return PackedLayout(num_positions, move(owner_SN), move(torch.tensor(prompt_S, dtype=torch.long)),
                        move(token_seq_N), move(token_slot_N), move(token_row_N), move(token_t_N), move(source_M),
                        move(token_row_N[predicts_N]), move(token_t_N[predicts_N]), tuple(sequence_B),
                        max(lengths_B, default=0), structured)


def packed_attention_mask(owner_SN: torch.Tensor, prompt_mask_ST: torch.Tensor) -> torch.Tensor:
    """[S, 1, Ns, Ns] boolean, True where query position q may read key position k: a real prompt token reads the
    real prompt tokens up to itself, a completion token the prompt's real tokens and its own completion up to
    itself, every position itself (so that no row of the attention is empty; padding reads nothing else)."""
    Ns = owner_SN.shape[1]
    Tp = prompt_mask_ST.shape[1]
    owner = owner_SN.clone()
    owner[:, :Tp] = torch.where(prompt_mask_ST.bool(), _PROMPT, _PAD)  # the prompt's left padding
    index = torch.arange(Ns, device=owner.device)
    causal_NN = index[:, None] >= index[None, :]
    query, key = owner[:, :, None], owner[:, None, :]
    reads_prompt = (key == _PROMPT) & ((query >= 0) | ((query == _PROMPT) & causal_NN))
    own_completion = (query >= 0) & (query == key) & causal_NN
    return (reads_prompt | own_completion | torch.eye(Ns, dtype=torch.bool, device=owner.device))[:, None]


def packed_cost(num_sequences: int, num_positions: int, flops_per_token: float, flops_per_pair: float
                ) -> float | None:
    """Arithmetic per decoder layer of S packed sequences of Ns positions: linear maps flops_per_token for every
    position, attention flops_per_pair for every (query, key) pair the kernel computes, masked or not; None where
    the [S, Ns, Ns] mask would exceed MAX_MASK_ELEMENTS."""
    pairs = num_sequences * num_positions ** 2
    if pairs > MAX_MASK_ELEMENTS:
        return None
    return num_sequences * num_positions * flops_per_token + pairs * flops_per_pair


def structured_cost(num_sequences: int, num_positions: int, num_rows: int, prompt_len: int, longest: int,
                    flops_per_token: float, flops_per_pair: float) -> float:
    """packed_cost with attention by the layout's structure: the prompts over themselves, each row's completion
    (padded to the longest) over its prompt and itself."""
    pairs = num_sequences * prompt_len ** 2 + num_rows * longest * (prompt_len + longest)
    return num_sequences * num_positions * flops_per_token + pairs * flops_per_pair


def packing_pays(packed: float, num_prompts: int, prompt_len: int, num_rows: int, completion_len: int,
                 flops_per_token: float, flops_per_pair: float, cache_pass: bool = True) -> bool:
    """Whether the packed layout's arithmetic (packed_cost) is less than that of the pass that runs otherwise, per
    decoder layer. cache_pass: shared prompts' pass (U prompts of Tp, then B rows of Tc on their prompts' keys);
    where it may not run (models/shared_prompts.py prompt_cache_unsupported), the unshared pass (B rows of
    Tp + Tc)."""
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
    """completion_hidden of `batch` with each prompt and its rows' completions run packed (one sequence per bin) ->
    [B, Tc, H]: position t holds the final hidden state that predicts completion token t. Position 0 holds the
    prompt's last state in every row (also a row without completion tokens); later padding positions hold 0."""
    first_U, _ = groups
    decoder = causal_lm(model).get_decoder()
    B, Tc = batch.completion_ids_BTc.shape
    Tp = batch.prompt_ids_BTp.shape[1]
    S, Ns = layout.owner_SN.shape
    first_S = first_U[layout.prompt_S]  # the first row of each sequence's prompt
    prompt_mask_ST = batch.prompt_mask_BTp[first_S]
    ids_SN = batch.prompt_ids_BTp.new_zeros(S, Ns)
    ids_SN[:, :Tp] = batch.prompt_ids_BTp[first_S]
    positions_SN = ids_SN.new_zeros(S, Ns)
    positions_SN[:, :Tp] = position_ids_from_mask(prompt_mask_ST)
    seq_N, slot_N, row_N, t_N = layout.token_seq_N, layout.token_slot_N, layout.token_row_N, layout.token_t_N
    ids_SN[seq_N, slot_N] = batch.completion_ids_BTc[row_N, t_N]
    positions_SN[seq_N, slot_N] = prompt_mask_ST.sum(-1)[seq_N] + t_N  # a completion continues its prompt
    # added to the scores, built once in the dtype they are computed in: eager attention adds it as it is, and
    # sdpa would otherwise turn a boolean mask into such a tensor in every layer and keep each for the backward
    device = ids_SN.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else \
        decoder.get_input_embeddings().weight.dtype
    if layout.structured:
        plan = plan_structured_attention(prompt_mask_ST, list(layout.sequence_B), seq_N, slot_N, row_N, t_N, Ns,
                                         layout.longest, dtype)
        with structured_attention(causal_lm(model)):
            hidden_SNH = decoder(input_ids=ids_SN, position_ids=positions_SN, use_cache=False,
                                 rlora_packed=plan).last_hidden_state
    else:
        bias_S1NN = torch.zeros((S, 1, Ns, Ns), dtype=dtype, device=device).masked_fill(
            ~packed_attention_mask(layout.owner_SN, prompt_mask_ST), torch.finfo(dtype).min)
        hidden_SNH = decoder(input_ids=ids_SN, attention_mask=bias_S1NN, position_ids=positions_SN,
                             use_cache=False).last_hidden_state
    # completion token t > 0 is predicted by the position of token t - 1; each such source is read once, so the
    # backward is a gather, not an accumulation into repeated indices (whose order varies between CPU threads)
    later_BTH = hidden_SNH.new_zeros(B, max(Tc - 1, 0), hidden_SNH.shape[-1]).index_put(
        (layout.target_row_M, layout.target_t_M), hidden_SNH.reshape(S * Ns, -1)[layout.source_M])
    # completion token 0 is predicted by the prompt's last position (prompts are left-padded), that of the row's
    # own sequence, shared by the rows of that sequence
    first_BH = PromptRows(list(layout.sequence_B), S, device)(hidden_SNH[:, Tp - 1:Tp])
    return torch.cat([first_BH, later_BTH], dim=1)
