"""The sampler's keys and values, and the passes that fill them: prefill of prompts, the eager decode step.

Layout. The cache has S slots; a slot holds one prompt and its G rows. The prompt's keys/values are stored
once, [S, kv_heads, Tp, d] (right-aligned, the left padding masked); the G rows attend to them through a
broadcast matmul, never a copy. Generated keys/values live in [S, kv_heads, G, Tmax, d]; a slot's rows
decode in lock-step (row (s, g)'s t-th generated token sits at position prompt_len(s) + t), each slot at its
own step t_S. A slot takes a new prompt once all its rows have finished (decode_loop.py): every write here
is in place, so a recorded CUDA graph reads the new contents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlora.rollout.decoder import DecoderView, LayerView, decode_layers


class KVCache:
    def __init__(self, view: DecoderView, S: int, G: int, max_new: int, prompt_width: int, dtype, device):
        K, d = view.num_kv_heads, view.head_dim
        self.prompt = [(torch.zeros(S, K, prompt_width, d, dtype=dtype, device=device),
                        torch.zeros(S, K, prompt_width, d, dtype=dtype, device=device)) for _ in range(len(view.layers))]
        self.gen = [(torch.zeros(S, K, G, max_new, d, dtype=dtype, device=device),
                     torch.zeros(S, K, G, max_new, d, dtype=dtype, device=device)) for _ in range(len(view.layers))]
        self.prompt_mask_ST = torch.zeros(S, prompt_width, dtype=torch.long, device=device)  # 1 on real tokens
        self.prompt_bias_S11T = torch.full((S, 1, 1, prompt_width), float("-inf"), dtype=dtype, device=device)
        # how many positions each prompt key sits before the slot's first generated token (1: the prompt's last);
        # sliding-window layers read it (window_biases). Positions, not indices: a continued row's prompt (its
        # history, then padding, then the new turn) is not contiguous in the cache
        self.prompt_back_ST = torch.zeros(S, prompt_width, dtype=torch.long, device=device)

    def admit(self, slots_n: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]], mask_nT: torch.Tensor) -> None:
        """Prefilled prompts into these slots: per layer (K, V) [n, kv_heads, T, d], mask_nT 1 on real tokens."""
        left = self.prompt_mask_ST.shape[1] - mask_nT.shape[1]
        for (k_prompt, v_prompt), (k, v) in zip(self.prompt, layers):
            k_prompt[slots_n] = F.pad(k, (0, 0, left, 0))
            v_prompt[slots_n] = F.pad(v, (0, 0, left, 0))
        mask_nT = F.pad(mask_nT.long(), (left, 0))
        self.prompt_mask_ST[slots_n] = mask_nT
        zero = torch.zeros((), dtype=self.prompt_bias_S11T.dtype, device=mask_nT.device)
        self.prompt_bias_S11T[slots_n] = torch.where(mask_nT.bool(), zero, float("-inf"))[:, None, None, :]
        self.prompt_back_ST[slots_n] = mask_nT.sum(-1, keepdim=True) - mask_nT.cumsum(-1) + 1


def window_biases(windows: tuple[int, ...], t: torch.Tensor, prompt_back_ST: torch.Tensor, gen_width: int,
                  dtype: torch.dtype) -> dict[int | None, tuple[torch.Tensor | None, torch.Tensor]]:
    """The additive masks of one decode step, per window (None: full attention) -> (prompt bias [S, 1, G', 1, Tp]
    or None, generated bias [S, 1, G', 1, gen_width]). t: each row's generated index, [S, 1, G', 1, 1] (G' = G for
    the eager step's rows, 1 for the static step's slots). A row at t sees generated keys s <= t, and with a window
    of W only those with t - s < W and the prompt keys with t + back < W (back: KVCache.prompt_back_ST); padding keys
    stay masked by the cache's prompt bias."""
    # an idle slot's rows (outputs unused) may carry a step past the width: clamped, each still sees a key (no NaN)
    t = t.clamp(max=gen_width - 1)
    zero = torch.zeros((), dtype=dtype, device=t.device)
    slots = torch.arange(gen_width, device=t.device)
    seen = slots <= t
    biases: dict[int | None, tuple[torch.Tensor | None, torch.Tensor]] = {
        None: (None, torch.where(seen, zero, float("-inf")))}
    back = prompt_back_ST[:, None, None, None, :]
    for window in windows:
        biases[window] = (torch.where(t + back < window, zero, float("-inf")),
                          torch.where(seen & (slots > t - window), zero, float("-inf")))
    return biases


@dataclass
class RowCache:
    """Keys and values of the first `length` tokens a row has seen (its prompt, then its turns), per layer [K, T, d]:
    a later call continues the row from them instead of running its history again (multi-turn episodes)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[1]


def _left_padded_cache(past: Sequence[RowCache], device) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Rows' caches side by side, left-padded: per layer (K, V) [P, kv_heads, T, d], and mask_PT (1 on real keys)."""
    width = max(c.length for c in past)
    mask_PT = torch.zeros(len(past), width, dtype=torch.long, device=device)
    layers = []
    for index in range(len(past[0].layers)):
        k0 = past[0].layers[index][0]
        k = k0.new_zeros(len(past), k0.shape[0], width, k0.shape[2])
        v = torch.zeros_like(k)
        for p, cache in enumerate(past):
            k[p, :, width - cache.length:], v[p, :, width - cache.length:] = cache.layers[index]
        layers.append((k, v))
    for p, cache in enumerate(past):
        mask_PT[p, width - cache.length:] = 1
    return layers, mask_PT


@torch.no_grad()
def prefill(view: DecoderView, ids_PT: torch.Tensor, mask_PT: torch.Tensor, past: Sequence[RowCache] | None = None
            ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Run the left-padded prompts once -> (logits of the next token [P, V], per layer (K, V) [P, kv_heads, T, d],
    mask [P, T]: 1 on real tokens). With `past`, the prompts continue those rows: their tokens attend to the
    cached keys too, and the returned keys/values and mask hold both."""
    P, T = ids_PT.shape
    H, K, d = view.num_heads, view.num_kv_heads, view.head_dim
    x = view.embed(ids_PT)
    past_layers, past_mask_PT = _left_padded_cache(past, x.device) if past else ([], mask_PT[:, :0])
    positions_PT = (past_mask_PT.sum(-1, keepdim=True) + mask_PT.long().cumsum(-1) - 1).clamp(min=0)
    tables = view.rope_tables(x, positions_PT)
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    allowed_PTT = (causal_TT & mask_PT.bool()[:, None, :]) | torch.eye(T, dtype=torch.bool, device=x.device)
    # padding queries see themselves only (their output is unused); every query sees the row's cached keys
    allowed_P1TS = torch.cat([past_mask_PT.bool()[:, None, :].expand(P, T, -1), allowed_PTT], dim=-1)[:, None]
    allowed = {None: allowed_P1TS}
    if view.windows:  # a sliding-window layer's query sees the keys fewer than W positions back, counted by the
        # keys' own positions: a continued row's cache has padding between its history and the new turn
        key_positions_PS = torch.cat([past_mask_PT.cumsum(-1) - 1, positions_PT], dim=-1)
        back_P1TS = (positions_PT[:, :, None] - key_positions_PS[:, None, :])[:, None]
        allowed.update({w: allowed_P1TS & (back_P1TS < w) for w in view.windows})
    layers = []
    for index, layer in enumerate(view.layers):
        q, k, v = layer.attention_inputs(x)
        q = q.view(P, T, H, d).transpose(1, 2)
        k = k.view(P, T, K, d).transpose(1, 2)
        v = v.view(P, T, K, d).transpose(1, 2)
        q, k = view.rotate(layer, q, k, tables)
        if past_layers:
            k, v = torch.cat([past_layers[index][0], k], dim=2), torch.cat([past_layers[index][1], v], dim=2)
        layers.append((k, v))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[layer.window], scale=layer.scaling,
                                              enable_gqa=K != H)
        x = layer.add_attention(x, attn.transpose(1, 2).reshape(P, T, H * d))
        x = layer.add_mlp(x)
    return view.logits(x[:, -1]), layers, torch.cat([past_mask_PT, mask_PT.long()], dim=1)


def slot_row_caches(cache: KVCache, slot: int, lengths: list[int]) -> list[RowCache]:
    """The keys and values of a slot's rows after sampling (lengths: each row's generated tokens): the prompt's
    real positions, then the row's generated tokens but the last (a row's last token is sampled, never fed
    back: the next call feeds it)."""
    real = cache.prompt_mask_ST[slot].bool()
    return [RowCache([(torch.cat([k_prompt[slot][:, real], k_gen[slot, :, g, :length - 1]], dim=1),
                       torch.cat([v_prompt[slot][:, real], v_gen[slot, :, g, :length - 1]], dim=1))
                      for (k_prompt, v_prompt), (k_gen, v_gen) in zip(cache.prompt, cache.gen)])
            for g, length in enumerate(lengths)]


def _decode_attention(layer: LayerView, view: DecoderView, q_AHd, k_AKd, v_AKd, rows_A, t_A, biases: dict,
                      cache: KVCache, layer_index: int, S: int, G: int) -> torch.Tensor:
    H, K, d = view.num_heads, view.num_kv_heads, view.head_dim
    window_bias_S1G1P, gen_bias_S1G1W = biases[layer.window]
    per_kv, B, W = H // K, S * G, gen_bias_S1G1W.shape[-1]
    k_prompt, v_prompt = cache.prompt[layer_index]
    k_gen, v_gen = cache.gen[layer_index]  # [S, K, G, Tmax, d]
    slot_A, sample_A = rows_A // G, rows_A % G
    k_gen[slot_A, :, sample_A, t_A] = k_AKd
    v_gen[slot_A, :, sample_A, t_A] = v_AKd
    q_BHd = q_AHd if len(rows_A) == B else q_AHd.new_zeros(B, H, d).index_copy_(0, rows_A, q_AHd)
    # [B, H, d] -> [S, K, G, per_kv, d]: the G samples' queries of one kv head side by side
    q = q_BHd.view(S, G, K, per_kv, d).permute(0, 2, 1, 3, 4)
    Tp = k_prompt.shape[2]
    scores_prompt = q.reshape(S, K, G * per_kv, d) @ k_prompt.transpose(-1, -2)  # [S, K, G*per_kv, Tp]
    scores_prompt = scores_prompt * layer.scaling + cache.prompt_bias_S11T
    scores_gen = q @ k_gen[:, :, :, :W].transpose(-1, -2) * layer.scaling + gen_bias_S1G1W  # [S, K, G, per_kv, W]
    scores_prompt = scores_prompt.view(S, K, G, per_kv, Tp)
    if window_bias_S1G1P is not None:  # a sliding-window layer
        scores_prompt = scores_prompt + window_bias_S1G1P
    scores = torch.cat([scores_prompt, scores_gen], dim=-1)
    probs = scores.float().softmax(-1).to(q.dtype)
    probs_prompt, probs_gen = probs.split([Tp, W], dim=-1)
    out = (probs_prompt.reshape(S, K, G * per_kv, Tp) @ v_prompt).view(S, K, G, per_kv, d)
    out = out + probs_gen @ v_gen[:, :, :, :W]
    out_BHd = out.permute(0, 2, 1, 3, 4).reshape(B, H * d)
    return out_BHd if len(rows_A) == B else out_BHd[rows_A]


@torch.no_grad()
def decode_step(view: DecoderView, tokens_A, rows_A, positions_A, t_B: torch.Tensor, width: int, cache: KVCache,
                S: int, G: int):
    """Feed generated token t_B[row] of the active rows (slot rows s * G + g) -> logits of their next token [A, V].
    width: the generated positions attention reads (more than any active row's t); each row sees its t + 1."""
    x = view.embed(tokens_A)  # [A, hidden]
    tables = view.rope_tables(x[:, None], positions_A[:, None])  # cos, sin: [A, 1, d]
    biases = window_biases(view.windows, t_B.view(S, 1, G, 1, 1), cache.prompt_back_ST, width, x.dtype)
    t_A = t_B[rows_A]
    return decode_layers(view, x, tables, lambda layer, i, q, k, v: _decode_attention(
        layer, view, q, k, v, rows_A, t_A, biases, cache, i, S, G))
