"""The Generator protocol, and the fallback implementation on top of Hugging Face `generate`.

A Generator turns P tokenised prompts into P x G sampled completions (prompt-major), with one set of
sampling settings for all prompts or one per prompt. The built-in engine (rollout/engine.py) is the fast
implementation; HFGenerator serves models the engine does not support.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import GenerationConfig

from rlora.batching import concat_rollouts, select_rows
from rlora.models.molora_runtime import prompt_list_routing
from rlora.models.multi_lora import policy_rows
from rlora.tensors import left_padded, pad_right
from rlora.types import Rollout, SamplingParams


class Generator(Protocol):
    name: str

    def sample(
        self, model: torch.nn.Module, prompts: list[list[int]], n: int,
        params: SamplingParams | Sequence[SamplingParams], seed: int | Sequence[int], keys: Sequence[int] | None = None,
        policies: Sequence[int] | None = None, route_by: Sequence[list[int]] | None = None,
    ) -> Rollout:
        """-> Rollout with n completions per prompt (prompt-major), their masks, finish reasons, the
        temperature of each row and, where the backend has them, the per-token sampling log-probs. seed: one,
        or one per prompt; policies: the policy adapter of each prompt on a model with several (built-in
        engine only); route_by: the prompts a MoLoRA sequence router routes each prompt's rows by (default the
        prompts; an episode's later turn passes its first prompt)."""
        ...


def completion_mask(completion_ids_BTc: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, list[str]]:
    """1 on tokens up to and including the first EOS; finish reason per row."""
    is_eos_BTc = torch.isin(completion_ids_BTc, torch.tensor(eos_ids, dtype=torch.long))
    # eos_seen_before[t] = any EOS at positions < t
    eos_before_BTc = (is_eos_BTc.long().cumsum(-1) - is_eos_BTc.long()) > 0
    mask_BTc = (~eos_before_BTc).long()
    reasons = ["stop" if row.any() else "length" for row in is_eos_BTc]
    return mask_BTc, reasons


class HFGenerator:
    """Samples with `model.generate` (adapter active, unmerged). Reproducible for a given seed.
    Returns no sampling log-probs (generate's scores would cost a [T, B, vocab] copy)."""

    name = "hf"

    def __init__(self, tokenizer, eos_ids: list[int], pad_id: int, batch_size: int = 64):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.batch_size = batch_size

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        """Every sampling knob is set explicitly: transformers fills unset (None) fields from the model's
        generation_config and then its global defaults (top_k=50!), which would silently change the
        distribution the training log-probs assume. top_k=0 means off."""
        common = dict(max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens or None,
                      eos_token_id=self.eos_ids, pad_token_id=self.pad_id, repetition_penalty=1.0,
                      no_repeat_ngram_size=0, stop_strings=list(params.stop) or None)
        if params.greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                                top_k=params.top_k, min_p=params.min_p or None, typical_p=1.0, **common)

    @torch.no_grad()
    def sample(self, model, prompts: list[list[int]], n: int, params: SamplingParams | Sequence[SamplingParams],
               seed: int | Sequence[int], keys: Sequence[int] | None = None,
               policies: Sequence[int] | None = None, route_by: Sequence[list[int]] | None = None) -> Rollout:
        # keys are ignored: generate draws from one stream, so samples depend on the batch composition
        if policies is not None:
            return self._per_policy(model, prompts, n, params, seed, policies, route_by)
        if not isinstance(seed, int):
            raise ValueError("a seed per prompt needs rollout.engine=builtin (or several policies, one seed each)")
        return self._sample(model, prompts, n, params, seed, route_by, None)

    def _per_policy(self, model, prompts, n, params, seed, policies, route_by) -> Rollout:
        """Several policies' prompts: one call of each policy's prompts (in order) with its rows through its
        adapter and its seed, the call a run of that policy alone makes; the rows back in the prompts' order."""
        count = len(prompts)
        per_prompt = [params] * count if isinstance(params, SamplingParams) else list(params)
        seeds = [seed] * count if isinstance(seed, int) else list(seed)
        order, parts = [], []
        for policy in dict.fromkeys(policies):
            mine = [i for i in range(count) if policies[i] == policy]
            if len({seeds[i] for i in mine}) > 1:
                raise ValueError("rollout.engine=hf draws each policy's prompts with one seed")
            parts.append(self._sample(model, [prompts[i] for i in mine], n, [per_prompt[i] for i in mine],
                                      seeds[mine[0]], None if route_by is None else [route_by[i] for i in mine],
                                      policy))
            order += mine
        rollout = concat_rollouts(parts, self.pad_id)
        row_of = {prompt: place for place, prompt in enumerate(order)}
        return select_rows(rollout, [row_of[i] * n + j for i in range(count) for j in range(n)])

    def _sample(self, model, prompts, n, params, seed: int, route_by, policy: int | None) -> Rollout:
        """One stream of draws (seed) over the prompts; policy: the adapter every row goes through, on a model with
        several."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if any(p.think is not None for p in per_prompt):  # generate takes one temperature per call
            raise ValueError("phase-aware sampling (rollout.think) needs rollout.engine=builtin")
        repeated = [p for p in prompts for _ in range(n)]  # prompt-major: G samples of prompt 0 first
        if route_by is not None and len(route_by) != len(prompts):
            raise ValueError(f"{len(route_by)} routing prompts for {len(prompts)} prompts")
        routed = repeated if route_by is None else [p for p in route_by for _ in range(n)]
        row_params = [p for p in per_prompt for _ in range(n)]
        prompt_ids_BTp, prompt_mask_BTp = left_padded(repeated, self.pad_id)
        torch.manual_seed(seed)  # seeds the GPUs too
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        chunks = []
        try:
            for start in range(0, len(repeated), self.batch_size):
                # generate takes one setting per call: split the batch where the settings change
                for lo, hi in _runs(row_params, start, min(start + self.batch_size, len(repeated))):
                    ids, mask = (t[lo:hi].to(device) for t in (prompt_ids_BTp, prompt_mask_BTp))
                    rows = None if policy is None else torch.full((hi - lo,), policy, dtype=torch.long)
                    # MoLoRA: rows routed by their prompts; several policies: every row through this one
                    with prompt_list_routing(model, routed[lo:hi]), policy_rows(model, rows):
                        out = model.generate(input_ids=ids, attention_mask=mask, tokenizer=self.tokenizer,
                                             generation_config=self._generation_config(row_params[lo]))
                    chunks.append(_masked(out[:, ids.shape[1]:].cpu(), row_params[lo], self.tokenizer, self.eos_ids,
                                          self.pad_id))
        finally:
            model.train(was_training)
        # each call's masks are made before padding the calls to one width (pad may equal EOS)
        width = max(ids.shape[1] for ids, _, _ in chunks)
        completion_ids_BTc = torch.cat([pad_right(ids, width, self.pad_id) for ids, _, _ in chunks])
        mask_BTc = torch.cat([pad_right(mask, width) for _, mask, _ in chunks])
        reasons = [r for _, _, chunk_reasons in chunks for r in chunk_reasons]
        completion_ids_BTc = completion_ids_BTc.masked_fill(mask_BTc == 0, self.pad_id)
        texts = self.tokenizer.batch_decode(
            [row[row_mask.bool()] for row, row_mask in zip(completion_ids_BTc, mask_BTc)], skip_special_tokens=True
        )
        return Rollout(
            prompt_ids_BTp=prompt_ids_BTp, prompt_mask_BTp=prompt_mask_BTp,
            completion_ids_BTc=completion_ids_BTc, completion_mask_BTc=mask_BTc,
            completions=texts, finish_reasons=reasons,
            temperature_B=torch.tensor([1.0 if p.greedy else p.temperature for p in row_params]),
        )


def _masked(ids_BT: torch.Tensor, params: SamplingParams, tokenizer, eos_ids: list[int], pad_id: int):
    """Mask and finish reason of one generate call's completions: up to the first EOS, or up to the
    token that completes a stop string. A row generate stopped for another reason (a stop string
    that began in the prompt) is followed by padding: it ends before that padding."""
    mask_BT, reasons = completion_mask(ids_BT, eos_ids)
    if params.stop:
        mask_BT, reasons = _cut_at_stop_strings(tokenizer, ids_BT, mask_BT, reasons, params.stop)
        for row, reason in enumerate(reasons):
            length = int(mask_BT[row].sum())
            if reason == "length" and length < params.max_new_tokens:
                real = (ids_BT[row, :length] != pad_id).nonzero()
                mask_BT[row, int(real[-1]) + 1 if len(real) else 0:] = 0
                reasons[row] = "stop"
    return ids_BT, mask_BT, reasons


def _runs(row_params: list[SamplingParams], lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) split into maximal runs of equal settings."""
    runs, start = [], lo
    for i in range(lo + 1, hi + 1):
        if i == hi or row_params[i] != row_params[start]:
            runs.append((start, i))
            start = i
    return runs


def _cut_at_stop_strings(tokenizer, ids_BT, mask_BT, reasons, stops: tuple[str, ...]):
    """Keep each row's tokens up to the one that completes its first stop string (generate's stopping
    criterion runs on token sequences; this applies the text-level rule of the built-in engine)."""
    mask_BT, reasons = mask_BT.clone(), list(reasons)
    finder = StopStrings(tokenizer, [stops] * ids_BT.shape[0])
    for row in range(ids_BT.shape[0]):
        tokens = ids_BT[row, :int(mask_BT[row].sum())].tolist()
        end = next((t for t in range(1, len(tokens) + 1) if finder.hit(row, tokens[:t])), None)
        if end is not None:
            mask_BT[row, end:] = 0
            reasons[row] = "stop"
    return mask_BT, reasons


class StopStrings:
    """Finds each row's stop strings in the text of its newest tokens (decoding only a short tail)."""

    def __init__(self, tokenizer, stops_per_row: list[tuple[str, ...]]):
        self.tokenizer = tokenizer
        self.stops = [[s for s in stops if s] for stops in stops_per_row]
        # a token decodes to >= 1 byte of text, so this many tokens always cover the longest stop string
        self.tail = max((len(s.encode("utf-8")) for stops in self.stops for s in stops), default=0) + 2
        self.any = any(self.stops)

    def hit(self, row: int, tokens: list[int]) -> bool:
        if not self.stops[row]:
            return False
        text = self.tokenizer.decode(tokens[-self.tail:], skip_special_tokens=False)
        return any(s in text for s in self.stops[row])
