"""Data passed between the stages of an RL step. Shapes are in the names: B completions (P prompts x G
samples, prompt-major: all G samples of prompt 0 first), Tp prompt positions, Tc completion positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_new_tokens: int = 0  # EOS cannot end a completion before this many tokens
    greedy: bool = False
    min_p: float = 0.0  # 0: off
    stop: tuple[str, ...] = ()  # a completion ends after the token that completes one of these strings


@dataclass
class Rollout:
    """Sampled completions, padded: prompts on the left, completions on the right."""

    prompt_ids_BTp: torch.Tensor  # left-padded prompt tokens
    prompt_mask_BTp: torch.Tensor  # 1 on real prompt tokens
    completion_ids_BTc: torch.Tensor  # right-padded completion tokens (EOS included when sampled)
    completion_mask_BTc: torch.Tensor  # 1 on completion tokens up to and including the first EOS
    completions: list[str]  # decoded completion text (special tokens removed)
    finish_reasons: list[str]  # "stop" (EOS or a stop string) or "length" (hit max_new_tokens)
    temperature_B: torch.Tensor  # temperature each row was drawn at (training log-probs use the same)
    sampling_logp_BTc: torch.Tensor | None = None  # the sampler's log-probs of its tokens (0 on padding)

    @property
    def num_completions(self) -> int:
        return self.completion_ids_BTc.shape[0]

    def select(self, index: slice | torch.Tensor) -> "RolloutSlice":
        return RolloutSlice(
            self.prompt_ids_BTp[index], self.prompt_mask_BTp[index],
            self.completion_ids_BTc[index], self.completion_mask_BTc[index], self.temperature_B[index],
        )


@dataclass
class RolloutSlice:
    """The token tensors of some completions of a rollout (a micro-batch)."""

    prompt_ids_BTp: torch.Tensor
    prompt_mask_BTp: torch.Tensor
    completion_ids_BTc: torch.Tensor
    completion_mask_BTc: torch.Tensor
    temperature_B: torch.Tensor


@dataclass(frozen=True)
class Example:
    """One prompt with the extra columns passed to reward functions (answer, task entry, ...)."""

    prompt: str | list[dict[str, str]]  # user text, or a list of chat messages
    columns: dict[str, Any]
