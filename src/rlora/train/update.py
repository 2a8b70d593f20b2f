"""One policy update from a scored rollout: micro-batched gradient accumulation, normalised by the
token/sequence counts of the whole batch, then one optimiser step (skipped if anything is non-finite)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from rlora.algos.losses import BatchTotals, LossInputs, aggregate, truncated_is_weight
from rlora.algos.registry import Algorithm
from rlora.config import AlgoConfig
from rlora.models.logprobs import completion_logprobs
from rlora.types import Rollout, RolloutSlice


@dataclass
class ScoredRollout:
    rollout: Rollout
    advantages_B: torch.Tensor
    loss_mask_BTc: torch.Tensor  # completion mask with failed samples zeroed
    old_logp_BTc: torch.Tensor | None = None  # None: the rollout is used once, old = current (detached)
    ref_logp_BTc: torch.Tensor | None = None  # None: no KL term


def trim(batch: RolloutSlice) -> RolloutSlice:
    """Drop columns that are padding in every row of this micro-batch (no effect on the numbers: positions
    come from the masks)."""
    prompt_keep = batch.prompt_mask_BTp.any(0).nonzero()
    first = int(prompt_keep[0]) if len(prompt_keep) else batch.prompt_mask_BTp.shape[1] - 1
    completion_keep = batch.completion_mask_BTc.any(0).nonzero()
    last = int(completion_keep[-1]) + 1 if len(completion_keep) else 1
    return RolloutSlice(
        batch.prompt_ids_BTp[:, first:], batch.prompt_mask_BTp[:, first:],
        batch.completion_ids_BTc[:, :last], batch.completion_mask_BTc[:, :last], batch.temperature_B,
    )


def _pad_right(values_BT: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(values_BT, (0, width - values_BT.shape[1]))


@torch.no_grad()
def batched_logprobs(model, rollout: Rollout, micro_batch_size: int, chunk_tokens: int = 256) -> torch.Tensor:
    """Log-probs of all completion tokens (no gradient, eval mode: no dropout), micro-batch by micro-batch
    -> logp_BTc."""
    width = rollout.completion_ids_BTc.shape[1]
    parts = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, rollout.num_completions, micro_batch_size):
            micro = trim(rollout.select(slice(start, start + micro_batch_size)))
            logp, _ = completion_logprobs(model, micro, chunk_tokens=chunk_tokens)
            parts.append(_pad_right(logp, width))
    finally:
        model.train(was_training)
    return torch.cat(parts)


def batch_totals(loss_mask_BTc: torch.Tensor, constant_len: int) -> BatchTotals:
    return BatchTotals(
        num_tokens=float(loss_mask_BTc.sum()),
        num_seqs=int((loss_mask_BTc.sum(-1) > 0).sum()),
        constant_len=constant_len,
    )


def rows_to_train(scored: ScoredRollout, beta: float) -> torch.Tensor:
    """Indices of completions whose loss can be non-zero. Without a KL term, a completion with advantage 0
    has loss exactly 0 (ratio * 0), so skipping its forward/backward changes no gradient; the normalisers
    still count it (BatchTotals), so the result is identical to training on every row."""
    active_B = scored.loss_mask_BTc.sum(-1) > 0
    if beta == 0:
        active_B &= scored.advantages_B != 0
    return active_B.nonzero().squeeze(-1)


def accumulate_policy_gradient(
    model, algo: Algorithm, cfg: AlgoConfig, scored: ScoredRollout, micro_batch_size: int, constant_len: int,
    chunk_tokens: int = 256,
) -> dict[str, float]:
    """Backward over all micro-batches; returns the summed loss and token metrics of the batch.
    Token metrics (clip_frac, entropy, ratio_mean) are means over the tokens that were trained.
    sampler_logp_gap: mean |old log-prob - sampler log-prob| over those tokens, where old is the trainer's
    log-prob of the policy that sampled (the two must agree; a gap means the rollout is off-policy)."""
    rollout = scored.rollout
    totals = batch_totals(scored.loss_mask_BTc, constant_len)
    rows = rows_to_train(scored, cfg.beta)
    sums = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "entropy": 0.0, "ratio": 0.0, "tokens": 0.0, "gap": 0.0, "is_weight": 0.0}
    sampled = rollout.sampling_logp_BTc
    for start in range(0, len(rows), micro_batch_size):
        index = rows[start:start + micro_batch_size]
        micro = trim(rollout.select(index))
        width = micro.completion_ids_BTc.shape[1]
        mask_BT = scored.loss_mask_BTc[index, :width].float()
        logp_BT, entropy_BT = completion_logprobs(model, micro, with_entropy=True, chunk_tokens=chunk_tokens)
        old = scored.old_logp_BTc[index, :width] if scored.old_logp_BTc is not None else logp_BT.detach()
        ref = scored.ref_logp_BTc[index, :width] if scored.ref_logp_BTc is not None else None
        is_weight = None
        if cfg.sampler_is_cap is not None:
            is_weight = truncated_is_weight(old, sampled[index, :width], cfg.sampler_is_cap)
            sums["is_weight"] += float((is_weight * mask_BT).sum())
        inputs = LossInputs(logp_BT, old, scored.advantages_B[index], mask_BT, ref, is_weight)
        out = algo.token_loss(inputs, clip_low=cfg.clip_low, clip_high=cfg.clip_high, beta=cfg.beta)
        loss = aggregate(out.loss_BT, mask_BT, cfg.loss_agg, totals)
        loss.backward()
        sums["loss"] += loss.item()
        sums["tokens"] += float(mask_BT.sum())
        sums["clipped"] += float((out.clipped_BT * mask_BT).sum())
        sums["entropy"] += float((entropy_BT * mask_BT).sum())
        sums["ratio"] += float((out.ratio_BT * mask_BT).sum())
        if sampled is not None:
            sums["gap"] += float(((old - sampled[index, :width]).abs() * mask_BT).sum())
        if out.kl_BT is not None:
            sums["kl"] += float((out.kl_BT.detach() * mask_BT).sum())
    trained = sums["tokens"]
    per_token = (lambda key: sums[key] / trained) if trained else (lambda key: None)
    return {
        "loss": sums["loss"],
        "kl": per_token("kl") if scored.ref_logp_BTc is not None else None,
        "clip_frac": per_token("clipped"),
        "entropy": per_token("entropy"),
        "ratio_mean": per_token("ratio"),
        "trained_frac": len(rows) / rollout.num_completions,
        "sampler_logp_gap": per_token("gap") if sampled is not None else None,
        "is_weight_mean": per_token("is_weight") if cfg.sampler_is_cap is not None else None,
    }


def optimizer_step(params, optimizer, scheduler, max_grad_norm: float | None, loss: float) -> dict[str, float]:
    """Clip, step, zero. A non-finite loss or gradient skips the update (logged as skipped_update=1)."""
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        norms = [p.grad.norm() for p in params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still advances the schedule; torch warns about that
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return {"grad_norm": grad_norm, "skipped_update": int(skipped)}
