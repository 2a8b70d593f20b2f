"""One RL step, top to bottom: collect groups (sampling, adaptive resampling, dynamic sampling) -> replayed
groups -> reference/old log-probs -> advantages -> update(s) -> metrics. Any algorithm of the registry."""

from __future__ import annotations

import bisect
import functools
import random
import time
import warnings
from dataclasses import dataclass, field

import torch

from rlora.algos.registry import AdvantageInputs
from rlora.data.prompts import PromptOrder, prompt_text
from rlora.errors import UserError
from rlora.rewards.scoring import Scores
from rlora.models.precision import trainer_precision
from rlora.batching import concat_rollouts, select_rows
from rlora.train.collect import CollectStats, Collector, Group, assemble, is_flat
from rlora.train.replay import ReplayBuffer, StoredGroup
from rlora.train.schedules import progress_of, scheduled_value
from rlora.train.slots import Slot, extra_round, first_round
from rlora.train.distributed import all_reduce_sums
from rlora.train.policies import row_policies
from rlora.train.optim import optimizer_step
from rlora.train.fsdp import ZeroPasses
from rlora.train.passes import logprob_passes
from rlora.train.update import ScoredRollout, accumulate_gradient_per_policy, contribute_nothing
from rlora.train.session import Session
from rlora.types import Example, Rollout, SamplingParams


class RewardFailure(UserError):
    """Too many samples' rewards failed in one step; the run stops and keeps its last adapter."""

    run_status = "stopped: reward failures"  # summary.json (train/lifecycle.py)


def check_failures(s: Session, scores: Scores, step: int) -> None:
    failed = int(scores.failed_B.sum())
    if failed and failed / len(scores.failed_B) > s.cfg.train.max_reward_failure_frac:
        raise RewardFailure(
            f"stopped at step {step + 1}: rewards failed for {failed}/{len(scores.failed_B)} samples "
            f"(limit train.max_reward_failure_frac={s.cfg.train.max_reward_failure_frac}; failed episodes count too); "
            f"first: {scores.errors[0]}"
        )


@dataclass
class Timings:
    rollout_s: float = 0.0
    reward_s: float = 0.0


@dataclass
class Batch:
    """What one step trains on: fresh groups, then replayed ones."""

    rollout: Rollout
    scores: Scores  # fresh rows only
    stats_rewards_P_S: torch.Tensor  # rewards for the advantage statistics of the fresh groups
    groups: list[Group]  # in row order; Group.slot: which policy drew which prompt (train/slots.py)
    replayed: list[StoredGroup] = field(default_factory=list)

    @property
    def num_fresh(self) -> int:
        return len(self.scores.total_B)


def step_params(cfg, step: int) -> SamplingParams:
    r = cfg.rollout
    temperature = scheduled_value(r.temperature_schedule, r.temperature, r.temperature_end, progress_of(step, cfg.train.steps))
    return SamplingParams(r.max_new_tokens, temperature, r.top_p, r.top_k, r.min_new_tokens, min_p=r.min_p,
                          stop=tuple(r.stop), think=r.think_phase())


def step_seed(cfg, step: int, seed: int | None = None) -> int:
    """The sampling seed of a step (of a run whose train.seed is `seed`, default the config's)."""
    return (cfg.train.seed if seed is None else seed) * 100_003 + step


def _sampling_args(s: Session, step: int, slots: list[Slot], seed: int):
    """(seed or seeds, keys, policies) of the sampler call for these slots: each slot draws with the key and seed
    that a run of its policy alone would use. An adapter that serves one policy samples on the sampler's plain
    path: one seed for all prompts, no policies (what transformers generate takes too)."""
    keys = [slot.key(s.cfg.train.prompts_per_step) for slot in slots]
    offset = seed - step_seed(s.cfg, step)  # the Collector's addition for a later round or a retry
    seeds = [step_seed(s.cfg, step, s.policies[slot.policy].seed) + offset for slot in slots]
    policies = s.adapter.sampler_policies([slot.policy for slot in slots])
    if policies is None:
        [seed] = set(seeds) or {seed}  # one policy: one seed
        return seed, keys, None
    return seeds, keys, policies


def _sampler(s: Session, step: int, timings: Timings):
    """SampleFn over the run's model and rollout source (completions or episodes, train/sources.py), which scores
    them too; counts the time spent in each. It samples slots (train/slots.py): each slot's training prompt, with the
    slot's key."""
    def sample(slots: list[Slot], params: list[SamplingParams], seed: int):
        t0 = time.perf_counter()
        prompts = [slot.prompt for slot in slots]
        seeds, keys, policies = _sampling_args(s, step, slots, seed)
        rollout, scores, reward_s = s.source.sample(s.model, [s.prompts.train[i] for i in prompts],
                                                    [s.train_ids[i] for i in prompts], s.cfg.rollout.num_generations,
                                                    params, seeds, keys, policies)
        check_failures(s, scores, step)
        timings.reward_s += reward_s
        timings.rollout_s += time.perf_counter() - t0 - reward_s
        return rollout, scores

    return sample


@dataclass
class Collected:
    """What a step's sampling gathered on this rank."""

    batch: Batch | None  # None: dynamic sampling kept no group on this rank
    stats: CollectStats  # the step's sampling statistics: every policy's groups, each round once
    policy_stats: list[CollectStats]  # each policy's own (a run's only policy: the step's)
    dropped_row: Rollout | None  # a row of a dropped group, on the model's device (None: none was dropped)


def collect_batch(s: Session, step: int, replay: ReplayBuffer | None, timings: Timings) -> Collected:
    """The step's batch, its sampling statistics and a row of a dropped group."""
    cfg, P = s.cfg, s.cfg.train.prompts_per_step
    step_prompts = PromptOrder(len(s.train_ids), P, cfg.data.seed, cfg.data.shuffle).indices(step)
    copies = len(s.policies)  # each policy samples every prompt of the step
    # this rank's share of the step's prompts, for every policy: each rank holds as many groups of each policy
    my_slots = first_round(step_prompts, s.world.share(list(range(P))), copies)
    extra = ExtraPrompts(len(s.train_ids), P, cfg.data.seed, step, step_prompts)

    def more_slots(round_index: int) -> list[Slot]:
        # every rank draws the same list, and every policy the same prompts: the collector samples those of the
        # policies that still need groups
        drawn = extra(round_index)
        return [slot for k in range(copies) for slot in s.world.share(extra_round(round_index, drawn, k))]

    collector = Collector(_sampler(s, step, timings), step_params(cfg, step), cfg.rollout.num_generations, cfg.algo,
                          step_seed(cfg, step), owner=lambda slot: slot.policy)
    with s.sampling_scope():  # train.fsdp: one scope where ranks call the sampler a different number of times
        groups = collector.collect(my_slots, more_slots)
    dropped_row = None if collector.dropped_row is None else collector.dropped_row.to(s.device)
    policy_stats = [collector.owner_stats[k] for k in range(copies)]
    if not groups:
        return Collected(None, collector.stats, policy_stats, dropped_row)
    rollout, scores, stats_rewards = assemble(groups, s.tok.pad_id, cfg.algo.adaptive.adv_stats)
    expected = cfg.algo.replay.ratio * len(groups)
    replayed = replay.draw(replay_count(expected, cfg.train.seed, step, s.world.rank), step) if replay else []
    # from here to the update the rollout stays on the model's device (the built-in sampler's is there already;
    # transformers generate's, an episode's and the replay buffer's groups are built or kept on the host)
    rollout = concat_rollouts([r.to(s.device) for r in [rollout] + [g.rollout for g in replayed]], s.tok.pad_id)
    return Collected(Batch(rollout, scores, stats_rewards, groups, replayed), collector.stats, policy_stats, dropped_row)


class ExtraPrompts:
    """Prompts for dynamic sampling's extra rounds: drawn at random (seeded by data seed, step and round)
    from the prompts this step has not sampled yet, so a dropped prompt is never redrawn in the same step.
    Every rank draws the same list and takes its share."""

    def __init__(self, num_prompts: int, count: int, seed: int, step: int, first: list[int]):
        self.num_prompts, self.count, self.seed, self.step = num_prompts, count, seed, step
        self.used = set(first)

    def __call__(self, round_index: int) -> list[int]:
        fresh = [i for i in range(self.num_prompts) if i not in self.used] or list(range(self.num_prompts))
        rng = random.Random(f"extra-{self.seed}-{self.step}-{round_index}")
        picked = rng.sample(fresh, min(self.count, len(fresh)))
        self.used.update(picked)
        return picked


def replay_count(expected: float, seed: int, step: int, rank: int = 0) -> int:
    """Stochastic rounding (seeded by step, and by the rank after rank 0): on average `expected` replayed groups
    per step, also when it is below 1 (round() would give 0 for ratio 0.25 x 2 groups and never replay)."""
    whole = int(expected)
    return whole + (random.Random(f"replay-{seed}-{step}" + (f"-{rank}" if rank else "")).random() < expected - whole)


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
    [B, T]. Data parallel: a batch-wide statistic sums over the ranks, policy by policy (every rank holds groups of
    every policy: the config refuses batch-wide statistics with dynamic sampling across ranks)."""
    cfg, G = s.cfg.algo, s.cfg.rollout.num_generations
    parts = []
    for policy, (first, end) in zip(s.policies, _policy_blocks(batch.groups, len(s.policies))):
        if first == end:  # dynamic sampling kept none of its groups
            continue
        rows = slice(first * G, end * G)
        kl_BT = None
        if s.algo.kl_in_reward and ref_logp is not None:
            kl_BT = old_logp[rows] - ref_logp[rows]  # k1 estimate of KL(pi_old || ref) per token
        inputs = AdvantageInputs(batch.stats_rewards_P_S[first:end].to(mask_BT.device), mask_BT[rows], cfg.adv_scale,
                                 cfg.adv_eps, policy.beta, G, kl_BT,
                                 all_sum=lambda values: all_reduce_sums(s.world, values))  # batch statistics: all ranks
        parts.append(s.algo.advantages_BT(inputs))
    width = mask_BT.shape[1]
    stored = [torch.nn.functional.pad(g.advantages_GT.to(mask_BT.device), (0, width - g.advantages_GT.shape[1]))
              for g in batch.replayed]
    return torch.cat(parts + stored)


def _policy_blocks(groups: list[Group], num_policies: int) -> list[tuple[int, int]]:
    """(first, end) group indices of each policy's groups, which come policy by policy (Collector.collect's order)."""
    policy_G = [g.slot.policy for g in groups]
    if policy_G != sorted(policy_G):
        raise RuntimeError("a step's groups are not ordered policy by policy")
    return [(bisect.bisect_left(policy_G, k), bisect.bisect_right(policy_G, k)) for k in range(num_policies)]


def behaviour(s: Session, batch: Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Behaviour log-probs and per-row caps for the truncated importance weights: the bf16 sampler's
    (algo.sampler_is_cap) on fresh rows, the stored sampler's (algo.replay.is_cap) on replayed rows."""
    cfg, rollout = s.cfg.algo, batch.rollout
    # a backend without sampler log-probs (generate, where the built-in engine does not support the model) samples
    # in the model's dtype: nothing to correct on the fresh rows (replay, which needs them, is refused there)
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


def store_groups(s: Session, batch: Batch, advantages, mask_BT, replay: ReplayBuffer, step: int) -> int:
    G = s.cfg.rollout.num_generations
    stored = 0
    for g in range(len(batch.groups)):
        rows = list(range(g * G, (g + 1) * G))
        # the buffer holds its groups on the host: device memory stays the step's
        group = StoredGroup(select_rows(batch.rollout, rows).to(torch.device("cpu")), advantages[rows].cpu(),
                            mask_BT[rows].cpu(), step + 1)
        stored += replay.add(group)
    return stored


def grpo_step(s: Session, step: int, replay: ReplayBuffer | None = None) -> tuple[dict, list[dict]]:
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
        # each row's policy; replayed rows are the run's only policy's (the config refuses replay with several)
        policy_B = torch.cat([row_policies([g.slot for g in batch.groups], cfg.rollout.num_generations),
                              torch.zeros(rollout.num_completions - batch.num_fresh, dtype=torch.long)]).to(s.device)
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
    parts = _policy_batches(batch, len(s.policies))
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
    if replay is not None:
        metrics |= {"replay_groups": len(batch.replayed), "replay_stored": stored, "replay_buffer": len(replay)}
    if batch.scores.errors:
        metrics["reward_errors"] = batch.scores.errors[:5]
    return metrics, sample_rows(s, batch, advantages, step)


def _phases(s: Session) -> tuple[bool, bool]:
    """(need_ref, need_old): whether the step computes the reference log-probs (a policy has a KL term) and the
    old policy's (several updates per batch, or a KL penalty in the reward)."""
    need_ref = max(p.beta for p in s.policies) > 0
    return need_ref, s.cfg.algo.num_iterations > 1 or (s.algo.kl_in_reward and need_ref)


def _policy_batches(batch: Batch, num_policies: int) -> list[Batch]:
    """Each policy's part of a step's batch: its fresh groups (several policies do not replay; a run's only
    policy's part is the batch, whose metrics are over its fresh groups too)."""
    if num_policies == 1:
        return [batch]
    G = batch.num_fresh // len(batch.groups)
    parts = []
    for k in range(num_policies):
        groups = [i for i, g in enumerate(batch.groups) if g.slot.policy == k]
        rows = [i * G + j for i in groups for j in range(G)]
        parts.append(Batch(select_rows(batch.rollout, rows), batch.scores.select(rows), batch.stats_rewards_P_S[groups],
                           [batch.groups[i] for i in groups]))
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
