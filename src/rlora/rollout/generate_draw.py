"""The built-in engine's draw inside transformers `generate`, for the models the engine does not run.

`generate` computes each step's logits; `EngineDraw`, a logits processor, then draws the token exactly as the
built-in engine would from those logits (rollout/sampling.py: each row's own temperature, top-k, top-p, min-p and
greedy setting, EOS banned until min_new_tokens, think phases, the counter-based uniform of (seed, row key, token
index)), records its sampling log-prob and returns scores whose argmax is that token, so `generate` (run greedy,
with no processor of its own: `plain_generation`) takes it. `EngineStops` ends a row where the engine would: at the
token that completes one of its stop strings in the completion's text (generate's own stop-string check also reads
the prompt, so a string that began there would end a row the engine continues). What this gives the fallback path:

- the sampler's log-probs (truncated importance sampling, replay, `sampler_logp_gap`), which the trainer's differ
  from only by the float rounding of another forward;
- draws that depend on (seed, key, t) alone, as the engine's: a row samples the same tokens in any batch and on any
  rank, unless float rounding of another batch shape moves a draw across a boundary (each call is left-padded to
  its longest prompt), and a seed per prompt costs nothing (generate's own sampler draws from one stream per call);
- per-row settings and think phases within one `generate` call;
- every drawn token on the host as it is drawn (on_token: `rlora chat` shows replies as they are written).

The logits `generate` hands to processors are float32 copies of the model's last position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

from rlora.rollout.phase import RowPhases, think_phases
from rlora.rollout.sampling import DrawPlan, RowParams, counter_uniform, sample_tokens
from rlora.rollout.stops import StopStrings
from rlora.types import SamplingParams


@contextmanager
def plain_generation(hf_model) -> Iterator[None]:
    """The transformers model's own generation_config blank while `generate` runs: generate fills every setting its
    config leaves unset from it, and a checkpoint's suppress_tokens, bad_words_ids, sequence_bias, forced EOS, length
    penalties, stop strings or min lengths would become processors and criteria of generate's own, run before the
    draw, changing the tokens and the log-probs it records."""
    kept = hf_model.generation_config
    hf_model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = kept


class EngineDraw(LogitsProcessor):
    """Draws token t of every row of one `generate` call (B rows, one SamplingParams each, left-padded prompts of width
    prompt_width) and forces `generate` to take it. seed: one for all rows or int64 [B]; keys_B: each row's key.
    After the call: logp_BT (float32, the log-prob of each drawn token under the temperature-scaled, untruncated
    distribution; entries past a row's end are whatever was drawn there, masked by the caller), temperature_BT, and
    each row's `length` and whether it `ended` (at EOS or a stop string; else it ran to the length limit)."""

    def __init__(self, params: list[SamplingParams], seed: int | torch.Tensor, keys_B: torch.Tensor,
                 eos_ids: list[int], prompt_width: int, decode: Callable[[list[int]], str], device,
                 on_token: Callable[[int, int], None] | None = None, stops: StopStrings | None = None):
        """on_token(row, token): each row's tokens as they are drawn, up to its end (EOS, or the token that completes
        one of its stop strings, `stops`), as the engine calls it."""
        self.rows = RowParams.per_row(params, 1, device)
        self.seed = seed.to(device) if isinstance(seed, torch.Tensor) else seed
        self.keys_B = keys_B.to(device)
        self.eos_ids, self.prompt_width = eos_ids, prompt_width
        max_new = max(p.max_new_tokens for p in params)
        phases = think_phases(params, 1)
        self.phases = RowPhases(decode, phases, self.rows, max_new) if any(phases) else None
        # think phases change a row's top-p between draws: decided per draw then, as the engine's host loop does
        self.plan = None if self.phases is not None else DrawPlan.of(self.rows)
        self.logp_BT = torch.zeros(len(keys_B), max_new, device=device)
        self.on_token, self.stops = on_token, stops if stops is not None and stops.any else None
        # each row's tokens on the host (the think phases, on_token and the stop strings look at them; generate reads
        # every step's tokens back to the host anyway), whether it ended (EOS or a stop string) and its length then
        self.tokens: dict[int, list[int]] = {row: [] for row in range(len(keys_B))}
        self.ended = [False] * len(keys_B)
        self.length = [0] * len(keys_B)
        self.eos_V: torch.Tensor | None = None

    @property
    def temperature_BT(self) -> torch.Tensor:
        """The temperature each token was drawn at (think phases switch it; else each row's own)."""
        if self.phases is not None:
            return self.phases.temperature_BT
        return self.rows.temperature_A.float().cpu()[:, None].expand(self.logp_BT.shape).clone()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        B, V = scores.shape
        t = input_ids.shape[1] - self.prompt_width  # tokens drawn so far, the same for every row of the call
        if self.eos_V is None:  # the logits' width (a model may pad its vocabulary past the tokenizer's)
            self.eos_V = torch.zeros(V, dtype=torch.bool, device=scores.device)
            self.eos_V[[e for e in self.eos_ids if e < V]] = True
        params = self.rows
        if self.phases is not None:  # the settings inside or outside each row's span
            params = self.phases.settings(self.rows, torch.arange(B, device=scores.device),
                                          torch.full((B,), t, dtype=torch.long, device=scores.device))
        banned_A = params.min_new_A > t
        u_A = counter_uniform(self.seed, self.keys_B, t)
        token_A, logp_A = sample_tokens(scores, params, u_A, banned_A, self.eos_V, self.plan)
        self.logp_BT[:, t] = logp_A.float()
        self._seen(token_A.tolist())
        # generate runs greedy: the only finite score is the drawn token's
        return torch.full_like(scores, float("-inf")).scatter_(1, token_A[:, None], 0.0)

    def _seen(self, drawn: list[int]) -> None:
        """The host's part of a draw, as the engine's HostHooks: on_token for the rows still running, the end of a
        row at EOS or its stop string, then the think phases' switch."""
        for row, token in enumerate(drawn):
            self.tokens[row].append(token)
            if self.ended[row]:
                continue
            self.length[row] = len(self.tokens[row])
            if self.on_token is not None:
                self.on_token(row, token)
            self.ended[row] = token in self.eos_ids or (self.stops is not None
                                                        and self.stops.hit(row, self.tokens[row]))
        if self.phases is not None:
            self.phases.advance(self.tokens, list(range(len(drawn))))


class EngineStops(StoppingCriteria):
    """Ends the rows whose stop string EngineDraw found in the completion's text (EOS ends them by itself)."""

    def __init__(self, draw: EngineDraw):
        self.draw = draw

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.tensor(self.draw.ended, dtype=torch.bool, device=input_ids.device)
