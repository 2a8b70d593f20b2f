"""Algorithms by name: each is an advantage function and a per-token loss. A new one is one entry here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlora.algos.advantages import group_advantages
from rlora.algos.losses import LossInputs, TokenLosses, grpo_token_loss


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: Callable[..., torch.Tensor]  # (rewards_P_G, scale, eps) -> advantages_P_G
    token_loss: Callable[..., TokenLosses]  # (LossInputs, clip_low, clip_high, beta) -> TokenLosses


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm("grpo", group_advantages, grpo_token_loss),
}


def get_algorithm(name: str) -> Algorithm:
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "Algorithm", "LossInputs", "get_algorithm"]
