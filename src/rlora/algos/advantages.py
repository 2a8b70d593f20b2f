"""Group-relative advantages.

GRPO: A_pg = (r_pg - mean_g r_pg) / (std + eps), with the std taken per group, over the whole batch, or
not at all (Dr.GRPO). The std is the unbiased sample std (divides by n - 1), as in the GRPO paper's
reference code and TRL. Groups whose rewards are all equal get A = 0: they carry no gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvScale = Literal["group", "batch", "none"]


def group_advantages(rewards_P_G: torch.Tensor, scale: AdvScale = "group", eps: float = 1e-4) -> torch.Tensor:
    """rewards_P_G: P prompts x G samples -> advantages_P_G (float32)."""
    rewards_P_G = rewards_P_G.float()
    centred_P_G = rewards_P_G - rewards_P_G.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred_P_G
    if scale == "group":
        std = rewards_P_G.std(dim=1, keepdim=True)
    elif scale == "batch":
        std = rewards_P_G.std() if rewards_P_G.numel() > 1 else rewards_P_G.new_zeros(())
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; use group, batch or none")
    return centred_P_G / (std + eps)
