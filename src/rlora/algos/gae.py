"""PPO with a learned critic: token rewards, generalized advantage estimation, the clipped value loss and
the critic's explained variance. Pure tensor math over [B, T] completion positions.
(An episode's mask has gaps where the environment's tokens are: the recursion below steps from one masked
position to the next.)

Position t of a completion is the state s_t before its token t (prompt + tokens 0..t-1); V_t = V(s_t) is
the critic's value there. Masks are right-padded (ones, then zeros): a row's real tokens are 0..L-1 and the
episode ends after token L-1, whose successor value is 0.

    r_t       = -beta * kl_t on every real token (kl_mode=reward; 0 otherwise) + the outcome reward at t = L-1
    delta_t   = r_t + gamma * V_{t+1} - V_t                 (V_L = 0)
    A_t       = delta_t + gamma * lam * A_{t+1}             (A_L = 0)     Schulman et al. 2015, GAE
    R_t       = A_t + V_t                                    (the critic's target, before any whitening)
    value loss: 0.5 * max((V - R)^2, (clip(V, V_old - eps, V_old + eps) - R)^2) per token
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlora.algos.advantages import AllSum, in_one_process, token_rewards, whiten


@dataclass(frozen=True)
class GAEResult:
    advantages_BT: torch.Tensor  # float32, 0 on padding; whitened over the batch's real tokens if asked
    returns_BT: torch.Tensor  # float32, A + V before whitening, 0 on padding


def gae(token_rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (advantages_BT, returns_BT) in float64, 0 on padding. One backward sweep over the T positions,
    all rows at once. The successor of a position is the row's next masked one: after a row's last real token
    there is none (its value counts 0), and an episode's environment tokens (mask 0 inside the row) are part of
    the transition from one policy token to the next, not steps of their own."""
    mask = mask_BT.double()
    rewards, values = token_rewards_BT.double() * mask, values_BT.double() * mask
    advantages = torch.zeros_like(mask)
    next_value_B = torch.zeros_like(mask[:, 0])
    next_advantage_B = torch.zeros_like(mask[:, 0])
    for t in reversed(range(mask.shape[1])):
        delta_B = rewards[:, t] + gamma * next_value_B - values[:, t]
        advantage_B = delta_B + gamma * lam * next_advantage_B
        advantages[:, t] = advantage_B * mask[:, t]
        step_B = mask[:, t].bool()  # a masked position passes its successor's value and advantage on unchanged
        next_value_B = torch.where(step_B, values[:, t], next_value_B)
        next_advantage_B = torch.where(step_B, advantage_B, next_advantage_B)
    return advantages, (advantages + values) * mask


def ppo_advantages(rewards_B: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float,
                   lam: float, whiten_advantages: bool, eps: float, kl_BT: torch.Tensor | None = None,
                   beta: float = 0.0, all_sum: AllSum = in_one_process) -> GAEResult:
    """Outcome rewards [B] + the critic's values [B, T] (+ k1 KL per token folded into the reward) -> GAE
    advantages (whitened over the batch's real tokens, all ranks' with all_sum, if asked) and the value targets."""
    advantages, returns = gae(token_rewards(rewards_B, mask_BT, kl_BT, beta), values_BT, mask_BT, gamma, lam)
    if whiten_advantages:
        advantages = whiten(advantages, mask_BT, eps, all_sum=all_sum)
    return GAEResult(advantages.float(), returns.float())


@dataclass(frozen=True)
class ValueLosses:
    loss_BT: torch.Tensor  # per token, to aggregate over the real tokens
    clipped_BT: torch.Tensor  # bool: the clipped branch is the larger one (its gradient is 0)


def clipped_value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       clip: float | None) -> ValueLosses:
    """0.5 * max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2) per token (PPO's value clipping as in
    OpenAI baselines / TRL); clip=None: 0.5 * (V - R)^2."""
    unclipped_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        return ValueLosses(0.5 * unclipped_BT, torch.zeros_like(unclipped_BT, dtype=torch.bool))
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    clipped_BT = (clipped_values_BT - returns_BT) ** 2
    return ValueLosses(0.5 * torch.maximum(unclipped_BT, clipped_BT), (clipped_BT > unclipped_BT).detach())


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor,
                       all_sum: AllSum = in_one_process) -> float | None:
    """1 - Var(R - V) / Var(R) over the real tokens of the whole batch, all ranks' (population variances, two
    passes: the means, then the squared deviations): 1 for a perfect critic, 0 for one that predicts the mean
    return, negative for worse. None with fewer than two tokens or constant returns."""
    mask = mask_BT.double().bool()
    returns, residual = returns_BT.double()[mask], (returns_BT.double() - values_BT.double())[mask]
    count, returns_sum, residual_sum = all_sum([returns.numel(), float(returns.sum()), float(residual.sum())])
    if count < 2:
        return None
    mean_return, mean_residual = returns_sum / count, residual_sum / count
    returns_ss, residual_ss = all_sum([float(((returns - mean_return) ** 2).sum()),
                                       float(((residual - mean_residual) ** 2).sum())])
    if returns_ss == 0:
        return None
    return 1.0 - residual_ss / returns_ss
