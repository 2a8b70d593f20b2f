"""Per-token policy losses, the k3 KL estimator, and the one aggregation function.

PPO-clip (GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++), GSPO (sequence-level ratio and clipping) and CISPO
(clipped stop-gradient weight times the log-prob). The contract: a loss takes LossInputs (advantages per token,
[B, T]) and returns TokenLosses, its per-token loss and a dict of per-token metric terms; `aggregate` turns the
loss into the scalar that is back-propagated, and the update (train/update.py) logs every metric term as its
mean over the trained tokens, so a new loss reports a new metric without touching the update. The
normaliser comes from `BatchTotals`, counted over the *whole* batch (all micro-batches, later all ranks),
so that summing micro-batch contributions gives exactly the full-batch loss and gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlora.algos.advantages import per_token

LossAgg = Literal["token_mean", "seq_mean", "constant"]


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch of B completions, T completion positions."""

    logp_BT: torch.Tensor  # current policy log-probs of the sampled tokens (requires grad)
    old_logp_BT: torch.Tensor  # log-probs under the policy that sampled (detached)
    # one advantage per token; one per completion [B] (a batch written by hand, a reference's check) is broadcast
    # to the completion's tokens on construction, so every loss reads [B, T]
    advantages_BT: torch.Tensor
    mask_BT: torch.Tensor  # 1.0 on completion tokens that count, 0.0 on padding
    ref_logp_BT: torch.Tensor | None = None  # reference (adapter off); None when beta == 0
    is_weight_BT: torch.Tensor | None = None  # sampler-mismatch weight on the surrogate (detached); None: 1

    def __post_init__(self):
        object.__setattr__(self, "advantages_BT", per_token(self.advantages_BT, self.mask_BT))


@dataclass(frozen=True)
class TokenLosses:
    loss_BT: torch.Tensor  # what is aggregated and minimised
    # Per-token metric terms (detached), by the name they are logged under: the update logs each one's mean over
    # the trained tokens (their sum over micro-batches and ranks / the trained token count). None: not measured in
    # this run (logged as null). The names depend on which inputs a loss gets, never on their values: the update
    # asks the loss for them once, on a batch of no rows, so that every rank and a step without rows log the same.
    metrics_BT: dict[str, torch.Tensor | None]
    # the KL to the reference per token, if one was given: the update adds each policy's beta x kl_BT to its rows
    kl_BT: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchTotals:
    """Global counts of the full batch (summed over micro-batches and ranks) used as normalisers."""

    num_tokens: float  # completion tokens that count
    num_seqs: int  # completions with at least one such token (seq_mean)
    constant_len: int  # tokens per sequence for loss_agg="constant" (Dr.GRPO)
    num_rows: int | None = None  # all completions of the batch, masked ones too (constant); None: num_seqs


def k3_kl(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token: exp(ref - logp) - (ref - logp) - 1 >= 0."""
    delta = ref_logp_BT - logp_BT
    return torch.exp(delta) - delta - 1.0


def truncated_is_weight(old_logp_BT: torch.Tensor, sampling_logp_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weight min(pi_old / pi_sampler, cap) per token (Yao et al. 2025, "TIS"): corrects
    for a sampler whose distribution differs slightly from the trainer's (e.g. bfloat16 sampling)."""
    return torch.exp(old_logp_BT - sampling_logp_BT).clamp(max=cap).detach()


def _finish(inp: LossInputs, surrogate_BT, clipped_BT, ratio_BT, beta: float) -> TokenLosses:
    """Apply the sampler-mismatch weight w (if any) to the surrogate, add beta * k3 KL (if a reference)."""
    loss_BT = surrogate_BT if inp.is_weight_BT is None else surrogate_BT * inp.is_weight_BT
    kl_BT = None
    if inp.ref_logp_BT is not None:
        kl_BT = k3_kl(inp.logp_BT, inp.ref_logp_BT)
        if beta:
            loss_BT = loss_BT + beta * kl_BT
    # kl: the k3 KL to the reference; clip_frac: where the clip acts; ratio_mean: the importance ratio
    metrics_BT = {"kl": None if kl_BT is None else kl_BT.detach(), "clip_frac": clipped_BT.detach(),
                  "ratio_mean": ratio_BT.detach()}
    return TokenLosses(loss_BT, metrics_BT, kl_BT)


def _ppo_clip(ratio_BT, adv_BT, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), where the clipped branch is active)."""
    unclipped_BT = ratio_BT * adv_BT
    clipped_obj_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * adv_BT
    return -torch.minimum(unclipped_BT, clipped_obj_BT), clipped_obj_BT < unclipped_BT


def grpo_token_loss(inp: LossInputs, clip_low: float, clip_high: float, beta: float) -> TokenLosses:
    """PPO-clip surrogate with separate low/high clip, times the sampler-mismatch weight w (if any), plus
    beta * k3 KL:  loss = -w * min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A) + beta * KL."""
    ratio_BT = torch.exp(inp.logp_BT - inp.old_logp_BT)
    surrogate_BT, clipped_BT = _ppo_clip(ratio_BT, inp.advantages_BT, clip_low, clip_high)
    return _finish(inp, surrogate_BT, clipped_BT, ratio_BT, beta)


def gspo_token_loss(inp: LossInputs, clip_low: float, clip_high: float, beta: float) -> TokenLosses:
    """GSPO (Zheng et al. 2025): one ratio per sequence, s = exp(mean_t(logp - old_logp)) over its completion
    tokens, clipped at sequence level: loss_i = -min(s_i * A_i, clip(s_i, 1 - clip_low, 1 + clip_high) * A_i).
    Every token of sequence i holds loss_i, so loss_agg=seq_mean gives the paper's mean over sequences.
    A_i is one advantage per completion: its value at the row's first token that counts (the advantages are
    per token, [B, T]; one that varies along a completion's counted tokens is refused)."""
    mask_BT = inp.mask_BT
    advantages_B = inp.advantages_BT.gather(-1, mask_BT.argmax(-1, keepdim=True)).squeeze(-1)  # argmax: 1st max
    if bool(((inp.advantages_BT != advantages_B[:, None]) & (mask_BT > 0)).any()):
        raise ValueError("GSPO takes one advantage per completion: these vary along a completion's tokens")
    log_ratio_B = ((inp.logp_BT - inp.old_logp_BT) * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
    seq_ratio_B = torch.exp(log_ratio_B)
    surrogate_B, clipped_B = _ppo_clip(seq_ratio_B, advantages_B, clip_low, clip_high)
    shape = inp.logp_BT.shape
    return _finish(inp, surrogate_B[:, None].expand(shape), clipped_B[:, None].expand(shape),
                   seq_ratio_B[:, None].expand(shape), beta)


def cispo_token_loss(inp: LossInputs, clip_low: float, clip_high: float, beta: float) -> TokenLosses:
    """CISPO (MiniMax-M1, 2025): loss = -sg(clip(ratio, 1 - clip_low, 1 + clip_high)) * A * logp. Unlike
    PPO-clip, every token keeps its gradient; the clip only bounds the (stop-gradient) importance weight.
    clip_frac counts tokens whose weight was clipped."""
    ratio_BT = torch.exp(inp.logp_BT - inp.old_logp_BT)
    weight_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high).detach()
    surrogate_BT = -weight_BT * inp.advantages_BT * inp.logp_BT
    clipped_BT = (ratio_BT < 1.0 - clip_low) | (ratio_BT > 1.0 + clip_high)
    return _finish(inp, surrogate_BT, clipped_BT, ratio_BT, beta)


def aggregate(values_BT: torch.Tensor, mask_BT: torch.Tensor, mode: LossAgg, totals: BatchTotals) -> torch.Tensor:
    """This micro-batch's share of the batch loss; shares summed over micro-batches give the full loss.

    token_mean: sum over all tokens / total tokens of the batch            (DAPO)
    seq_mean:   sum over sequences of (token sum / own length) / sequences  (GRPO paper)
    constant:   sum over all tokens / (rows * constant_len)                 (Dr.GRPO: a true constant, the batch
                size times the length limit, whatever is masked)
    """
    masked_BT = values_BT * mask_BT
    if mode == "token_mean":
        return masked_BT.sum() / max(totals.num_tokens, 1.0)
    if mode == "seq_mean":
        per_seq_B = masked_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1.0)
        return per_seq_B.sum() / totals.num_seqs
    if mode == "constant":
        rows = totals.num_rows if totals.num_rows is not None else totals.num_seqs
        return masked_BT.sum() / (rows * totals.constant_len)
    raise ValueError(f"unknown loss aggregation {mode!r}; use token_mean, seq_mean or constant")
