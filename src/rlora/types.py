"""Data passed between the stages of an RL step. Shapes are in the names: B completions (P prompts x G
samples, prompt-major: all G samples of prompt 0 first), Tp prompt positions, Tc completion positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ThinkPhase:
    """Sampling settings used while a sample is inside a thinking span (between `start` and `end` in its
    text). top_k/min_p stay those of the SamplingParams."""

    start: str = "<think>"
    end: str = "</think>"
    temperature: float = 1.0
    top_p: float = 1.0
    starts_inside: bool = False  # the prompt already opened the span (e.g. a chat template ending in <think>)

    def __post_init__(self):
        # an empty marker would be found in any text: the phase would flip on every token
        if not self.start or not self.end:
            raise ValueError("ThinkPhase markers must be non-empty strings")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError("ThinkPhase needs temperature > 0 and 0 < top_p <= 1")


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
    think: ThinkPhase | None = None  # other temperature/top_p inside a thinking span (both samplers)


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
    # float32 temperature each token was drawn at (0 on padding); None: every token used temperature_B
    temperature_BTc: torch.Tensor | None = None
    # episodes of several turns (envs/episodes.py): 1 on the tokens the policy sampled, 0 on the environment's;
    # None: the policy sampled every completion token
    policy_mask_BTc: torch.Tensor | None = None

    @property
    def trained_mask_BTc(self) -> torch.Tensor:
        """1 on the completion tokens the policy sampled: what the loss, the KL and the entropy may cover."""
        return self.completion_mask_BTc if self.policy_mask_BTc is None else self.completion_mask_BTc * self.policy_mask_BTc

    @property
    def num_completions(self) -> int:
        return self.completion_ids_BTc.shape[0]

    def to(self, device: torch.device) -> "Rollout":
        """The same rollout with its tensors on `device` (each itself where it is there already). A copy to the host
        completes before this returns (a CUDA copy into pageable memory blocks): what the replay buffer keeps is
        whole."""
        move = lambda t: None if t is None else t.to(device, non_blocking=device.type != "cpu")  # noqa: E731
        return Rollout(move(self.prompt_ids_BTp), move(self.prompt_mask_BTp), move(self.completion_ids_BTc),
                       move(self.completion_mask_BTc), self.completions, self.finish_reasons, move(self.temperature_B),
                       move(self.sampling_logp_BTc), move(self.temperature_BTc), move(self.policy_mask_BTc))

    def select(self, index: slice | torch.Tensor) -> "RolloutSlice":
        return RolloutSlice(
            self.prompt_ids_BTp[index], self.prompt_mask_BTp[index],
            self.completion_ids_BTc[index], self.completion_mask_BTc[index], self.temperature_B[index],
            None if self.temperature_BTc is None else self.temperature_BTc[index],
        )


@dataclass
class RolloutSlice:
    """The token tensors of some completions of a rollout (a micro-batch)."""

    prompt_ids_BTp: torch.Tensor
    prompt_mask_BTp: torch.Tensor
    completion_ids_BTc: torch.Tensor
    completion_mask_BTc: torch.Tensor
    temperature_B: torch.Tensor
    temperature_BTc: torch.Tensor | None = None  # per-token temperatures (None: temperature_B everywhere)

    def to(self, device: torch.device) -> "RolloutSlice":
        """The same slice on `device` (each tensor itself where it is there already)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return RolloutSlice(move(self.prompt_ids_BTp), move(self.prompt_mask_BTp), move(self.completion_ids_BTc),
                            move(self.completion_mask_BTc), move(self.temperature_B), move(self.temperature_BTc))


@dataclass(frozen=True)
class Example:
    """One prompt with the extra columns passed to reward functions (answer, task entry, ...)."""

    prompt: str | list[dict[str, str]]  # user text, or a list of chat messages
    columns: dict[str, Any]
