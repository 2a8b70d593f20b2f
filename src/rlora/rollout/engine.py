"""The built-in sampler: prefill each distinct prompt once, decode all P x G rows of a step together.

Layout. Prompt keys/values are stored once per prompt, [P, kv_heads, Tp, d]; the G samples of a prompt
attend to them through a broadcast matmul, never a copy. Generated keys/values live in a preallocated
[P, kv_heads, G, Tmax, d] cache. All rows decode in lock-step (row b's t-th generated token sits at
position prompt_len(b) + t), so one step is one batched pass. Finished rows leave the dense layers and
the output layer (the bulk of the work); attention still runs over the full [P, G] block, whose cost is
small, with the finished rows' results discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from rlora.models.molora_runtime import SamplerRouting, sampler_routing
from rlora.models.multi_lora import SamplerPolicies
from rlora.models.sharded_base import StreamedLayers
from rlora.rollout.decoder import DecoderView, LayerView, decode_layers
from rlora.rollout.device_loop import decode_on_device
from rlora.rollout.generator import StopStrings
from rlora.rollout.graphed import StaticDecoder
from rlora.rollout.packed import PackCache, packed_fp16_available
from rlora.rollout.phase import ChunkPhases, think_phases
from rlora.rollout.sampling import DrawPlan, RowParams, counter_uniform, sample_tokens
from rlora.tensors import left_padded
from rlora.types import Rollout, SamplingParams


class KVCache:
    def __init__(self, view: DecoderView, P: int, G: int, max_new: int, dtype, device):
        self.prompt: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: K, V [P, kvh, Tp, d]
        shape = (P, view.num_kv_heads, G, max_new, view.head_dim)
        self.gen = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                    for _ in range(len(view.layers))]
        self.prompt_bias_P11T: torch.Tensor | None = None  # 0 on real prompt tokens, -inf on padding
        self.prompt_mask_PT: torch.Tensor | None = None  # 1 on real prompt tokens (a continued row's cached ones too)


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
def prefill(view: DecoderView, ids_PT: torch.Tensor, mask_PT: torch.Tensor, cache: KVCache,
            past: Sequence[RowCache] | None = None) -> torch.Tensor:
    """Run the left-padded prompts once, fill cache.prompt -> logits of the next token [P, V]. With `past`, the
    prompts continue those rows: their tokens attend to the cached keys too, and cache.prompt holds both."""
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
    for index, layer in enumerate(view.layers):
        q, k, v = layer.attention_inputs(x)
        q = q.view(P, T, H, d).transpose(1, 2)
        k = k.view(P, T, K, d).transpose(1, 2)
        v = v.view(P, T, K, d).transpose(1, 2)
        q, k = view.rotate(layer, q, k, tables)
        if past_layers:
            k, v = torch.cat([past_layers[index][0], k], dim=2), torch.cat([past_layers[index][1], v], dim=2)
        cache.prompt.append((k, v))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed_P1TS, scale=layer.scaling, enable_gqa=K != H)
        x = layer.add_attention(x, attn.transpose(1, 2).reshape(P, T, H * d))
        x = layer.add_mlp(x)
    cache.prompt_mask_PT = torch.cat([past_mask_PT, mask_PT.long()], dim=1)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    cache.prompt_bias_P11T = torch.where(cache.prompt_mask_PT.bool(), zero, float("-inf"))[:, None, None, :]
    return view.logits(x[:, -1])


def row_caches(cache: KVCache, length_B: torch.Tensor, G: int) -> list[RowCache]:
    """Each row's keys and values after sampling: its prompt's real positions, then its generated tokens but the
    last (a row's last token is sampled, never fed back: the next call feeds it)."""
    rows = []
    for b, length in enumerate(length_B.tolist()):
        p, g = divmod(b, G)
        real = cache.prompt_mask_PT[p].bool()
        rows.append(RowCache([(torch.cat([k_prompt[p][:, real], k_gen[p, :, g, :length - 1]], dim=1),
                               torch.cat([v_prompt[p][:, real], v_gen[p, :, g, :length - 1]], dim=1))
                              for (k_prompt, v_prompt), (k_gen, v_gen) in zip(cache.prompt, cache.gen)]))
    return rows


def _decode_attention(layer: LayerView, view: DecoderView, q_AHd, k_AKd, v_AKd, rows_A, t: int, cache: KVCache,
                      layer_index: int, P: int, G: int) -> torch.Tensor:
    H, K, d = view.num_heads, view.num_kv_heads, view.head_dim
    per_kv = H // K
    B = P * G
    k_prompt, v_prompt = cache.prompt[layer_index]
    k_gen, v_gen = cache.gen[layer_index]  # [P, K, G, Tmax, d]
    prompt_A, sample_A = rows_A // G, rows_A % G
    k_gen[prompt_A, :, sample_A, t] = k_AKd
    v_gen[prompt_A, :, sample_A, t] = v_AKd
    q_BHd = q_AHd if len(rows_A) == B else q_AHd.new_zeros(B, H, d).index_copy_(0, rows_A, q_AHd)
    # [B, H, d] -> [P, K, G, per_kv, d]: the G samples' queries of one kv head side by side
    q = q_BHd.view(P, G, K, per_kv, d).permute(0, 2, 1, 3, 4)
    Tp = k_prompt.shape[2]
    scores_prompt = q.reshape(P, K, G * per_kv, d) @ k_prompt.transpose(-1, -2)  # [P, K, G*per_kv, Tp]
    scores_prompt = scores_prompt * layer.scaling + cache.prompt_bias_P11T
    scores_gen = q @ k_gen[:, :, :, :t + 1].transpose(-1, -2) * layer.scaling  # [P, K, G, per_kv, t+1]
    scores = torch.cat([scores_prompt.view(P, K, G, per_kv, Tp), scores_gen], dim=-1)
    probs = scores.float().softmax(-1).to(q.dtype)
    probs_prompt, probs_gen = probs.split([Tp, t + 1], dim=-1)
    out = (probs_prompt.reshape(P, K, G * per_kv, Tp) @ v_prompt).view(P, K, G, per_kv, d)
    out = out + probs_gen @ v_gen[:, :, :, :t + 1]
    out_BHd = out.permute(0, 2, 1, 3, 4).reshape(B, H * d)
    return out_BHd if len(rows_A) == B else out_BHd[rows_A]


@torch.no_grad()
def decode_step(view: DecoderView, tokens_A, rows_A, positions_A, t: int, cache: KVCache, P: int, G: int):
    """Feed generated token t of the active rows -> logits of token t+1 [A, V]."""
    x = view.embed(tokens_A)  # [A, hidden]
    tables = view.rope_tables(x[:, None], positions_A[:, None])  # cos, sin: [A, 1, d]
    return decode_layers(view, x, tables, lambda layer, i, q, k, v: _decode_attention(
        layer, view, q, k, v, rows_A, t, cache, i, P, G))


class _Chunk(NamedTuple):
    tokens_BT: torch.Tensor
    logp_BT: torch.Tensor
    length_B: torch.Tensor
    reasons: list[str]
    temperature_B: torch.Tensor
    temperature_BT: torch.Tensor | None  # per-token temperatures, only when some row has a think phase


DECODE_MODES = ("auto", "eager", "static", "graph")
# rows decoded together: a CPU step costs in proportion to the rows; a GPU step hardly grows with them
MAX_ROWS = {"cpu": 256, "cuda": 2048}


def rows_that_fit(view: DecoderView, max_new: int, prompt_len: int, share: float = 0.25) -> int:
    """Rows to decode together: MAX_ROWS of the device, and on a GPU no more than let the generated KV
    cache and the float32 logits of the sampling step take `share` of the free memory."""
    cap = MAX_ROWS.get(view.device.type, MAX_ROWS["cpu"])
    if view.device.type != "cuda":
        return cap
    itemsize = torch.empty((), dtype=view.dtype).element_size()
    kv_per_row = 2 * len(view.layers) * view.num_kv_heads * view.head_dim * itemsize * (max_new + prompt_len)
    logits_per_row = 12 * view.lm_head.sizes[0]  # float32 scaled logits, their exponentials, the padded copy
    free, _ = torch.cuda.mem_get_info(view.device)
    return max(1, min(cap, int(share * free / (kv_per_row + logits_per_row))))


class BuiltinGenerator:
    """The built-in engine (the decoder families of rollout/layouts.py). merge=True samples with LoRA merged
    into fresh tensors (faster); merge=False calls the adapter layers as the trainer does.

    decode: 'eager' drops finished rows from the dense layers each step (CPUs); 'static' keeps every row and
    fixed shapes (graphed.py); 'graph' is 'static' replayed as a CUDA graph (GPUs only); 'auto' is 'graph'
    on a GPU and 'eager' elsewhere. max_rows: rows decoded together (None: rows_that_fit).
    fp16_weights (float32 models on x86 CPUs): the linear maps run from float16 copies of the frozen base
    weights, packed once per base and kept here between calls, the LoRA unmerged (rollout/packed.py)."""

    name = "builtin"

    def __init__(self, tokenizer, eos_ids: list[int], pad_id: int, merge: bool = True, max_rows: int | None = None,
                 dtype: torch.dtype | None = None, decode: str = "auto", fp16_weights: bool = False):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, not {decode!r}")
        if fp16_weights and not packed_fp16_available():
            raise ValueError("fp16_weights needs torch's fbgemm engine (x86 CPU builds)")
        if fp16_weights and dtype not in (None, torch.float32):
            raise ValueError("fp16_weights computes in float32: leave dtype unset")
        self.tokenizer, self.eos_ids, self.pad_id = tokenizer, eos_ids, pad_id
        self.merge, self.max_rows, self.dtype, self.decode = merge, max_rows, dtype, decode
        self.packs = PackCache() if fp16_weights else None

    def _decode_mode(self, view: DecoderView) -> str:
        streamed = isinstance(view.layers, StreamedLayers)  # its layers are gathered in each step: no graph
        if self.decode == "auto":
            return "graph" if view.device.type == "cuda" and not streamed else "eager"
        if self.decode == "graph" and (view.device.type != "cuda" or streamed):
            raise ValueError("decode='graph' (CUDA graphs) needs the model on a CUDA GPU, its layers not streamed")
        return self.decode

    def decoder_view(self, model) -> DecoderView:
        """The decoder to sample with (a subclass may keep one between calls: `rlora serve` does, for its merged
        weight copies)."""
        return DecoderView.of(model, self.merge, self.dtype, self.packs)

    @torch.no_grad()
    def sample(self, model, prompts: list[list[int]], n: int,
               params: SamplingParams | Sequence[SamplingParams], seed: int | Sequence[int],
               keys: Sequence[int] | None = None, policies: Sequence[int] | None = None,
               on_token: Callable[[int, int], None] | None = None) -> Rollout:
        """keys: an integer per prompt (default its position) that, with the seed, alone decides the random
        draws of its rows: the same (seed, key) samples the same completions in any batch, on any rank.
        seed: one for all prompts, or one per prompt. policies: on a model with several policy adapters
        (models/multi_lora.py), the policy that samples each prompt; all of them decode in one batch.
        on_token(row, token): called with every token as it is drawn (row: prompt-major, as in the rollout;
        a row's ending EOS included), e.g. to print a reply while it is generated."""
        rollout, _ = self._sample(model, prompts, n, params, seed, keys, policies, on_token, None, keep_caches=False)
        return rollout

    @torch.no_grad()
    def sample_continued(self, model, prompts: list[list[int]], n: int,
                         params: SamplingParams | Sequence[SamplingParams], seed: int | Sequence[int],
                         keys: Sequence[int] | None = None, policies: Sequence[int] | None = None,
                         past: Sequence[RowCache] | None = None) -> tuple[Rollout, list[RowCache]]:
        """sample(), where prompt i continues the row whose keys and values past[i] holds (its tokens follow
        past[i]'s), and -> each sampled row's cache too (RowCache: its prompt, past and samples but the last
        token), for a later call to continue from: a new turn runs only its new tokens."""
        if past is not None and len(past) != len(prompts):
            raise ValueError(f"{len(past)} caches for {len(prompts)} prompts")
        return self._sample(model, prompts, n, params, seed, keys, policies, None, past, keep_caches=True)

    def _sample(self, model, prompts, n, params, seed, keys, policies, on_token, past, keep_caches: bool):
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
        if not len(per_prompt) == len(seeds) == len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling settings and {len(seeds)} seeds for {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        was_training = model.training
        model.eval()
        try:
            view = self.decoder_view(model)
            max_new = max(p.max_new_tokens for p in per_prompt)
            longest = max(len(p) + (0 if past is None else c.length) for p, c in zip(prompts, past or [None] * len(prompts)))
            max_rows = self.max_rows or rows_that_fit(view, max_new, longest)
            per_chunk = max(1, max_rows // n)  # prompts decoded together: up to max_rows rows
            chunks, caches = [], []
            for i in range(0, len(prompts), per_chunk):  # MoLoRA layers are called routed by their rows' prompts
                part = slice(i, i + per_chunk)
                with (sampler_routing(model, prompts[part], n) as routing,
                      SamplerPolicies(model, None if policies is None else list(policies)[part], n, view.device) as rows):
                    chunk, cache = self._sample_chunk(view, prompts[part], n, per_prompt[part], seeds[part], keys[part],
                                                      _RowContexts(routing, rows), _from_row(on_token, i * n),
                                                      None if past is None else list(past)[part])
                chunks.append(chunk)
                if keep_caches:
                    caches += row_caches(cache, chunk.length_B, n)
        finally:
            model.train(was_training)
        return self._rollout(prompts, n, chunks), caches

    def _sample_chunk(self, view: DecoderView, prompts, G: int, per_prompt, seeds: list[int], keys: list[int],
                      routing: "_RowContexts", on_token: Callable[[int, int], None] | None,
                      past: list[RowCache] | None) -> tuple["_Chunk", KVCache]:
        device = view.device
        P, B = len(prompts), len(prompts) * G
        row_keys_B = (torch.tensor(keys, dtype=torch.int64)[:, None] * G + torch.arange(G)).reshape(-1).to(device)
        # one seed for the chunk (the usual case) keeps the scalar hash; several: one per row
        seed = seeds[0] if len(set(seeds)) == 1 else torch.tensor(seeds, dtype=torch.int64, device=device).repeat_interleave(G)
        rows = RowParams.per_row(per_prompt, G, device)
        max_new = int(rows.max_new_A.max())
        ids_PT, mask_PT = (x.to(device) for x in left_padded(prompts, self.pad_id))
        cache = KVCache(view, P, G, max_new, view.dtype, device)
        routing.prompts()
        logits_A = prefill(view, ids_PT, mask_PT, cache, past).repeat_interleave(G, dim=0)
        prompt_len_B = cache.prompt_mask_PT.sum(-1).repeat_interleave(G)
        eos_V = torch.zeros(logits_A.shape[-1], dtype=torch.bool, device=device)
        eos_V[self.eos_ids] = True
        any_min_new = bool((rows.min_new_A > 0).any())
        stops = StopStrings(self.tokenizer, [p.stop for p in per_prompt for _ in range(G)])
        phases = think_phases(per_prompt, G)
        spans = ChunkPhases(self._decode, phases, rows, max_new) if any(phases) else None
        tokens_BT = torch.full((B, max_new), self.pad_id, dtype=torch.long)
        logp_BT = torch.zeros(B, max_new)
        length_B = torch.full((B,), max_new, dtype=torch.long)
        reasons = ["length"] * B
        mode = self._decode_mode(view)
        if mode != "eager" and on_token is None and spans is None and not stops.any:
            return self._chunk_on_device(view, cache, P, G, prompt_len_B, routing, logits_A, rows, seed, row_keys_B,
                                         eos_V, max_new, mode), cache
        active_A = torch.arange(B, device=device)
        decode = self._decoder(view, cache, P, G, prompt_len_B, routing, mode)
        for t in range(max_new):
            rows_now = rows.select(active_A)
            if spans is not None:
                rows_now = spans.settings(rows_now, active_A, t)
            banned_A = (rows_now.min_new_A > t) if any_min_new else None
            u_A = counter_uniform(seed if isinstance(seed, int) else seed[active_A], row_keys_B[active_A], t)
            token_A, logp_A = sample_tokens(logits_A, rows_now, u_A, banned_A, self.eos_ids)
            active_cpu = active_A.cpu()
            tokens_BT[active_cpu, t], logp_BT[active_cpu, t] = token_A.cpu(), logp_A.float().cpu()
            if on_token is not None:
                for row in active_cpu.tolist():
                    on_token(row, int(tokens_BT[row, t]))
            stopped_A = eos_V[token_A].cpu()
            if stops.any:
                stopped_A |= torch.tensor([stops.hit(row, tokens_BT[row, :t + 1].tolist()) for row in active_cpu.tolist()])
            if spans is not None:
                spans.advance(tokens_BT, active_cpu.tolist(), t)
            done_A = stopped_A | (rows_now.max_new_A.cpu() <= t + 1)
            for row in active_cpu[stopped_A].tolist():
                reasons[row] = "stop"
            length_B[active_cpu[done_A]] = t + 1
            keep_A = ~done_A.to(device)
            active_A, token_A = active_A[keep_A], token_A[keep_A]
            if len(active_A) == 0 or t + 1 == max_new:
                break
            logits_A = decode(token_A, active_A, t)
        return _Chunk(tokens_BT, logp_BT, length_B, reasons, rows.temperature_A.cpu(),
                      None if spans is None else spans.temperature_BT), cache

    def _chunk_on_device(self, view: DecoderView, cache: KVCache, P: int, G: int, prompt_len_B: torch.Tensor,
                         routing: "_RowContexts", logits_BV: torch.Tensor, rows: RowParams, seed, row_keys_B,
                         eos_V: torch.Tensor, max_new: int, mode: str) -> "_Chunk":
        """A chunk without host-side checks in the fixed-shape step: device_loop.decode_on_device."""
        plan = DrawPlan.of(rows)

        def draw(logits_BV, t_1):
            banned_B = rows.min_new_A > t_1 if plan.banned else None
            u_B = counter_uniform(seed, row_keys_B, t_1)
            return sample_tokens(logits_BV, rows, u_B, banned_B, eos_V, plan)

        routing.rows(torch.arange(P * G))  # the static step runs every row, always
        static = StaticDecoder(view, cache, P, G, graph=mode == "graph", draw=None if plan.truncate else draw)
        done = decode_on_device(static, logits_BV, draw, not plan.truncate, prompt_len_B, rows.max_new_A, max_new,
                                eos_V, self.pad_id)
        reasons = ["stop" if stopped else "length" for stopped in done.stopped_B.tolist()]
        return _Chunk(done.tokens_BT.cpu(), done.logp_BT.cpu(), done.length_B.cpu(), reasons,
                      rows.temperature_A.cpu(), None)

    def _decoder(self, view: DecoderView, cache: KVCache, P: int, G: int, prompt_len_B: torch.Tensor,
                 routing: "_RowContexts", mode: str):
        """-> step(token_A, active_A, t) -> logits of the active rows' next token [A, V]."""
        if mode == "eager":
            def eager_step(token_A, active_A, t):
                routing.rows(active_A)
                return decode_step(view, token_A, active_A, prompt_len_B[active_A] + t, t, cache, P, G)

            return eager_step
        routing.rows(torch.arange(P * G))  # the static step runs every row, always
        static = StaticDecoder(view, cache, P, G, graph=mode == "graph")
        tokens_B = torch.full((P * G,), self.pad_id, dtype=torch.long, device=view.device)

        def step(token_A, active_A, t):
            tokens_B[active_A] = token_A  # finished rows keep feeding their last token; their logits are dropped
            return static(tokens_B, prompt_len_B + t, t)[active_A]  # indexing copies out of the graph's buffer

        return step

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _rollout(self, prompts, n, chunks: list[_Chunk]) -> Rollout:
        width = max(c.tokens_BT.shape[1] for c in chunks)
        tokens_BT = torch.cat([F.pad(c.tokens_BT, (0, width - c.tokens_BT.shape[1]), value=self.pad_id)
                               for c in chunks])
        logp_BT = torch.cat([F.pad(c.logp_BT, (0, width - c.logp_BT.shape[1])) for c in chunks])
        length_B = torch.cat([c.length_B for c in chunks])
        reasons = [r for c in chunks for r in c.reasons]
        keep = int(length_B.max())
        mask_BT = (torch.arange(keep)[None] < length_B[:, None]).long()
        tokens_BT = tokens_BT[:, :keep].masked_fill(mask_BT == 0, self.pad_id)
        logp_BT = logp_BT[:, :keep] * mask_BT
        texts = self.tokenizer.batch_decode([row[m.bool()] for row, m in zip(tokens_BT, mask_BT)], skip_special_tokens=True)
        prompt_ids, prompt_mask = left_padded([p for p in prompts for _ in range(n)], self.pad_id)
        return Rollout(
            prompt_ids_BTp=prompt_ids, prompt_mask_BTp=prompt_mask, completion_ids_BTc=tokens_BT,
            completion_mask_BTc=mask_BT, completions=texts, finish_reasons=reasons,
            temperature_B=torch.cat([c.temperature_B for c in chunks]), sampling_logp_BTc=logp_BT,
            temperature_BTc=_token_temperatures(chunks, width, keep, mask_BT),
        )


def _from_row(on_token: Callable[[int, int], None] | None, offset: int) -> Callable[[int, int], None] | None:
    """on_token for a chunk whose first row is row `offset` of the rollout."""
    return None if on_token is None else (lambda row, token: on_token(offset + row, token))


class _RowContexts:
    """What the layers need to know about the rows of the next forward: MoLoRA's prompt routing and the rows'
    policy adapters (each a no-op where the model has none)."""

    def __init__(self, routing: SamplerRouting, policies: SamplerPolicies):
        self.parts = (routing, policies)

    def prompts(self) -> None:
        for part in self.parts:
            part.prompts()

    def rows(self, rows_A: torch.Tensor) -> None:
        for part in self.parts:
            part.rows(rows_A)


def _token_temperatures(chunks: list[_Chunk], width: int, keep: int, mask_BT: torch.Tensor) -> torch.Tensor | None:
    """Per-token temperatures of all rows (0 on padding), or None when no row had a think phase."""
    if all(c.temperature_BT is None for c in chunks):
        return None
    parts = [c.temperature_B[:, None].expand(-1, width) if c.temperature_BT is None
             else F.pad(c.temperature_BT, (0, width - c.temperature_BT.shape[1])) for c in chunks]
    return torch.cat(parts)[:, :keep] * mask_BT
