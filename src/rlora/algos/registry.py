"""Algorithms by name: an advantage function, a per-token loss, capability flags, and the config values the
algorithm's paper uses (its presets, data in rlora/presets.py, which the config applies). A new algorithm is
one entry here and one in PRESETS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlora.algos.advantages import AllSum, group_advantages, in_one_process, reinforce_pp_advantages, rloo_advantages
from rlora.algos.losses import LossInputs, TokenLosses, cispo_token_loss, grpo_token_loss, gspo_token_loss
from rlora.presets import PRESETS


@dataclass(frozen=True)
class AdvantageInputs:
    """What any advantage function may need; B = P x G completions, prompt-major."""

    rewards_P_S: torch.Tensor  # float64, NaN where a reward failed or no sample; columns 0..G-1: the batch's
    # rows, further columns: other samples of the same prompt that only enter the statistics (adaptive)
    mask_BT: torch.Tensor  # completion tokens that count
    scale: str  # algo.adv_scale
    eps: float
    beta: float
    group_size: int  # G
    kl_BT: torch.Tensor | None = None  # k1 = old - ref log-prob per token (only for kl_in_reward algorithms)
    all_sum: AllSum = in_one_process  # batch-wide statistics: sums over the data-parallel ranks


def _group(inp: AdvantageInputs) -> torch.Tensor:
    return group_advantages(inp.rewards_P_S, scale=inp.scale, eps=inp.eps,
                            all_sum=inp.all_sum)[:, :inp.group_size].reshape(-1)


def _rloo(inp: AdvantageInputs) -> torch.Tensor:
    return rloo_advantages(inp.rewards_P_S, scale=inp.scale, eps=inp.eps,
                           all_sum=inp.all_sum)[:, :inp.group_size].reshape(-1)


def _reinforce_pp(inp: AdvantageInputs, baseline: bool = False) -> torch.Tensor:
    G = inp.group_size
    return reinforce_pp_advantages(inp.rewards_P_S[:, :G].reshape(-1), inp.mask_BT, inp.kl_BT, inp.beta, inp.eps,
                                   group_size=G if baseline else None, all_sum=inp.all_sum)


@dataclass(frozen=True)
class Algorithm:
    name: str
    paper: str
    advantages: Callable[[AdvantageInputs], torch.Tensor]  # -> advantages [B] or [B, T]
    token_loss: Callable[..., TokenLosses]  # (LossInputs, clip_low, clip_high, beta) -> TokenLosses
    presets: dict[str, Any] = field(default_factory=dict)  # PRESETS[name] (rlora/presets.py)
    kl_in_reward: bool = False  # the KL to the reference enters the token reward, not the loss (REINFORCE++)
    critic: bool = False  # a value adapter + head is trained beside the policy; GAE advantages (train/ppo_step.py)


def _from_critic(inp: AdvantageInputs) -> torch.Tensor:
    raise TypeError("ppo's advantages come from its critic's values (GAE): train/ppo_step.py computes them")


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("grpo", "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)", _group, grpo_token_loss, PRESETS["grpo"]),
    Algorithm("dr_grpo", "Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)", _group,
              grpo_token_loss, PRESETS["dr_grpo"]),
    Algorithm("dapo", "Yu et al. 2025, DAPO (arXiv:2503.14476)", _group, grpo_token_loss,
              PRESETS["dapo"]),
    Algorithm("gspo", "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)", _group,
              gspo_token_loss, PRESETS["gspo"]),
    Algorithm("cispo", "MiniMax 2025, MiniMax-M1 (arXiv:2506.13585)", _group, cispo_token_loss,
              PRESETS["cispo"]),
    Algorithm("rloo", "Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740)", _rloo, grpo_token_loss,
              PRESETS["rloo"]),
    Algorithm("reinforce_pp", "Hu 2025, REINFORCE++ (arXiv:2501.03262)", _reinforce_pp, grpo_token_loss,
              PRESETS["reinforce_pp"], kl_in_reward=True),
    Algorithm("reinforce_pp_baseline", "Hu 2025, REINFORCE++ (arXiv:2501.03262), group-mean baseline",
              lambda inp: _reinforce_pp(inp, baseline=True), grpo_token_loss, PRESETS["reinforce_pp_baseline"],
              kl_in_reward=True),
    Algorithm("ppo", "Schulman et al. 2017, PPO (arXiv:1707.06347) with GAE (arXiv:1506.02438); KL in the reward as "
              "Ouyang et al. 2022, InstructGPT (arXiv:2203.02155)", _from_critic, grpo_token_loss,
              PRESETS["ppo"], critic=True),
    Algorithm("adaptive_grpo", "rlora's corrected adaGRPO: GRPO that resamples failing groups", _group,
              grpo_token_loss, PRESETS["adaptive_grpo"]),
)}


def get_algorithm(name: str) -> Algorithm:
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "AdvantageInputs", "Algorithm", "LossInputs", "get_algorithm"]
