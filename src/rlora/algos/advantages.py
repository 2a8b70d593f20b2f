"""Advantages: per completion (GRPO, RLOO) or per token (REINFORCE++), and DAPO's overlong shaping. Training
takes them per token, [B, T]: `per_token` broadcasts a completion's advantage to its positions where they are made.

GRPO: A_pg = (r_pg - mean_g r_pg) / (std + eps), with the std taken per group, over the whole batch, or
not at all (Dr.GRPO). The std is the unbiased sample std (divides by n - 1), as in the GRPO paper's
reference code and TRL. Groups whose rewards are all equal get A = 0: they carry no gradient.
RLOO: A_pg = r_pg - mean of the *other* valid samples of the group (leave-one-out baseline).
REINFORCE++: per-token return (outcome reward at the last token, -beta * KL on every token, gamma = 1),
whitened over all completion tokens of the batch.
NaN marks a sample whose reward failed: it is left out of every statistic and gets advantage 0.
Batch-wide statistics (adv_scale="batch", REINFORCE++'s whitening) take `all_sum`, which adds its values
over data-parallel ranks (the identity in one process), so every rank divides by the std of the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

AdvScale = Literal["group", "batch", "none"]
AllSum = Callable[[list[float]], list[float]]  # each value summed over the data-parallel ranks


def in_one_process(values: list[float]) -> list[float]:
    return values


def batch_std(values: torch.Tensor, all_sum: AllSum = in_one_process) -> float:
    """Unbiased std over the non-NaN entries of the whole batch, all ranks' (0 where fewer than two). Two
    passes, as _group_std: the mean first, then the squared deviations from it."""
    valid = ~torch.isnan(values)
    count, total = all_sum([float(valid.sum()), float(torch.nansum(values))])
    mean = total / max(count, 1)
    (squares,) = all_sum([float(torch.where(valid, (values - mean) ** 2, torch.zeros_like(values)).sum())])
    return math.sqrt(squares / (count - 1)) if count > 1 else 0.0


def _group_std(values_P_G: torch.Tensor) -> torch.Tensor:
    """Unbiased std of each row's non-NaN entries -> [P, 1] (0 where fewer than two)."""
    valid = ~torch.isnan(values_P_G)
    count = valid.sum(dim=1, keepdim=True)
    mean = torch.nansum(values_P_G, dim=1, keepdim=True) / count.clamp(min=1)
    squares = torch.where(valid, (values_P_G - mean) ** 2, torch.zeros_like(values_P_G))
    std = torch.sqrt(squares.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1))
    return torch.where(count > 1, std, torch.zeros_like(std))


def group_flags(rewards_P_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (failed_P_G, flat_P1): failed samples, and groups whose valid rewards are all equal (or none)."""
    failed = torch.isnan(rewards_P_G)
    valid_max = torch.where(failed, torch.full_like(rewards_P_G, -torch.inf), rewards_P_G).amax(dim=1, keepdim=True)
    valid_min = torch.where(failed, torch.full_like(rewards_P_G, torch.inf), rewards_P_G).amin(dim=1, keepdim=True)
    return failed, ~(valid_max > valid_min)


def _scale(centred_P_G: torch.Tensor, rewards_P_G: torch.Tensor, scale: AdvScale, eps: float,
           all_sum: AllSum) -> torch.Tensor:
    if scale == "group":
        return centred_P_G / (_group_std(rewards_P_G) + eps)
    if scale == "batch":
        return centred_P_G / (batch_std(rewards_P_G, all_sum) + eps)
    return centred_P_G


def _check_scale(scale: str) -> None:
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown advantage scale {scale!r}; use group, batch or none")


def group_advantages(rewards_P_G: torch.Tensor, scale: AdvScale = "group", eps: float = 1e-4,
                     all_sum: AllSum = in_one_process) -> torch.Tensor:
    """rewards_P_G: P prompts x G samples -> advantages_P_G (float32).

    NaN marks a sample whose reward failed: it is left out of every mean and std and gets advantage 0.
    Groups whose valid rewards are all equal get exactly 0 (computed in float64, then forced), so float
    rounding never pushes a whole zero-variance group one way.
    """
    _check_scale(scale)
    rewards = rewards_P_G.double()
    failed, flat_P1 = group_flags(rewards)
    group_mean_P1 = torch.nanmean(rewards, dim=1, keepdim=True).nan_to_num(0.0)
    centred_P_G = _scale(rewards - group_mean_P1, rewards, scale, eps, all_sum)
    centred_P_G = torch.where(failed | flat_P1, torch.zeros_like(centred_P_G), centred_P_G)
    return centred_P_G.float()


def rloo_advantages(rewards_P_G: torch.Tensor, scale: AdvScale = "none", eps: float = 1e-4,
                    all_sum: AllSum = in_one_process) -> torch.Tensor:
    """Leave-one-out baseline (Ahmadian et al. 2024): A_i = r_i - (sum_valid r - r_i) / (n_valid - 1), which
    equals n/(n-1) * (r_i - group mean). Optionally divided by a std like GRPO (default: not)."""
    _check_scale(scale)
    rewards = rewards_P_G.double()
    failed, flat_P1 = group_flags(rewards)
    count_P1 = (~failed).sum(dim=1, keepdim=True)
    total_P1 = torch.nansum(rewards, dim=1, keepdim=True)
    others_mean_P_G = (total_P1 - rewards.nan_to_num(0.0)) / (count_P1 - 1).clamp(min=1)
    centred_P_G = _scale(rewards - others_mean_P_G, rewards, scale, eps, all_sum)
    centred_P_G = torch.where(failed | flat_P1 | (count_P1 < 2), torch.zeros_like(centred_P_G), centred_P_G)
    return centred_P_G.float()


def per_token(advantages: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] one advantage per completion, or [B, T] one per token -> [B, T] (a view: a completion's advantage on
    every position of its row, padding included; the loss mask decides what counts)."""
    advantages_BT = advantages if advantages.dim() == 2 else advantages[:, None]
    return advantages_BT.expand(mask_BT.shape)


def token_rewards(rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None, beta: float) -> torch.Tensor:
    """Per-token rewards (float64): -beta * kl_t on every counted token plus the outcome reward on a row's last
    counted one (an episode's mask has gaps where the environment's tokens are: the last counted token is the
    policy's last, not the mask's count). A NaN outcome (failed reward) counts 0: such rows leave the loss."""
    mask = mask_BT.double()
    token_reward_BT = torch.zeros_like(mask) if kl_BT is None or beta == 0 else -beta * kl_BT.double() * mask
    rows = (mask.sum(-1) > 0).nonzero().squeeze(-1)
    last_B = mask.shape[-1] - 1 - mask.flip(-1).argmax(-1)  # the last column with mask 1
    outcome_B = rewards_B.double().nan_to_num(0.0)
    token_reward_BT[rows, last_B[rows]] += outcome_B[rows]
    return token_reward_BT


def token_returns(rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None, beta: float) -> torch.Tensor:
    """REINFORCE++ returns with gamma = 1: token reward -beta * kl_t on every completion token plus the
    outcome reward on the last one, summed from t to the end: G_t = r + sum_{s >= t} -beta * kl_s."""
    return token_rewards(rewards_B, mask_BT, kl_BT, beta).flip(-1).cumsum(-1).flip(-1) * mask_BT.double()


def whiten(values_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float, center: bool = True,
           all_sum: AllSum = in_one_process) -> torch.Tensor:
    """(x - mean) / (std + eps) over the masked entries of the whole batch, all ranks' (unbiased std); 0
    elsewhere. center=False only divides by the std (the std is still taken around the mean)."""
    mask = mask_BT.double()
    count, total = all_sum([float(mask.sum()), float((values_BT * mask).sum())])
    if count < 2:
        return torch.zeros_like(values_BT, dtype=torch.float32)
    mean = total / count
    (squares,) = all_sum([float((((values_BT - mean) * mask) ** 2).sum())])
    std = math.sqrt(squares / (count - 1))
    shifted = values_BT - mean if center else values_BT
    return (shifted / (std + eps) * mask).float()


def reinforce_pp_advantages(rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None, beta: float,
                            eps: float = 1e-4, group_size: int | None = None,
                            all_sum: AllSum = in_one_process) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): token returns whitened over the batch -> advantages_BT. With group_size, the
    group mean reward is subtracted first (REINFORCE++-baseline) and the returns are only divided by the
    batch std, not re-centred: re-centring with a token-weighted mean would give a group whose rewards are
    all equal a gradient whenever its completions differ in length."""
    rewards = rewards_B.double()
    if group_size is not None:
        grouped = rewards.view(-1, group_size)
        rewards = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).view(-1)
    valid_BT = mask_BT * (~torch.isnan(rewards)).unsqueeze(-1)
    return whiten(token_returns(rewards, valid_BT, kl_BT, beta), valid_BT, eps, center=group_size is None,
                  all_sum=all_sum)


def overlong_penalty(lengths_B: torch.Tensor, max_len: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer tokens, then falling linearly to -penalty at
    max_len (completions cannot be longer here: the sampler stops at max_len)."""
    if buffer <= 0:
        return torch.zeros_like(lengths_B, dtype=torch.float64)
    excess_B = (lengths_B.double() - (max_len - buffer)).clamp(min=0)
    return -penalty * (excess_B / buffer).clamp(max=1.0)
