"""Cut rollouts into groups of rows and join groups from several sampling calls into one rollout.

Dynamic sampling, adaptive resampling and experience replay all assemble a step's batch from groups that
were sampled in different calls (different prompt widths, completion widths and temperatures). Prompts
stay left-padded and completions right-padded, so every position keeps its meaning after a join.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlora.tensors import pad_right
from rlora.types import Rollout, RolloutSlice


def select_rows(rollout: Rollout, index: list[int] | torch.Tensor) -> Rollout:
    """A Rollout of the given rows (in that order)."""
    index_t = torch.as_tensor(index, dtype=torch.long)
    rows = index_t.tolist()

    def pick(tensor):
        return None if tensor is None else tensor[index_t]

    return Rollout(
        prompt_ids_BTp=rollout.prompt_ids_BTp[index_t], prompt_mask_BTp=rollout.prompt_mask_BTp[index_t],
        completion_ids_BTc=rollout.completion_ids_BTc[index_t], completion_mask_BTc=rollout.completion_mask_BTc[index_t],
        completions=[rollout.completions[i] for i in rows], finish_reasons=[rollout.finish_reasons[i] for i in rows],
        temperature_B=rollout.temperature_B[index_t], sampling_logp_BTc=pick(rollout.sampling_logp_BTc),
        temperature_BTc=pick(rollout.temperature_BTc), policy_mask_BTc=pick(rollout.policy_mask_BTc),
    )


def _pad_left(tensor_BT: torch.Tensor, width: int, value) -> torch.Tensor:
    return F.pad(tensor_BT, (width - tensor_BT.shape[1], 0), value=value)


def _token_temperatures(rollout: Rollout) -> torch.Tensor:
    if rollout.temperature_BTc is not None:
        return rollout.temperature_BTc
    return rollout.temperature_B[:, None].float().expand(rollout.completion_ids_BTc.shape) * rollout.completion_mask_BTc


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts row-wise. Sampling log-probs survive only if every part has them; per-token
    temperatures are kept (filled from the row temperature for parts without them) if any part has them."""
    if not parts:
        raise ValueError("concat_rollouts needs at least one rollout")
    if len(parts) == 1:
        return parts[0]
    prompt_width = max(p.prompt_ids_BTp.shape[1] for p in parts)
    width = max(p.completion_ids_BTc.shape[1] for p in parts)
    with_logp = all(p.sampling_logp_BTc is not None for p in parts)
    with_token_temperature = any(p.temperature_BTc is not None for p in parts)
    with_policy_mask = any(p.policy_mask_BTc is not None for p in parts)  # episodes joined with single turns
    return Rollout(
        prompt_ids_BTp=torch.cat([_pad_left(p.prompt_ids_BTp, prompt_width, pad_id) for p in parts]),
        prompt_mask_BTp=torch.cat([_pad_left(p.prompt_mask_BTp, prompt_width, 0) for p in parts]),
        completion_ids_BTc=torch.cat([pad_right(p.completion_ids_BTc, width, pad_id) for p in parts]),
        completion_mask_BTc=torch.cat([pad_right(p.completion_mask_BTc, width, 0) for p in parts]),
        completions=[text for p in parts for text in p.completions],
        finish_reasons=[reason for p in parts for reason in p.finish_reasons],
        temperature_B=torch.cat([p.temperature_B for p in parts]),
        sampling_logp_BTc=torch.cat([pad_right(p.sampling_logp_BTc, width, 0.0) for p in parts]) if with_logp else None,
        temperature_BTc=(torch.cat([pad_right(_token_temperatures(p), width, 0.0) for p in parts])
                         if with_token_temperature else None),
        policy_mask_BTc=(torch.cat([pad_right(p.trained_mask_BTc, width, 0) for p in parts]) if with_policy_mask else None),
    )


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
        None if batch.temperature_BTc is None else batch.temperature_BTc[:, :last],
    )
