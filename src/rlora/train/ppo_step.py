"""One PPO step with a critic on the policy's base: collect -> reference/old log-probs -> the critic's values
-> GAE advantages and value targets -> per update: policy gradient (step.py/update.py's machinery, per-token
advantages) + value gradient (value adapter active) -> one optimizer step over both param groups.

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
from rlora.train.step import collect_metrics, reward_metrics, rollout_metrics, sample_rows, behaviour, loss_mask
from rlora.train.step_batch import Timings, collect_batch, step_params
from rlora.train.distributed import World, all_reduce_gradients, all_reduce_sums
from rlora.train.fsdp import passes_to_add
from rlora.train.optim import optimizer_step
from rlora.train.passes import logprob_passes
from rlora.train.session import Session
from rlora.train.update import (
    ScoredRollout, on_device, accumulate_policy_gradient, batch_totals, global_totals,
)
from rlora.tensors import pad_right
from rlora.types import Rollout


@torch.no_grad()
def batched_values(critic: Critic, rollout: Rollout, micro_batch_size: int,
                   prefix: FrozenPrefix | None = None) -> torch.Tensor:
    """V(s_t) of every completion position (no gradient, eval mode: no dropout), micro-batch by micro-batch
    -> values_BTc on the CPU, 0 on padding."""
    width = rollout.completion_ids_BTc.shape[1]
    parts = []
    with critic.active(trainable=False):
        critic.model.eval()  # the training flags come back when active() ends
        for start in range(0, rollout.num_completions, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
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
    """grpo_step's counterpart for algo.name=ppo (one policy, no replay: the config refuses both). Its metrics are
    grpo_step's: the shared ones, and the policy's (with the critic's) under 'policies'."""
    cfg, ppo, critic = s.cfg, s.cfg.ppo, s.critic
    [policy] = s.policies
    optimizer, scheduler = policy.optimizer, policy.scheduler
    t_start, timings = time.perf_counter(), Timings()
    collected = collect_batch(s, step, None, timings)
    batch, stats = collected.batch, collected.stats
    sampled = s.source.take_metrics().get(policy.index, {})  # episodes: turns, tool calls, ... of this step
    if batch is None:  # only dynamic sampling drops groups, and the config refuses it with ppo
        raise RuntimeError("ppo collected no samples")
    t_collected = time.perf_counter()
    rollout, mask_BT = batch.rollout, loss_mask(s, batch)
    mb, chunk, beta = cfg.train.micro_batch_size, cfg.train.logprob_chunk_tokens, cfg.algo.beta
    algo = dataclasses.replace(s.algo, kl_in_reward=ppo.kl_mode == "reward")  # the loss then has no KL term
    need_old = cfg.algo.num_iterations > 1 or (algo.kl_in_reward and beta > 0)
    # every log-prob and value pass and its backward under one precision; the optimizer steps outside it
    precision = functools.partial(trainer_precision, s.model, cfg.train.autocast)
    with precision():
        # the values' and the policy's passes share the prefix; every rank holds as many rows (the config refuses
        # dynamic sampling and replay with ppo), so no phase adds padding passes on a sharded base
        passes = logprob_passes(s, rollout, None, beta > 0, need_old, update_shares_prefix=True)
        prefix, ref_logp, old_logp = passes.prefix, passes.ref_logp_BTc, passes.old_logp_BTc
        old_values_BT = batched_values(critic, rollout, mb, prefix) * mask_BT
        t_values = time.perf_counter()

        kl_BT = old_logp - ref_logp if algo.kl_in_reward and ref_logp is not None else None  # k1 per token
        rewards_B = batch.stats_rewards_P_S[:, :cfg.rollout.num_generations].reshape(-1).to(mask_BT.device)
        targets = ppo_advantages(rewards_B, old_values_BT, mask_BT, ppo.gamma, ppo.lam, ppo.whiten_advantages,
                                 cfg.algo.adv_eps, kl_BT, beta, all_sum=lambda values: all_reduce_sums(s.world, values))
        behaviour_BT, cap_B = behaviour(s, batch)
        scored = ScoredRollout(rollout, targets.advantages_BT, mask_BT, old_logp, ref_logp, behaviour_BT, cap_B)
    policy_params, value_params = policy.params, critic.parameters()
    for _ in range(cfg.algo.num_iterations):
        lr, value_lr = scheduler.get_last_lr()  # the policy's and the critic's param groups
        with precision():
            update = accumulate_policy_gradient(s.model, algo, cfg.algo, scored, mb, cfg.constant_norm(), chunk, s.world,
                                                prefix, s.adapter)
            update |= accumulate_value_gradient(critic, rollout, targets.returns_BT, old_values_BT, mask_BT, mb,
                                                ppo.value_clip, prefix, s.world)
        value_grad_norm = _clip(value_params, cfg.train.max_grad_norm)
        # a non-finite value loss or gradient skips the whole update, as a non-finite policy one does
        finite = math.isfinite(update["value_loss"]) and math.isfinite(value_grad_norm)
        update |= optimizer_step(policy_params, optimizer, scheduler, cfg.train.max_grad_norm,
                                 update["loss"] if finite else math.nan)
        update["value_grad_norm"] = value_grad_norm
    t_end = time.perf_counter()

    metrics = {
        "step": step + 1, **reward_metrics(batch), **update, **rollout_metrics(batch), **collect_metrics(stats, cfg),
        "lr": lr, "value_lr": value_lr, "temperature": step_params(cfg, step).temperature,
        "explained_variance": explained_variance(old_values_BT, targets.returns_BT, mask_BT,  # all ranks' tokens
                                                 all_sum=lambda values: all_reduce_sums(s.world, values)),
        "value_mean": _masked_mean(old_values_BT, mask_BT), "return_mean": _masked_mean(targets.returns_BT, mask_BT),
        "advantage_mean": _masked_mean(targets.advantages_BT, mask_BT), "value_tokens": int(mask_BT.sum()),
        "step_s": t_end - t_start, "rollout_s": timings.rollout_s, "reward_s": timings.reward_s,
        "values_s": t_values - t_collected, "train_s": t_end - t_values, **sampled,
    }
    if cfg.rollout.num_generations == 1:  # one sample per prompt: every "group" is trivially flat
        for key in ("frac_groups_zero_std", "frac_zero_var_first"):
            metrics.pop(key, None)
    if policy_params and policy_params[0].is_cuda:
        metrics["gpu_peak_gb"] = torch.cuda.max_memory_allocated(policy_params[0].device) / 2**30
    if batch.scores.errors:
        metrics["reward_errors"] = batch.scores.errors[:5]
    # one policy: every metric is its own (train/policies.py split_metrics gives them their plain names)
    return {"step": metrics.pop("step"), "policies": {policy.name: metrics}}, sample_rows(s, batch, targets.advantages_BT, step)


def _clip(params: list[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the gradients of `params` to max_norm (None: only measure) -> their norm before clipping."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm is None:
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in grads])))
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
