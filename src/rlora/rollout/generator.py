"""The Generator protocol, and the fallback implementation on top of Hugging Face `generate`.

A Generator turns P tokenised prompts into P x G sampled completions (prompt-major), with one set of
sampling settings for all prompts or one per prompt. The built-in engine (rollout/engine.py) is the fast
implementation; HFGenerator serves models the engine does not support.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from rlora.batching import concat_rollouts, select_rows
from rlora.models.loading import causal_lm
from rlora.models.molora_runtime import prompt_list_routing
from rlora.models.multi_lora import policy_rows
from rlora.rollout.generate_draw import EngineDraw, EngineStops, plain_generation
from rlora.rollout.stops import StopStrings
from rlora.tensors import left_padded, pad_right
from rlora.types import Rollout, SamplingParams


class Generator(Protocol):
    name: str

    def sample(
        self, model: torch.nn.Module, prompts: list[list[int]], n: int,
        params: SamplingParams | Sequence[SamplingParams], seed: int | Sequence[int], keys: Sequence[int] | None = None,
        policies: Sequence[int] | None = None, on_token: Callable[[int, int], None] | None = None,
        route_by: Sequence[list[int]] | None = None,
    ) -> Rollout:
        """-> Rollout with n completions per prompt (prompt-major), their masks, finish reasons, the
        temperature of each row (and of each token, with think phases) and the per-token sampling log-probs.
        seed: one, or one per prompt; keys: an integer per prompt (default its position) that with its seed alone
        decides its rows' draws; policies: the policy adapter of each prompt on a model with several; route_by:
        the prompts a MoLoRA sequence router routes each prompt's rows by (default the prompts; an episode's later
        turn passes its first prompt); on_token(row, token): each token as it is drawn."""
        ...


class HFGenerator:
    """Samples with `model.generate` (adapter active, unmerged), each token drawn as the built-in engine draws it
    (rollout/generate_draw.py): the same settings per row, the same (seed, key, t) draws, the sampling log-probs."""

    name = "hf"

    def __init__(self, tokenizer, eos_ids: list[int], pad_id: int, batch_size: int = 64):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.batch_size = batch_size

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        """generate runs greedy over the scores EngineDraw leaves (only the drawn token's is finite), with no
        processor or criterion of its own but the length and EOS (the model's generation_config is blank meanwhile:
        plain_generation): min_new_tokens is EngineDraw's (generate's would ban EOS before the draw and change the
        log-prob's normaliser), the stop strings EngineStops'."""
        return GenerationConfig(do_sample=False, max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_ids,
                                pad_token_id=self.pad_id)

    @torch.no_grad()
    def sample(self, model, prompts: list[list[int]], n: int, params: SamplingParams | Sequence[SamplingParams],
               seed: int | Sequence[int], keys: Sequence[int] | None = None,
               policies: Sequence[int] | None = None, on_token: Callable[[int, int], None] | None = None,
               route_by: Sequence[list[int]] | None = None) -> Rollout:
        """on_token(row, token): every token as it is drawn, as the engine calls it (row: prompt-major, as in the
        rollout)."""
        count = len(prompts)
        per_prompt = [params] * count if isinstance(params, SamplingParams) else list(params)
        seeds = [seed] * count if isinstance(seed, int) else list(seed)
        keys = list(range(count)) if keys is None else list(keys)
        if not len(per_prompt) == len(seeds) == len(keys) == count:
            raise ValueError(f"{len(per_prompt)} sampling settings, {len(seeds)} seeds and {len(keys)} keys for "
                             f"{count} prompts")
        if route_by is not None and len(route_by) != count:
            raise ValueError(f"{len(route_by)} routing prompts for {count} prompts")
        if policies is None:
            return self._sample(model, prompts, n, per_prompt, seeds, keys, route_by, None, on_token, range(count * n))
        # several policies: one call of each policy's prompts (in order), its rows through its adapter; a row's draws
        # depend on its seed and key alone, so they are those of the same prompts sampled together
        order, parts = [], []
        for policy in dict.fromkeys(policies):
            mine = [i for i in range(count) if policies[i] == policy]
            parts.append(self._sample(model, [prompts[i] for i in mine], n, [per_prompt[i] for i in mine],
                                      [seeds[i] for i in mine], [keys[i] for i in mine],
                                      None if route_by is None else [route_by[i] for i in mine], policy, on_token,
                                      [i * n + j for i in mine for j in range(n)]))
            order += mine
        rollout = concat_rollouts(parts, self.pad_id)
        row_of = {prompt: place for place, prompt in enumerate(order)}
        return select_rows(rollout, [row_of[i] * n + j for i in range(count) for j in range(n)])

    def _sample(self, model, prompts, n, per_prompt: list[SamplingParams], seeds: list[int], keys: list[int],
                route_by, policy: int | None, on_token: Callable[[int, int], None] | None,
                caller_rows: Sequence[int]) -> Rollout:
        """The prompts' n rows each (prompt-major); policy: the adapter every row goes through, on a model with
        several; caller_rows: each row's index in the caller's rollout (on_token's row)."""
        repeated = [p for p in prompts for _ in range(n)]  # prompt-major: G samples of prompt 0 first
        routed = repeated if route_by is None else [p for p in route_by for _ in range(n)]
        row_params = [p for p in per_prompt for _ in range(n)]
        row_seeds = torch.tensor([s for s in seeds for _ in range(n)], dtype=torch.int64)
        # the engine's row keys: prompt key x n + sample index
        row_keys = (torch.tensor(keys, dtype=torch.int64)[:, None] * n + torch.arange(n)).reshape(-1)
        prompt_ids_BTp, prompt_mask_BTp = left_padded(repeated, self.pad_id)
        device = next(model.parameters()).device
        hf = causal_lm(model)
        was_training = model.training
        model.eval()
        chunks = []
        try:
            for start in range(0, len(repeated), self.batch_size):
                # generate takes one length limit per call (EngineDraw every other setting per row)
                for lo, hi in _runs(row_params, start, min(start + self.batch_size, len(repeated))):
                    ids, mask = (t[lo:hi].to(device) for t in (prompt_ids_BTp, prompt_mask_BTp))
                    call_seeds = row_seeds[lo:hi]
                    one_seed = bool((call_seeds == call_seeds[0]).all())  # the scalar hash, as the engine's call
                    reported = None if on_token is None else \
                        (lambda row, token, first=lo: on_token(caller_rows[first + row], token))
                    draw = EngineDraw(row_params[lo:hi], int(call_seeds[0]) if one_seed else call_seeds,
                                      row_keys[lo:hi], self.eos_ids, ids.shape[1], self._decode, device, reported,
                                      StopStrings(self.tokenizer, [p.stop for p in row_params[lo:hi]]))
                    rows = None if policy is None else torch.full((hi - lo,), policy, dtype=torch.long)
                    # MoLoRA: rows routed by their prompts; several policies: every row through this one
                    with prompt_list_routing(model, routed[lo:hi]), policy_rows(model, rows), plain_generation(hf):
                        out = model.generate(input_ids=ids, attention_mask=mask,
                                             generation_config=self._generation_config(row_params[lo]),
                                             logits_processor=LogitsProcessorList([draw]),
                                             stopping_criteria=StoppingCriteriaList([EngineStops(draw)]))
                    chunks.append((*_ends(out[:, ids.shape[1]:].cpu(), draw), draw))
        finally:
            model.train(was_training)
        # each call's masks are made before padding the calls to one width (pad may equal EOS)
        width = max(ids.shape[1] for ids, *_ in chunks)
        completion_ids_BTc = torch.cat([pad_right(ids, width, self.pad_id) for ids, *_ in chunks])
        mask_BTc = torch.cat([pad_right(mask, width) for _, mask, _, _ in chunks])
        reasons = [r for _, _, chunk_reasons, _ in chunks for r in chunk_reasons]
        temperature_BTc = None  # per token only where think phases switched it, as the engine's rollouts
        if any(draw.phases is not None for *_, draw in chunks):
            temperature_BTc = torch.cat([pad_right(draw.temperature_BT[:, :width], width, 0.0)
                                         for *_, draw in chunks]) * mask_BTc
        completion_ids_BTc = completion_ids_BTc.masked_fill(mask_BTc == 0, self.pad_id)
        texts = self.tokenizer.batch_decode(
            [row[row_mask.bool()] for row, row_mask in zip(completion_ids_BTc, mask_BTc)], skip_special_tokens=True
        )
        # on the sampler's device, as the engine's rollouts (the token ids came to the host once, to be decoded;
        # the log-probs never leave the device)
        mask_BTc = mask_BTc.to(device)
        logp_BTc = torch.cat([pad_right(draw.logp_BT[:, :width], width, 0.0) for *_, draw in chunks]) * mask_BTc
        return Rollout(
            prompt_ids_BTp=prompt_ids_BTp.to(device), prompt_mask_BTp=prompt_mask_BTp.to(device),
            completion_ids_BTc=completion_ids_BTc.to(device), completion_mask_BTc=mask_BTc,
            completions=texts, finish_reasons=reasons,
            temperature_B=torch.tensor([1.0 if p.greedy else p.temperature for p in row_params], device=device),
            sampling_logp_BTc=logp_BTc, temperature_BTc=None if temperature_BTc is None else temperature_BTc.to(device),
        )

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def _ends(ids_BT: torch.Tensor, draw: EngineDraw) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(ids, mask, finish reasons) of one generate call's completions, each row up to where EngineDraw saw it end: its
    EOS or the token that completes one of its stop strings in the completion's text ("stop"), else the length limit
    (generate ends rows there, and nowhere else: EngineStops)."""
    width = ids_BT.shape[1]
    length_B = torch.tensor([length if ended else width for length, ended in zip(draw.length, draw.ended)])
    mask_BT = (torch.arange(width)[None] < length_B[:, None]).long()
    return ids_BT, mask_BT, ["stop" if ended else "length" for ended in draw.ended]


def _runs(row_params: list[SamplingParams], lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) split into maximal runs of one length limit."""
    runs, start = [], lo
    for i in range(lo + 1, hi + 1):
        if i == hi or row_params[i].max_new_tokens != row_params[start].max_new_tokens:
            runs.append((start, i))
            start = i
    return runs
