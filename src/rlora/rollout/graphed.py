"""Decoding with a fixed batch shape, replayed as a CUDA graph on GPUs.

On a GPU the eager decode step (kvcache.decode_step) is bound by the CPU launching some thirty small
kernels per layer: measured 36 ms a step for a 24-layer model at 256 rows on an H100, about 1 % of the
memory-bandwidth bound. A CUDA graph records the kernels of one step once and replays them with a single
launch. A graph needs fixed shapes and fixed addresses, so this step keeps all S x G slot rows (finished rows
are computed and ignored), takes the slots' step indices as a tensor and attends over the whole preallocated
cache with a mask, where the eager step drops finished rows and slices the cache to the longest step. Masked
positions get probability exactly 0, so both steps compute the same function; only the order of some float
sums differs. Everything the step reads (cache, slots' rows and steps) is updated in place between replays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlora.rollout.decoder import DecoderView, LayerView, decode_layers
from rlora.rollout.kvcache import window_biases


def _static_attention(layer: LayerView, view: DecoderView, q_BHd, k_BKd, v_BKd, t_S: torch.Tensor,
                      biases: dict, cache, layer_index: int, S: int, G: int) -> torch.Tensor:
    H, K, d = view.num_heads, view.num_kv_heads, view.head_dim
    window_bias_S111P, gen_bias_S111T = biases[layer.window]
    per_kv = H // K
    k_prompt, v_prompt = cache.prompt[layer_index]  # [S, K, Tp, d]
    k_gen, v_gen = cache.gen[layer_index]  # [S, K, G, Tmax, d]
    # this token's key/value into position t_S[s] of every row of slot s: [B, K, d] -> [S, K, G, d]
    slots_S = torch.arange(S, device=t_S.device)
    k_gen[slots_S, :, :, t_S] = k_BKd.view(S, G, K, d).transpose(1, 2)
    v_gen[slots_S, :, :, t_S] = v_BKd.view(S, G, K, d).transpose(1, 2)
    q = q_BHd.view(S, G, K, per_kv, d).permute(0, 2, 1, 3, 4)  # [S, K, G, per_kv, d]
    Tp, Tmax = k_prompt.shape[2], k_gen.shape[3]
    scores_prompt = q.reshape(S, K, G * per_kv, d) @ k_prompt.transpose(-1, -2)  # [S, K, G*per_kv, Tp]
    scores_prompt = scores_prompt * layer.scaling + cache.prompt_bias_S11T
    scores_gen = q @ k_gen.transpose(-1, -2) * layer.scaling + gen_bias_S111T  # [S, K, G, per_kv, Tmax]
    scores_prompt = scores_prompt.view(S, K, G, per_kv, Tp)
    if window_bias_S111P is not None:  # a sliding-window layer
        scores_prompt = scores_prompt + window_bias_S111P
    scores = torch.cat([scores_prompt, scores_gen], dim=-1)
    probs = scores.float().softmax(-1).to(q.dtype)
    probs_prompt, probs_gen = probs.split([Tp, Tmax], dim=-1)
    out = (probs_prompt.reshape(S, K, G * per_kv, Tp) @ v_prompt).view(S, K, G, per_kv, d)
    out = out + probs_gen @ v_gen
    return out.permute(0, 2, 1, 3, 4).reshape(S * G, H * d)


@torch.no_grad()
def static_decode_step(view: DecoderView, tokens_B: torch.Tensor, positions_B: torch.Tensor, t_S: torch.Tensor,
                       cache, S: int, G: int) -> torch.Tensor:
    """Feed generated token t_S[s] of every row of every slot s (a tensor, so a graph can replay any t) -> logits
    of their next token, [B, V]."""
    x = view.embed(tokens_B)  # [B, hidden]
    tables = view.rope_tables(x[:, None], positions_B[:, None])
    biases = window_biases(view.windows, t_S.view(S, 1, 1, 1, 1), cache.prompt_back_ST, cache.gen[0][0].shape[3],
                           x.dtype)
    return decode_layers(view, x, tables, lambda layer, i, q, k, v: _static_attention(
        layer, view, q, k, v, t_S, biases, cache, i, S, G))


class StaticDecoder:
    """static_decode_step with its inputs in fixed tensors. graph=True records it once as a CUDA graph and
    then replays it; the returned logits are then a buffer the next call overwrites (copy what you keep).
    draw: (logits_BV, t_B) -> (token_B, logp_B), run inside the step on the logits of each row's next token
    (t_B: its index, t_S + 1 per row); the step then returns the drawn tokens and their log-probs instead of
    the logits. It must make no device-to-host sync (sampling.DrawPlan), as a graph records it."""

    def __init__(self, view: DecoderView, cache, S: int, G: int, graph: bool,
                 draw: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None):
        device = view.device
        self.view, self.cache, self.S, self.G, self.draw = view, cache, S, G, draw
        self.tokens_B = torch.zeros(S * G, dtype=torch.long, device=device)
        self.positions_B = torch.zeros(S * G, dtype=torch.long, device=device)
        self.t_S = torch.zeros(S, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out = None  # what the recorded graph writes: the logits, or the drawn tokens and log-probs
        self.use_graph = graph

    def _run(self):
        logits_BV = static_decode_step(self.view, self.tokens_B, self.positions_B, self.t_S, self.cache, self.S, self.G)
        return logits_BV if self.draw is None else self.draw(logits_BV, (self.t_S + 1).repeat_interleave(self.G))

    def _record(self) -> None:
        # Warm-up on a side stream (lazy initialisation and allocations stay out of the graph), as torch asks.
        # It writes each row's key/value at its current t, which the real step then writes again.
        side = torch.cuda.Stream(self.view.device)
        side.wait_stream(torch.cuda.current_stream(self.view.device))
        with torch.cuda.stream(side):
            self._run()
        torch.cuda.current_stream(self.view.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._run()

    def forget_graph(self) -> None:
        """Record again at the next call: something the graph read by address was replaced (the rows' policy or
        MoLoRA routing after a slot took a new prompt)."""
        self.graph = None

    def __call__(self, tokens_B: torch.Tensor, positions_B: torch.Tensor, t_S: torch.Tensor):
        self.tokens_B.copy_(tokens_B)
        self.positions_B.copy_(positions_B)
        self.t_S.copy_(t_S)
        if not self.use_graph:
            return self._run()
        if self.graph is None:
            self._record()
        self.graph.replay()
        return self.out
