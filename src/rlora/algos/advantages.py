"""Group-relative advantages.

GRPO: A_pg = (r_pg - mean_g r_pg) / (std + eps), with the std taken per group, over the whole batch, or
not at all (Dr.GRPO). The std is the unbiased sample std (divides by n - 1), as in the GRPO paper's
reference code and TRL. Groups whose rewards are all equal get A = 0: they carry no gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvScale = Literal["group", "batch", "none"]


def _nan_std(values: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std over the non-NaN entries (0 where fewer than two)."""
    valid = ~torch.isnan(values)
    count = valid.sum(dim=dim, keepdim=True) if dim is not None else valid.sum()
    mean = torch.nansum(values, dim=dim, keepdim=True) / count.clamp(min=1) if dim is not None else torch.nanmean(values)
    squares = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    total = squares.sum(dim=dim, keepdim=True) if dim is not None else squares.sum()
    std = torch.sqrt(total / (count - 1).clamp(min=1))
    std = torch.where(count > 1, std, torch.zeros_like(std))
    return std if keepdim or dim is None else std.squeeze(dim)


def group_advantages(rewards_P_G: torch.Tensor, scale: AdvScale = "group", eps: float = 1e-4) -> torch.Tensor:
    """rewards_P_G: P prompts x G samples -> advantages_P_G (float32).

    NaN marks a sample whose reward failed: it is left out of every mean and std and gets advantage 0.
    Groups whose valid rewards are all equal get exactly 0 (computed in float64, then forced), so float
    rounding never pushes a whole zero-variance group one way.
    """
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"unknown advantage scale {scale!r}; use group, batch or none")
    rewards = rewards_P_G.double()
    failed = torch.isnan(rewards)
    group_mean_P1 = torch.nanmean(rewards, dim=1, keepdim=True).nan_to_num(0.0)
    centred_P_G = rewards - group_mean_P1
    valid_max = torch.where(failed, torch.full_like(rewards, -torch.inf), rewards).amax(dim=1, keepdim=True)
    valid_min = torch.where(failed, torch.full_like(rewards, torch.inf), rewards).amin(dim=1, keepdim=True)
    flat_P1 = ~(valid_max > valid_min)
    if scale == "group":
        centred_P_G = centred_P_G / (_nan_std(rewards, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred_P_G = centred_P_G / (_nan_std(rewards) + eps)
    centred_P_G = torch.where(failed | flat_P1, torch.zeros_like(centred_P_G), centred_P_G)
    return centred_P_G.float()
