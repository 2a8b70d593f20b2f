"""One RL step, top to bottom: the batch (train/step_batch.py: sampling, adaptive resampling, dynamic sampling,
replayed groups) -> reference/old log-probs -> advantages -> update(s) -> metrics. Any algorithm of the registry."""

from __future__ import annotations

import bisect
import functools
import time
import warnings

import torch

from rlora.algos.registry import AdvantageInputs
from rlora.data.prompts import prompt_text
from rlora.models.precision import trainer_precision
from rlora.batching import select_rows
from rlora.train.collect import CollectStats, Group, is_flat
from rlora.train.replay import ReplayBuffer, StoredGroup
from rlora.train.distributed import all_reduce_sums
from rlora.train.policies import row_policies
from rlora.train.optim import optimizer_step
from rlora.train.fsdp import ZeroPasses
from rlora.train.passes import logprob_passes
from rlora.train.step_batch import Batch, Collected, Timings, collect_batch, step_params
from rlora.train.update import ScoredRollout, accumulate_gradient_per_policy, contribute_nothing
from rlora.train.session import Session


def loss_mask(s: Session, batch: Batch) -> torch.Tensor:
    """Completion tokens that enter the loss: the policy's own (an episode's environment tokens stay out), failed
    rewards out, and truncated completions if asked."""
    device = batch.rollout.completion_mask_BTc.device
    fresh = batch.rollout.trained_mask_BTc[:batch.num_fresh] * (~batch.scores.failed_B.to(device)).unsqueeze(-1)
    if s.cfg.algo.mask_truncated:
        truncated_B = torch.tensor([r == "length" for r in batch.rollout.finish_reasons[:batch.num_fresh]], device=device)
        fresh = fresh * (~truncated_B).unsqueeze(-1)
    width = batch.rollout.completion_mask_BTc.shape[1]
    stored = [torch.nn.functional.pad(g.loss_mask_GT.to(device), (0, width - g.loss_mask_GT.shape[1]))
              for g in batch.replayed]
    return torch.cat([fresh] + stored) if stored else fresh


def advantages_of(s: Session, batch: Batch, mask_BT, old_logp, ref_logp) -> torch.Tensor:
    """Fresh rows' advantages from the algorithm, each policy's over its own groups (batch-wide statistics and a KL
    in the reward with its own beta, as in a run of it alone), then the replayed rows' stored ones: one per token,
    [B, T]. Data parallel: a batch-wide statistic sums over the ranks, policy by policy; a policy without groups on
    this rank (dynamic sampling) takes part, adding nothing."""
    G = s.cfg.rollout.num_generations
    kl_BT = None
    if s.algo.kl_in_reward and ref_logp is not None:
        kl_BT = old_logp - ref_logp  # k1 estimate of KL(pi_old || ref) per token
    parts = []
    for policy, (first, end) in zip(s.policies, policy_blocks(batch.groups, len(s.policies))):
        rows = slice(first * G, end * G)
        parts.append(_policy_advantages(s, policy, batch.stats_rewards_P_S[first:end], mask_BT[rows],
                                        None if kl_BT is None else kl_BT[rows]))
    width = mask_BT.shape[1]
    stored = [torch.nn.functional.pad(g.advantages_GT.to(mask_BT.device), (0, width - g.advantages_GT.shape[1]))
              for g in batch.replayed]
    return torch.cat(parts + stored)


def _policy_advantages(s: Session, policy, rewards_P_S: torch.Tensor, mask_BT: torch.Tensor,
                       kl_BT: torch.Tensor | None) -> torch.Tensor:
    cfg = s.cfg.algo
    inputs = AdvantageInputs(rewards_P_S.to(mask_BT.device), mask_BT, cfg.adv_scale, cfg.adv_eps, policy.beta,
                             s.cfg.rollout.num_generations, kl_BT,
                             all_sum=lambda values: all_reduce_sums(s.world, values))  # batch statistics: all ranks
    return s.algo.advantages_BT(inputs)


def _statistics_without_rows(s: Session) -> None:
    """A rank without groups takes part in every policy's batch-wide advantage statistics (sums over the ranks),
    adding nothing, as the ranks with groups compute them in advantages_of."""
    no_rewards_P_S = torch.empty(0, s.cfg.rollout.num_generations, dtype=torch.float64)
    no_tokens_BT = torch.zeros(0, 1, device=s.device)
    for policy in s.policies:
        _policy_advantages(s, policy, no_rewards_P_S, no_tokens_BT, no_tokens_BT if s.algo.kl_in_reward else None)


def policy_blocks(groups: list[Group], num_policies: int) -> list[tuple[int, int]]:
    """(first, end) group indices of each policy's groups, which come policy by policy (Collector.collect's order)."""
    policy_G = [g.slot.policy for g in groups]
    if policy_G != sorted(policy_G):
        raise RuntimeError("a step's groups are not ordered policy by policy")
    return [(bisect.bisect_left(policy_G, k), bisect.bisect_right(policy_G, k)) for k in range(num_policies)]


def behaviour(s: Session, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Behaviour log-probs and per-row caps for the truncated importance weights: the bf16 sampler's
    (algo.sampler_is_cap) on fresh rows, the stored sampler's (algo.replay.is_cap) on replayed rows."""
    cfg, rollout = s.cfg.algo, batch.rollout
    # both samplers return their log-probs (the built-in engine, and generate drawing as it does); a rollout made
    # without them (a caller's own) has nothing to correct on the fresh rows
    fresh_cap = cfg.sampler_is_cap if rollout.sampling_logp_BTc is not None else None
    if fresh_cap is None and not batch.replayed:
        return None, None
    behaviour_BT = rollout.sampling_logp_BTc.clone()
    cap_B = torch.full((rollout.num_completions,), cfg.replay.is_cap, device=behaviour_BT.device)
    if fresh_cap is None:
        behaviour_BT[:batch.num_fresh] = float("nan")
    else:
        cap_B[:batch.num_fresh] = fresh_cap
    return behaviour_BT, cap_B


def store_groups(s: Session, batch: Batch, advantages, mask_BT, replay: list[ReplayBuffer], step: int) -> list[int]:
    """Each fresh group into its policy's buffer -> how many each policy's buffer took."""
    G = s.cfg.rollout.num_generations
    stored = [0] * len(replay)
    for g, fresh in enumerate(batch.groups):
        rows = list(range(g * G, (g + 1) * G))
        # the buffer holds its groups on the host: device memory stays the step's
        policy = fresh.slot.policy
        group = StoredGroup(select_rows(batch.rollout, rows).to(torch.device("cpu")), advantages[rows].cpu(),
                            mask_BT[rows].cpu(), step + 1, policy=policy)
        stored[policy] += replay[policy].add(group)
    return stored


def grpo_step(s: Session, step: int, replay: list[ReplayBuffer] | None = None) -> tuple[dict, list[dict]]:
    """Sample, score and train every policy of the run once -> (metrics: the shared ones and each policy's under
    'policies' (train/policies.py split_metrics); the sampled rows, for samples.jsonl)."""
    cfg = s.cfg
    t_start, timings = time.perf_counter(), Timings()
    collected = collect_batch(s, step, replay, timings)
    batch, stats, policy_stats = collected.batch, collected.stats, collected.policy_stats
    sampled = s.source.take_metrics()  # episodes: each policy's turns, tool calls, ... of this step
    t_collected = time.perf_counter()
    # over all ranks: how many hold groups, and each policy's groups (dynamic sampling may leave one with none)
    mine = [] if batch is None else [g.slot.policy for g in batch.groups]
    ranks_with_groups, *policy_groups = all_reduce_sums(s.world, [float(batch is not None)]
                                                        + [float(mine.count(p.index)) for p in s.policies])
    if batch is None and ranks_with_groups:  # data parallel: other ranks train, this one adds zeros
        return _empty_rank_update(s, step, collected, timings, t_start, sampled, policy_groups), []
    if batch is None:  # dynamic sampling kept no group: nothing to learn from this step (replay waits too)
        return {"step": step + 1, **collect_metrics(stats, cfg), "temperature": step_params(cfg, step).temperature,
                "step_s": t_collected - t_start, "rollout_s": timings.rollout_s, "reward_s": timings.reward_s,
                "policies": {p.name: {**collect_metrics(draw, cfg), **_skip_update(s, p), **sampled.get(p.index, {})}
                             for p, draw in zip(s.policies, policy_stats)}}, []
    rollout = batch.rollout
    mask_BT = loss_mask(s, batch)

    mb, chunk = cfg.train.micro_batch_size, cfg.train.logprob_chunk_tokens
    betas = [p.beta for p in s.policies]  # each policy's own
    need_ref, need_old = _phases(s)
    # every log-prob pass and its backward under one precision; the optimizer steps outside it (float32 adapters)
    precision = functools.partial(trainer_precision, s.model, cfg.train.autocast)
    with precision():
        # each row's policy: the fresh groups', then the replayed ones'
        G = cfg.rollout.num_generations
        policy_B = torch.cat([row_policies([g.slot for g in batch.groups], G),
                              torch.tensor([g.policy for g in batch.replayed], dtype=torch.long).repeat_interleave(G)
                              ]).to(s.device)
        passes = logprob_passes(s, rollout, policy_B, need_ref, need_old)
        prefix, ref_logp, old_logp = passes.prefix, passes.ref_logp_BTc, passes.old_logp_BTc
        t_old = time.perf_counter()

        advantages = advantages_of(s, batch, mask_BT, old_logp, ref_logp)
        behaviour_BT, cap_B = behaviour(s, batch)
        fresh_B = torch.arange(rollout.num_completions, device=s.device) < batch.num_fresh
        scored = ScoredRollout(rollout, advantages, mask_BT, old_logp, ref_logp, behaviour_BT, cap_B, fresh_B, policy_B,
                               betas)
    optim_s = 0.0
    for _ in range(cfg.algo.num_iterations):
        lrs = [p.scheduler.get_last_lr()[0] for p in s.policies]
        with precision():
            updates = accumulate_gradient_per_policy(s.model, s.algo, cfg.algo, scored, mb, cfg.constant_norm(), chunk,
                                                     s.world, prefix, s.adapter)
        t_optim = time.perf_counter()
        updates = [_policy_step(p, update, lr, cfg.train.max_grad_norm, trained=bool(groups))
                   for update, p, lr, groups in zip(updates, s.policies, lrs, policy_groups)]
        optim_s += time.perf_counter() - t_optim
    t_end = time.perf_counter()
    stored = store_groups(s, batch, advantages, mask_BT, replay, step) if replay is not None else None

    # every policy's metrics from this rank's share of its groups (merge_metrics joins the ranks' shares); a policy
    # without groups on this rank has its sampling statistics and the update's (over every rank)
    parts = policy_batches(batch, len(s.policies))
    metrics = {
        "step": step + 1, **collect_metrics(stats, cfg), "temperature": step_params(cfg, step).temperature,
        "step_s": t_end - t_start, "rollout_s": timings.rollout_s, "reward_s": timings.reward_s,
        "prefix_s": passes.prefix_s, "ref_s": passes.ref_s, "old_s": passes.old_s, "train_s": t_end - t_old - optim_s,
        "optim_s": optim_s,
        "gen_tokens": int(rollout.trained_mask_BTc[:batch.num_fresh].sum()),
        "policies": {p.name: {**(reward_metrics(part) if part.groups else {}), **update,
                              **(rollout_metrics(part) if part.groups else {"gen_tokens": 0}),
                              **collect_metrics(draw, cfg), **sampled.get(p.index, {})}
                     for p, update, part, draw in zip(s.policies, updates, parts, policy_stats)},
    }
    first_params = s.policies[0].params
    if first_params and first_params[0].is_cuda:
        metrics["gpu_peak_gb"] = torch.cuda.max_memory_allocated(first_params[0].device) / 2**30
    if replay is not None:  # each policy's, and the run's totals
        for p, buffer in zip(s.policies, replay):
            metrics["policies"][p.name] |= {"replay_groups": sum(g.policy == p.index for g in batch.replayed),
                                            "replay_stored": stored[p.index], "replay_buffer": len(buffer)}
        metrics |= {"replay_groups": len(batch.replayed), "replay_stored": sum(stored),
                    "replay_buffer": sum(len(buffer) for buffer in replay)}
    if batch.scores.errors:
        metrics["reward_errors"] = batch.scores.errors[:5]
    return metrics, sample_rows(s, batch, advantages, step)


def _phases(s: Session) -> tuple[bool, bool]:
    """(need_ref, need_old): whether the step computes the reference log-probs (a policy has a KL term) and the
    old policy's (several updates per batch, or a KL penalty in the reward)."""
    need_ref = max(p.beta for p in s.policies) > 0
    return need_ref, s.cfg.algo.num_iterations > 1 or (s.algo.kl_in_reward and need_ref)


def policy_batches(batch: Batch, num_policies: int) -> list[Batch]:
    """Each policy's part of a step's batch, for its metrics: its fresh groups (its replayed ones count in its
    replay_* metrics; a run's only policy's part is the batch, whose metrics are over its fresh groups too)."""
    if num_policies == 1:
        return [batch]
    G = batch.num_fresh // len(batch.groups)
    parts = []
    for first, end in policy_blocks(batch.groups, num_policies):  # the same blocks as advantages_of's
        rows = list(range(first * G, end * G))
        parts.append(Batch(select_rows(batch.rollout, rows), batch.scores.select(rows),
                           batch.stats_rewards_P_S[first:end], batch.groups[first:end]))
    return parts


def _empty_rank_update(s: Session, step: int, collected: Collected, timings: Timings, t_start: float,
                       sampled: dict[int, dict], policy_groups: list[float]) -> dict:
    """A rank without groups this step takes part in every policy's update, adding nothing. On a sharded base it
    also makes the other ranks' passes through the layers, with a row it dropped (dynamic sampling dropped every
    group it drew), whose results it drops in turn. policy_groups: each policy's groups over all ranks."""
    padding = None
    if s.sharded is not None:
        dropped_row = collected.dropped_row
        if dropped_row is None:  # only dynamic sampling leaves a rank without groups, and it dropped them
            raise RuntimeError("a rank without groups on a sharded base has no dropped row to pad its passes with")
        with trainer_precision(s.model, s.cfg.train.autocast):
            # through the first policy where there are several: the results are dropped
            passes = logprob_passes(s, dropped_row, torch.zeros(1, dtype=torch.long, device=s.device), *_phases(s))
        padding = ZeroPasses(s.model, dropped_row, s.cfg.train.logprob_chunk_tokens, passes.prefix)
    _statistics_without_rows(s)
    updates = [{} for _ in s.policies]
    for _ in range(s.cfg.algo.num_iterations):
        lrs = [p.scheduler.get_last_lr()[0] for p in s.policies]
        with trainer_precision(s.model, s.cfg.train.autocast):
            updates = contribute_nothing(s.world, s.model, s.algo, s.cfg.algo, s.adapter, [p.beta for p in s.policies],
                                         padding)
        updates = [_policy_step(p, update, lr, s.cfg.train.max_grad_norm, trained=bool(groups))  # the whole batch's
                   for update, p, lr, groups in zip(updates, s.policies, lrs, policy_groups)]
    return {"step": step + 1, **collect_metrics(collected.stats, s.cfg),
            "temperature": step_params(s.cfg, step).temperature,
            "step_s": time.perf_counter() - t_start, "rollout_s": timings.rollout_s, "reward_s": timings.reward_s,
            "policies": {p.name: {**collect_metrics(draw, s.cfg), **update, **sampled.get(p.index, {})}
                         for p, update, draw in zip(s.policies, updates, collected.policy_stats)}}


def _policy_step(policy, update: dict, lr: float, max_grad_norm: float | None, trained: bool) -> dict:
    """One update of a policy -> its update's metrics and lr. A policy that kept no group on any rank this step
    (dynamic sampling) skips its optimizer step and only advances its schedule, as a run of it alone skips the
    update of a step without groups."""
    if not trained:
        policy.optimizer.zero_grad(set_to_none=True)  # it has none (no row on any rank): as after a step
        _advance_schedule(policy)
        return {"skipped_update": 1, "trained_frac": 0.0, "lr": lr}
    return update | optimizer_step(policy.params, policy.optimizer, policy.scheduler, max_grad_norm,
                                   update["loss"]) | {"lr": lr}


def _advance_schedule(policy) -> None:
    """One schedule step without an optimizer step (torch warns about that order: silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        policy.scheduler.step()


def _skip_update(s: Session, policy) -> dict:
    """A step without an update still advances the policy's schedule, as if it had run -> its metrics: skipped,
    nothing trained, its lr at the step."""
    lr = policy.scheduler.get_last_lr()[0]
    for _ in range(s.cfg.algo.num_iterations):
        _advance_schedule(policy)
    return {"skipped_update": 1, "trained_frac": 0.0, "lr": lr}


def reward_metrics(batch: Batch) -> dict:
    scores = batch.scores
    valid = ~scores.failed_B
    total = scores.total_B
    return {
        "reward_mean": float(total[valid].mean()) if valid.any() else None, "reward_count": int(valid.sum()),
        "reward_std": float(total[valid].std()) if valid.sum() > 1 else 0.0,
        **{f"reward/{name}": _mean(values) for name, values in scores.per_fn.items()},
        **{f"reward_count/{name}": _count(values) for name, values in scores.per_fn.items()},  # what each mean is over
        "reward_failures": int(scores.failed_B.sum()),
    }


def rollout_metrics(batch: Batch) -> dict:
    rollout, n = batch.rollout, batch.num_fresh
    lengths = rollout.trained_mask_BTc[:n].sum(-1).float()  # the policy's tokens (an episode's: all its turns)
    shaping = torch.cat([g.shaping_G for g in batch.groups])
    return {
        "rows": n, "groups": len(batch.groups),  # the counts that the means below are over (train/metrics.py)
        "completion_len_mean": float(lengths.mean()), "completion_len_max": int(lengths.max()),
        "truncated_frac": sum(r == "length" for r in rollout.finish_reasons[:n]) / n,
        # groups of the trained batch whose task rewards are all equal (what GRPO-style advantages zero out)
        "frac_groups_zero_std": sum(is_flat(g.scores.total_B) for g in batch.groups) / len(batch.groups),
        "overlong_penalty_mean": float(shaping.mean()) if bool((shaping != 0).any()) else 0.0,
        "gen_tokens": int(rollout.trained_mask_BTc[:n].sum()), "prompt_tokens": int(rollout.prompt_mask_BTp[:n].sum()),
    }


def collect_metrics(stats: CollectStats, cfg) -> dict:
    out = {"sampling_rounds": stats.sampling_rounds, "groups_sampled": stats.groups_sampled,
           "reward_mean_sampled": stats.first_reward_sum / stats.first_reward_count if stats.first_reward_count else None,
           "reward_count_sampled": stats.first_reward_count,
           "frac_zero_var_first": stats.zero_var_before / max(stats.groups_sampled, 1)}
    if cfg.algo.dynamic_sampling:
        out["groups_dropped"] = stats.groups_dropped
    if cfg.algo.adaptive.enabled:
        out |= {"resamples": stats.resamples, "rescued_groups": stats.rescued,
                "frac_zero_var_after_resample": stats.zero_var_after / max(stats.groups_sampled, 1)}
    return out


def sample_rows(s: Session, batch: Batch, advantages, step: int) -> list[dict]:
    G, scores, rollout = s.cfg.rollout.num_generations, batch.scores, batch.rollout
    # one read back of what the rows show (the rollout is on the model's device): a completion's advantage (per
    # token: its first token's), its temperature, an episode's tokens (right-padded: the first `length`)
    per_row, temperatures = advantages[:, 0].tolist(), rollout.temperature_B.tolist()
    episode = rollout.policy_mask_BTc is not None
    ids, lengths = (rollout.completion_ids_BTc.tolist(), rollout.completion_mask_BTc.sum(-1).tolist()) if episode else ((), ())
    rows = []
    for i in range(batch.num_fresh):
        group = batch.groups[i // G]
        policy = s.policies[group.slot.policy]
        named = {"policy": policy.name} if policy.own_folder else {}
        if episode:  # its whole text after the prompt, markers included
            named["episode"] = s.tokenizer.decode(ids[i][:lengths[i]], skip_special_tokens=False)
        rows.append({"step": step + 1, **named, "prompt": prompt_text(s.prompts.train[group.slot.prompt]), "completion": rollout.completions[i],
                     "reward": _num(scores.total_B[i]), "advantage": per_row[i],
                     "temperature": temperatures[i], "retries": group.retries,
                     **{f"reward/{name}": values[i] for name, values in scores.per_fn.items()}})
    return rows


def _num(value: torch.Tensor) -> float | None:
    v = float(value)
    return None if v != v else v


def _count(values: list) -> int:
    return sum(1 for v in values if v is not None and v == v)


def _mean(values: list) -> float | None:
    finite = [v for v in values if v is not None and v == v]
    return sum(finite) / len(finite) if finite else None
