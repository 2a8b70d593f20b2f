"""The built-in sampler: prefill each distinct prompt once, decode its G rows together with the other prompts'.

The call's prompts go through S slots (rows_that_fit // G): a slot decodes one prompt's G rows and takes the
next prompt once they have all finished (continuous batching; rollout/decode_loop.py). Prompt keys/values are
stored once per slot and the G rows attend to them through a broadcast matmul (rollout/kvcache.py). The eager
step (CPUs) drops finished rows from the dense layers and the output layer, the bulk of the work; the fixed-
shape step (rollout/graphed.py, CUDA graphs on GPUs) runs every slot row and draws inside the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlora.models.loading import causal_lm
from rlora.models.molora_runtime import SamplerRouting, sampler_routing
from rlora.models.multi_lora import SamplerPolicies
from rlora.models.sharded_base import StreamedLayers, sharded_base
from rlora.rollout.decode_loop import CallRows, HostHooks, RowsOnDevice, Slots, decode
from rlora.rollout.decoder import DecoderView
from rlora.rollout.stops import StopStrings
from rlora.rollout.graphed import StaticDecoder
from rlora.rollout.kvcache import KVCache, RowCache, decode_step, prefill, slot_row_caches
from rlora.rollout.packed import Fp16Packs, OneDnnPacks, PackCache, onednn_packs_available, packed_fp16_available
from rlora.rollout.phase import RowPhases, think_phases
from rlora.rollout.sampling import DrawPlan, RowParams
from rlora.tensors import left_padded
from rlora.types import Rollout, SamplingParams

__all__ = ["BuiltinGenerator", "RowCache", "rows_that_fit"]


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
    on a GPU and 'eager' elsewhere. max_rows: rows decoded together (None: rows_that_fit), in slots of G rows.
    fp16_weights (float32 models on x86 CPUs): the linear maps run from float16 copies of the frozen base
    weights, packed once per base and kept here between calls, the LoRA unmerged (rollout/packed.py).
    onednn: with merge, on an x86 CPU, a float32 or (natively computed) bfloat16 sampler runs the linear maps from
    oneDNN-packed copies of the base weights, the LoRA unmerged: float32 sampling 1.5-1.7x faster than MKL's
    products over merged copies (False), the same products through another kernel. keep_packs: keep them between
    calls (False: made in each call and freed after it, like merged copies; for a sampler used now and then).
    continuous: a slot whose rows have all finished takes the next prompt at once (False: only when every slot
    has finished, i.e. fixed chunks; for comparison). Either samples the same tokens."""

    name = "builtin"

    def __init__(self, tokenizer, eos_ids: list[int], pad_id: int, merge: bool = True, max_rows: int | None = None,
                 dtype: torch.dtype | None = None, decode: str = "auto", fp16_weights: bool = False,
                 continuous: bool = True, onednn: bool = True, keep_packs: bool = True):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, not {decode!r}")
        if fp16_weights and not packed_fp16_available():
            raise ValueError("fp16_weights needs torch's fbgemm engine (x86 CPU builds)")
        if fp16_weights and dtype not in (None, torch.float32):
            raise ValueError("fp16_weights computes in float32: leave dtype unset")
        self.tokenizer, self.eos_ids, self.pad_id = tokenizer, eos_ids, pad_id
        self.merge, self.max_rows, self.dtype, self.decode, self.continuous = merge, max_rows, dtype, decode, continuous
        self.packs = PackCache(Fp16Packs()) if fp16_weights else None
        self.onednn, self.keep_packs = onednn, keep_packs
        self._onednn_packs: dict[torch.dtype, PackCache] = {}  # by the sampler's dtype

    def _decode_mode(self, view: DecoderView) -> str:
        streamed = isinstance(view.layers, StreamedLayers)  # its layers are gathered in each step: no graph
        if self.decode == "auto":
            return "graph" if view.device.type == "cuda" and not streamed and view.graphable else "eager"
        if self.decode == "graph" and (view.device.type != "cuda" or streamed or not view.graphable):
            raise ValueError("decode='graph' (CUDA graphs) needs the model on a CUDA GPU, its layers not streamed and "
                             "no mixture-of-experts block")
        return self.decode

    def decoder_view(self, model) -> DecoderView:
        """The decoder to sample with (a subclass may keep one between calls: `rlora serve` does, for its merged
        weight copies or its LoRA stacked beside the packs)."""
        return DecoderView.of(model, self.merge, self.dtype, self.packs_for(model))

    def packs_for(self, model) -> PackCache | None:
        """The packed base weights this model's sampling runs from (None: merged copies, or the adapter layers)."""
        if self.packs is not None or not (self.onednn and self.merge):
            return self.packs
        embed = causal_lm(model).model.embed_tokens.weight
        dtype = self.dtype or embed.dtype
        if embed.device.type != "cpu" or sharded_base(model) is not None or not onednn_packs_available(dtype):
            return None
        return self._onednn_packs.setdefault(dtype, PackCache(OneDnnPacks(dtype)))

    @torch.no_grad()
    def sample(self, model, prompts: list[list[int]], n: int,
               params: SamplingParams | Sequence[SamplingParams], seed: int | Sequence[int],
               keys: Sequence[int] | None = None, policies: Sequence[int] | None = None,
               on_token: Callable[[int, int], None] | None = None,
               route_by: Sequence[list[int]] | None = None) -> Rollout:
        """keys: an integer per prompt (default its position) that, with the seed, alone decides the random
        draws of its rows: the same (seed, key) samples the same completions in any batch, on any rank.
        seed: one for all prompts, or one per prompt. policies: on a model with several policy adapters
        (models/multi_lora.py), the policy that samples each prompt; all of them decode in one batch.
        on_token(row, token): called with every token as it is drawn (row: prompt-major, as in the rollout;
        a row's ending EOS included), e.g. to print a reply while it is generated. route_by: the prompts a MoLoRA
        sequence router routes each prompt's rows by (default the prompts themselves; an episode's turn: its first
        prompt, which the trainer routes its row by)."""
        return self._sample(model, prompts, n, params, seed, keys, policies, on_token, None, route_by, None)

    @torch.no_grad()
    def sample_continued(self, model, prompts: list[list[int]], n: int,
                         params: SamplingParams | Sequence[SamplingParams], seed: int | Sequence[int],
                         keys: Sequence[int] | None = None, policies: Sequence[int] | None = None,
                         past: Sequence[RowCache] | None = None,
                         route_by: Sequence[list[int]] | None = None,
                         keep: Callable[[int, list[int], RowCache], None] | None = None
                         ) -> tuple[Rollout, list[RowCache]]:
        """sample(), where prompt i continues the row whose keys and values past[i] holds (its tokens follow
        past[i]'s), and -> each sampled row's cache too (RowCache: its prompt, past and samples but the last
        token), for a later call to continue from: a new turn runs only its new tokens. keep(row, sampled tokens,
        cache): takes each row's cache as its slot finishes instead (the returned list is then empty), so that a
        caller who keeps only some (rlora serve's prefix cache, within its budget) never holds them all."""
        if past is not None and len(past) != len(prompts):
            raise ValueError(f"{len(past)} caches for {len(prompts)} prompts")
        caches: dict[int, RowCache] = {}
        rollout = self._sample(model, prompts, n, params, seed, keys, policies, None, past, route_by,
                               keep or (lambda row, _, row_cache: caches.__setitem__(row, row_cache)))
        return rollout, [caches[row] for row in range(len(caches))]

    def _sample(self, model, prompts, n, params, seed, keys, policies, on_token, past, route_by, keep) -> Rollout:
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        keys = list(range(len(prompts))) if keys is None else list(keys)
        seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
        if not len(per_prompt) == len(seeds) == len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling settings and {len(seeds)} seeds for {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        if route_by is not None and len(route_by) != len(prompts):
            raise ValueError(f"{len(route_by)} routing prompts for {len(prompts)} prompts")
        was_training = model.training
        model.eval()
        try:
            view = self.decoder_view(model)
            # MoLoRA layers are called routed by their rows' prompts, several policies by their rows' policies
            with (sampler_routing(model, prompts if route_by is None else list(route_by), n) as routing,
                  SamplerPolicies(model, None if policies is None else list(policies), n, view.device) as rows):
                return self._decode_call(view, _Call(prompts, n, per_prompt, seeds, keys, past), _RowContexts(routing, rows),
                                         on_token, keep)
        finally:
            model.train(was_training)
            if not self.keep_packs:
                for packs in self._onednn_packs.values():
                    packs.clear()

    def _decode_call(self, view: DecoderView, call: "_Call", routing: "_RowContexts",
                     on_token: Callable[[int, int], None] | None,
                     keep: Callable[[int, list[int], RowCache], None] | None) -> Rollout:
        device, G, prompts, past = view.device, call.G, call.prompts, call.past
        max_new = max(p.max_new_tokens for p in call.per_prompt)
        # prompts admitted together are prefilled side by side: their pasts left-padded to the longest past, then
        # their new tokens left-padded to the longest of those, so a slot's prompt part may need both maxima
        longest = max(map(len, prompts)) + (0 if past is None else max(c.length for c in past))
        S = min(len(prompts), max(1, (self.max_rows or rows_that_fit(view, max_new, longest)) // G))
        params = RowParams.per_row(call.per_prompt, G, device)
        eos_V = torch.zeros(view.lm_head.sizes[0], dtype=torch.bool, device=device)
        eos_V[self.eos_ids] = True
        stops = StopStrings(self.tokenizer, [p.stop for p in call.per_prompt for _ in range(G)])
        phases = think_phases(call.per_prompt, G)
        spans = RowPhases(self._decode, phases, params, max_new) if any(phases) else None
        mode = self._decode_mode(view)
        on_host = mode == "eager" or on_token is not None or spans is not None or stops.any
        rows_call = CallRows(params, call.keys_B(device), call.seed(device), eos_V, G,
                             plan=None if on_host else DrawPlan.of(params))
        host = HostHooks(rows_call, stops if stops.any else None, on_token, spans) if on_host else None
        cache = KVCache(view, S, G, max_new, longest, view.dtype, device)
        slots = Slots(S, G, device)
        static = None if mode == "eager" else StaticDecoder(
            view, cache, S, G, graph=mode == "graph",
            draw=None if on_host or rows_call.plan.truncate else lambda logits, t_B: rows_call.draw(logits, slots.rows_B, t_B))

        def admit(free: list[int], taken: list[int]) -> torch.Tensor:
            routing.prompts(taken)
            ids_nT, mask_nT = (x.to(device) for x in left_padded([prompts[i] for i in taken], self.pad_id))
            logits_nV, layers, mask_nT = prefill(view, ids_nT, mask_nT, None if past is None else [past[i] for i in taken])
            cache.admit(torch.tensor(free, device=device), layers, mask_nT)
            slots.place(free, taken, mask_nT.sum(-1))
            if static is not None:
                routing.rows(slots.rows_B)  # the fixed-shape step runs every slot row
                if routing.routes:
                    static.forget_graph()  # the graph read the previous rows' routing
            return logits_nV

        def eager_step(slots: Slots, live_A: torch.Tensor):
            routing.rows(slots.rows_B[live_A])
            t_B = slots.t_S.repeat_interleave(G)
            t_A, rows_A = t_B[live_A], slots.rows_B[live_A]
            logits_AV = decode_step(view, slots.token_B[live_A], live_A, slots.prompt_len_B[live_A] + t_A, t_B,
                                    int(t_A.max()) + 1, cache, S, G)
            return (*rows_call.draw(logits_AV, rows_A, t_A + 1, host.settings(rows_A, t_A + 1)), live_A)

        def static_step(slots: Slots, live_A: torch.Tensor | None):
            t_B = slots.t_S.repeat_interleave(G)
            out = static(slots.token_B, slots.prompt_len_B + t_B, slots.t_S)
            if static.draw is not None:
                return (*out, torch.arange(S * G, device=device))
            ran_A = torch.arange(S * G, device=device) if live_A is None else live_A
            rows_A, t_next_A = slots.rows_B[ran_A], t_B[ran_A] + 1
            settings = None if host is None else host.settings(rows_A, t_next_A)
            return (*rows_call.draw(out[ran_A], rows_A, t_next_A, settings), ran_A)

        def release(slot: int) -> None:
            rows_G = torch.arange(G) + slots.prompt_S[slot] * G
            on_device = rows_G.to(device)  # one read back: each row's length, then its tokens
            read = torch.cat([done.length_B[on_device, None], done.tokens_BT[on_device]], dim=1).tolist()
            lengths = [r[0] for r in read]
            for row, row_cache, r in zip(rows_G.tolist(), slot_row_caches(cache, slot, lengths), read):
                keep(row, r[1:1 + r[0]], row_cache)

        done = RowsOnDevice.empty(len(prompts) * G, max_new, self.pad_id, device)
        decode(rows_call, slots, len(prompts), admit, eager_step if mode == "eager" else static_step, done, host,
               None if keep is None else release, self.continuous)
        reasons = ["stop" if stopped else "length" for stopped in done.stopped_B.tolist()]
        temperature_BT = None if spans is None else spans.temperature_BT
        return self._rollout(prompts, G, done, reasons, params.temperature_A, temperature_BT)

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _rollout(self, prompts, n, done: RowsOnDevice, reasons: list[str], temperature_B: torch.Tensor,
                 temperature_BT: torch.Tensor | None) -> Rollout:
        """The call's rollout, its tensors on the sampler's device (a training step keeps them there); the texts
        are decoded from one host copy of the tokens."""
        device = done.tokens_BT.device
        keep = int(done.length_B.max())
        mask_BT = (torch.arange(keep, device=device)[None] < done.length_B[:, None]).long()
        tokens_BT = done.tokens_BT[:, :keep].masked_fill(mask_BT == 0, self.pad_id)
        logp_BT = done.logp_BT[:, :keep] * mask_BT
        lengths = done.length_B.tolist()
        texts = self.tokenizer.batch_decode([row[:length] for row, length in zip(tokens_BT.tolist(), lengths)],
                                            skip_special_tokens=True)
        prompt_ids, prompt_mask = (x.to(device) for x in left_padded([p for p in prompts for _ in range(n)], self.pad_id))
        return Rollout(
            prompt_ids_BTp=prompt_ids, prompt_mask_BTp=prompt_mask, completion_ids_BTc=tokens_BT,
            completion_mask_BTc=mask_BT, completions=texts, finish_reasons=reasons,
            temperature_B=temperature_B, sampling_logp_BTc=logp_BT,
            temperature_BTc=None if temperature_BT is None else temperature_BT[:, :keep].to(device) * mask_BT,
        )


class _Call:
    """The prompts of one sampler call and what decides their rows' draws."""

    def __init__(self, prompts, G: int, per_prompt: list[SamplingParams], seeds: list[int], keys: list[int], past):
        self.prompts, self.G, self.per_prompt, self.seeds, self.keys = prompts, G, per_prompt, seeds, keys
        self.past = None if past is None else list(past)

    def keys_B(self, device) -> torch.Tensor:
        """Each row's key: its prompt's key * G + its sample index."""
        return (torch.tensor(self.keys, dtype=torch.int64)[:, None] * self.G + torch.arange(self.G)).reshape(-1).to(device)

    def seed(self, device) -> int | torch.Tensor:
        """One seed for the call (the usual case) keeps the scalar hash; several: one per row."""
        if len(set(self.seeds)) == 1:
            return self.seeds[0]
        return torch.tensor(self.seeds, dtype=torch.int64, device=device).repeat_interleave(self.G)


class _RowContexts:
    """What the layers need to know about the rows of the next forward: MoLoRA's prompt routing and the rows'
    policy adapters (each a no-op where the model has none). Rows and prompts are the call's."""

    def __init__(self, routing: SamplerRouting, policies: SamplerPolicies):
        self.parts = (routing, policies)
        self.routes = any(part.routes for part in self.parts)

    def prompts(self, index_n: list[int]) -> None:
        for part in self.parts:
            part.prompts(index_n)

    def rows(self, rows_A: torch.Tensor) -> None:
        for part in self.parts:
            part.rows(rows_A)
