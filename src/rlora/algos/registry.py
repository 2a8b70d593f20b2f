"""Algorithms by name: an advantage function, a per-token loss, capability flags (its traits) and the config
values the algorithm's paper uses (its presets); presets and traits are data in rlora/presets.py, which the config
reads too. A new algorithm is one entry here and one in PRESETS and TRAITS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from rlora.algos.advantages import (
    AllSum, group_advantages, in_one_process, per_token, reinforce_pp_advantages, rloo_advantages,
)
from rlora.algos.losses import LossInputs, TokenLosses, cispo_token_loss, grpo_token_loss, gspo_token_loss
from rlora.presets import PRESETS, TRAITS, Traits


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


@dataclass(frozen=True, kw_only=True)
class Algorithm(Traits):
    """An algorithm is its traits (the flags critic, kl_in_reward, batch_statistics, sequence_ratio) and these."""

    name: str
    paper: str
    advantages: Callable[[AdvantageInputs], torch.Tensor]  # -> advantages [B] (one per completion) or [B, T]
    # (LossInputs, clip_low, clip_high, beta) -> TokenLosses: the per-token loss and per-token metric terms
    token_loss: Callable[..., TokenLosses]
    presets: dict[str, Any] = field(default_factory=dict)  # PRESETS[name] (rlora/presets.py)

    def advantages_BT(self, inp: AdvantageInputs) -> torch.Tensor:
        """The advantages as training takes them, one per token [B, T]: where the step makes them, an algorithm's
        one advantage per completion is broadcast to the completion's tokens (the update reads no other shape)."""
        return per_token(self.advantages(inp), inp.mask_BT)


def _entry(name: str, paper: str, advantages: Callable[[AdvantageInputs], torch.Tensor],
           token_loss: Callable[..., TokenLosses]) -> Algorithm:
    """The registry entry of `name`, with its presets and traits from rlora/presets.py."""
    return Algorithm(**asdict(TRAITS[name]), name=name, paper=paper, advantages=advantages, token_loss=token_loss,
                     presets=PRESETS[name])


def _from_critic(inp: AdvantageInputs) -> torch.Tensor:
    raise TypeError("ppo's advantages come from its critic's values (GAE): train/ppo_step.py computes them")


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    _entry("grpo", "Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)", _group, grpo_token_loss),
    _entry("dr_grpo", "Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)", _group,
           grpo_token_loss),
    _entry("dapo", "Yu et al. 2025, DAPO (arXiv:2503.14476)", _group, grpo_token_loss),
    _entry("gspo", "Zheng et al. 2025, Group Sequence Policy Optimization (arXiv:2507.18071)", _group,
           gspo_token_loss),
    _entry("cispo", "MiniMax 2025, MiniMax-M1 (arXiv:2506.13585)", _group, cispo_token_loss),
    _entry("rloo", "Ahmadian et al. 2024, Back to Basics (arXiv:2402.14740)", _rloo, grpo_token_loss),
    _entry("reinforce_pp", "Hu 2025, REINFORCE++ (arXiv:2501.03262)", _reinforce_pp, grpo_token_loss),
    _entry("reinforce_pp_baseline", "Hu 2025, REINFORCE++ (arXiv:2501.03262), group-mean baseline",
           lambda inp: _reinforce_pp(inp, baseline=True), grpo_token_loss),
    _entry("ppo", "Schulman et al. 2017, PPO (arXiv:1707.06347) with GAE (arXiv:1506.02438); KL in the reward as "
           "Ouyang et al. 2022, InstructGPT (arXiv:2203.02155)", _from_critic, grpo_token_loss),
    _entry("adaptive_grpo", "rlora's corrected adaGRPO: GRPO that resamples failing groups", _group,
           grpo_token_loss),
)}


def get_algorithm(name: str) -> Algorithm:
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "AdvantageInputs", "Algorithm", "LossInputs", "get_algorithm"]
