"""One PPO step with a critic per policy on the policies' base: collect -> reference/old log-probs -> each critic's
values of its policy's rows -> GAE advantages and value targets, policy by policy -> per update: the policies'
gradients (step.py/update.py's machinery, per-token advantages, one pass for all) + each critic's value gradient
on its policy's rows (its value adapter active) -> each policy's optimizer step over both its param groups.

The critic's gradient comes from its own backward passes with the value adapter active, the policy's from
passes with the policy adapter active: each loss reaches only its own parameters (tested). The two are
clipped separately (train.max_grad_norm each), so a large value loss never shrinks the policy's step.

Data parallel: the value loss's token count and the critic's gradients are summed over ranks like the
policy's, and whitened advantages use the whole batch's mean and std (advantages.whiten's all_sum).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import torch

from rlora.algos.gae import clipped_value_loss, explained_variance, ppo_advantages
from rlora.algos.losses import aggregate
from rlora.models.frozen_prefix import FrozenPrefix
from rlora.models.precision import trainer_precision
from rlora.models.value_model import Critic
from rlora.batching import trim
from rlora.train.policies import row_policies
from rlora.train.step import (
    policy_batches, policy_blocks, behaviour, collect_metrics, loss_mask, reward_metrics, rollout_metrics, sample_rows,
)
from rlora.train.step_batch import Timings, collect_batch, step_params
from rlora.train.distributed import World, all_reduce_gradients, all_reduce_sums
from rlora.train.fsdp import passes_to_add
from rlora.train.optim import optimizer_step
from rlora.train.passes import logprob_passes
from rlora.train.session import Session
from rlora.train.update import (
    ScoredRollout, on_device, accumulate_gradient_per_policy, batch_totals, global_totals,
)
from rlora.tensors import pad_right
from rlora.types import Rollout


@torch.no_grad()
def batched_values(critic: Critic, rollout: Rollout, micro_batch_size: int,
                   prefix: FrozenPrefix | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """V(s_t) of every completion position of the rows in `block` (first, end; None: every row), no gradient, eval
    mode (no dropout), micro-batch by micro-batch -> values [end - first, Tc] on the rollout's device, 0 on padding."""
    width = rollout.completion_ids_BTc.shape[1]
    first, end = block or (0, rollout.num_completions)
    parts = [torch.zeros(0, width, device=rollout.completion_ids_BTc.device)]
    with critic.active(trainable=False):
        critic.model.eval()  # the training flags come back when active() ends
        for start in range(first, end, micro_batch_size):
            rows = slice(start, min(start + micro_batch_size, end))
            micro = trim(rollout.select(rows))
            values = critic.values(micro, None if prefix is None else prefix.rows(rows, micro))
            parts.append(pad_right(values, width))  # on the model's device, as the rollout
    return torch.cat(parts)


def accumulate_value_gradient(critic: Critic, rollout: Rollout, returns_BT: torch.Tensor, old_values_BT: torch.Tensor,
                              mask_BT: torch.Tensor, micro_batch_size: int, clip: float | None,
                              prefix: FrozenPrefix | None = None, world: World = World()) -> dict[str, float]:
    """Backward of the clipped value loss, a token mean over the whole batch's real tokens, all ranks' (each
    micro-batch's sum divided by the batch's token count, so the split does not change the gradient); the
    critic's gradients are then summed over ranks. Rows without a real token are not forwarded.
    -> value_loss, value_clip_frac."""
    totals = global_totals(world, batch_totals(mask_BT, constant_len=1))
    rows = (mask_BT.sum(-1) > 0).nonzero().squeeze(-1)
    # train.fsdp: as many passes as the busiest rank (rows without a real token differ per rank)
    padding = passes_to_add(world, critic.model, -(-len(rows) // micro_batch_size))
    loss_sum, clipped, tokens = 0.0, 0.0, 0.0
    with critic.active(trainable=True):  # backward inside: checkpointed layers recompute with this adapter
        for start in range(0, len(rows), micro_batch_size):
            index = rows[start:start + micro_batch_size]
            micro = trim(rollout.select(index))
            width = micro.completion_ids_BTc.shape[1]
            values_BT = critic.values(micro, None if prefix is None else prefix.rows(index, micro))
            here = on_device(values_BT.device)
            mask = here(mask_BT[index, :width]).float()
            old, returns = here(old_values_BT[index, :width]), here(returns_BT[index, :width])
            out = clipped_value_loss(values_BT, old, returns, clip)
            loss = aggregate(out.loss_BT, mask, "token_mean", totals)
            loss.backward()
            loss_sum += loss.item()
            clipped += float((out.clipped_BT * mask).sum())
            tokens += float(mask.sum())
        for _ in range(padding):
            _zero_value_pass(critic, rollout, prefix)
    all_reduce_gradients(world, critic.parameters())
    loss_sum, clipped, tokens = all_reduce_sums(world, [loss_sum, clipped, tokens])
    return {"value_loss": loss_sum, "value_clip_frac": clipped / tokens if tokens else None}


def _zero_value_pass(critic: Critic, rollout: Rollout, prefix: FrozenPrefix | None) -> None:
    """The value passes' counterpart of train/fsdp.py zero_pass: the forward and backward of the rollout's first
    row, times 0, so that a sharded base's all-gathers pair with the busiest rank's; a parameter without a gradient
    keeps none, and the random state is put back."""
    micro = trim(rollout.select(slice(0, 1)))
    without_grad = [p for p in critic.parameters() if p.grad is None]
    device = critic.head.weight.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        values = critic.values(micro, None if prefix is None else prefix.rows(slice(0, 1), micro))
        (values.sum() * 0.0).backward()
    for param in without_grad:
        param.grad = None


def _masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> float | None:
    count = float(mask_BT.sum())
    return float((values_BT.double() * mask_BT).sum()) / count if count else None


def ppo_step(s: Session, step: int, replay=None) -> tuple[dict, list[dict]]:
    """grpo_step's counterpart for algo.name=ppo (no replay: the config refuses it). Every policy of the run (K >= 1)
    has its own critic: its rows' values, GAE advantages and returns (whitened over its own rows), value loss and
    optimizer step, as in a run of that policy alone; the policies' gradients come from one shared update pass. Its
    metrics are grpo_step's: the shared ones, and each policy's (with its critic's) under 'policies'."""
    cfg, ppo = s.cfg, s.cfg.ppo
    t_start, timings = time.perf_counter(), Timings()
    collected = collect_batch(s, step, None, timings)
    batch, stats = collected.batch, collected.stats
    sampled = s.source.take_metrics()  # episodes: turns, tool calls, ... of this step, per policy
    if batch is None:  # only dynamic sampling drops groups, and the config refuses it with ppo
        raise RuntimeError("ppo collected no samples")
    t_collected = time.perf_counter()
    rollout, mask_BT = batch.rollout, loss_mask(s, batch)
    mb, chunk, G = cfg.train.micro_batch_size, cfg.train.logprob_chunk_tokens, cfg.rollout.num_generations
    algo = dataclasses.replace(s.algo, kl_in_reward=ppo.kl_mode == "reward")  # the loss then has no KL term
    betas = [p.beta for p in s.policies]
    need_ref = max(betas) > 0
    need_old = cfg.algo.num_iterations > 1 or (algo.kl_in_reward and need_ref)
    # each policy's rows: its groups come policy by policy, and every rank holds as many of each (the config refuses
    # dynamic sampling and replay with ppo), so no phase adds padding passes on a sharded base
    blocks = [(first * G, end * G) for first, end in policy_blocks(batch.groups, len(s.policies))]
    policy_B = row_policies([g.slot for g in batch.groups], G).to(mask_BT.device)
    # every log-prob and value pass and its backward under one precision; the optimizer steps outside it
    precision = functools.partial(trainer_precision, s.model, cfg.train.autocast)
    with precision():
        # the values' and the policies' passes share the prefix
        passes = logprob_passes(s, rollout, policy_B, need_ref, need_old, update_shares_prefix=True)
        prefix, ref_logp, old_logp = passes.prefix, passes.ref_logp_BTc, passes.old_logp_BTc
        old_values_BT = torch.cat([batched_values(critic, rollout, mb, prefix, block)
                                   for critic, block in zip(s.critics, blocks)]) * mask_BT
        t_values = time.perf_counter()

        kl_BT = old_logp - ref_logp if algo.kl_in_reward and ref_logp is not None else None  # k1 per token
        rewards_B = batch.stats_rewards_P_S[:, :G].reshape(-1).to(mask_BT.device)
        targets = [ppo_advantages(rewards_B[lo:hi], old_values_BT[lo:hi], mask_BT[lo:hi], ppo.gamma, ppo.lam,
                                  ppo.whiten_advantages, cfg.algo.adv_eps, None if kl_BT is None else kl_BT[lo:hi],
                                  policy.beta, all_sum=lambda values: all_reduce_sums(s.world, values))
                   for policy, (lo, hi) in zip(s.policies, blocks)]  # each over its own rows, all ranks' (whitening)
        advantages_BT = torch.cat([t.advantages_BT for t in targets])
        returns_BT = torch.cat([t.returns_BT for t in targets])
        behaviour_BT, cap_B = behaviour(s, batch)
        scored = ScoredRollout(rollout, advantages_BT, mask_BT, old_logp, ref_logp, behaviour_BT, cap_B,
                               policy_B=policy_B, betas=betas)
    for _ in range(cfg.algo.num_iterations):
        lrs = [p.scheduler.get_last_lr() for p in s.policies]  # each policy's and its critic's param groups
        with precision():
            updates = accumulate_gradient_per_policy(s.model, algo, cfg.algo, scored, mb, cfg.constant_norm(), chunk,
                                                     s.world, prefix, s.adapter)
            for update, critic, block in zip(updates, s.critics, blocks):
                update |= accumulate_value_gradient(critic, rollout, returns_BT, old_values_BT,
                                                    _only_rows(mask_BT, block), mb, ppo.value_clip, prefix, s.world)
        for update, policy, critic in zip(updates, s.policies, s.critics):
            value_grad_norm = _clip(critic.parameters(), cfg.train.max_grad_norm)
            # a non-finite value loss or gradient skips the whole update, as a non-finite policy one does
            finite = math.isfinite(update["value_loss"]) and math.isfinite(value_grad_norm)
            update |= optimizer_step(policy.params, policy.optimizer, policy.scheduler, cfg.train.max_grad_norm,
                                     update["loss"] if finite else math.nan)
            update["value_grad_norm"] = value_grad_norm
    t_end = time.perf_counter()

    shared = {"step": step + 1, **collect_metrics(stats, cfg), "temperature": step_params(cfg, step).temperature,
              "step_s": t_end - t_start, "rollout_s": timings.rollout_s, "reward_s": timings.reward_s,
              "values_s": t_values - t_collected, "train_s": t_end - t_values}
    if policy_B.is_cuda:
        shared["gpu_peak_gb"] = torch.cuda.max_memory_allocated(policy_B.device) / 2**30
    if batch.scores.errors:
        shared["reward_errors"] = batch.scores.errors[:5]
    per_policy = {}
    for policy, part, draw, update, (lo, hi), (lr, value_lr) in zip(
            s.policies, policy_batches(batch, len(s.policies)), collected.policy_stats, updates, blocks, lrs):
        values, returns, mask = old_values_BT[lo:hi], returns_BT[lo:hi], mask_BT[lo:hi]
        metrics = {**reward_metrics(part), **update, **rollout_metrics(part), **collect_metrics(draw, cfg),
                   "lr": lr, "value_lr": value_lr,
                   "explained_variance": explained_variance(values, returns, mask,  # all ranks' tokens
                                                            all_sum=lambda v: all_reduce_sums(s.world, v)),
                   "value_mean": _masked_mean(values, mask), "return_mean": _masked_mean(returns, mask),
                   "advantage_mean": _masked_mean(advantages_BT[lo:hi], mask), "value_tokens": int(mask.sum()),
                   **sampled.get(policy.index, {})}
        per_policy[policy.name] = metrics
    if len(s.policies) == 1:  # one policy: every metric is its own (train/policies.py split_metrics: plain names)
        per_policy[s.policies[0].name] |= {k: v for k, v in shared.items() if k != "step"}
        shared = {"step": shared["step"]}
    if G == 1:  # one sample per prompt: every "group" is trivially flat
        for metrics in [shared, *per_policy.values()]:
            for key in ("frac_groups_zero_std", "frac_zero_var_first"):
                metrics.pop(key, None)
    return {**shared, "policies": per_policy}, sample_rows(s, batch, advantages_BT, step)


def _only_rows(mask_BT: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The loss mask of one policy's rows (first, end), the others' zeroed."""
    only_BT = torch.zeros_like(mask_BT)
    only_BT[block[0]:block[1]] = mask_BT[block[0]:block[1]]
    return only_BT


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the gradients of `params` to max_norm (None: only measure) -> their norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm is None:
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in grads])))
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
