"""A step's batch: its prompts' slots sampled and scored (through the run's rollout source), failing groups resampled
(adaptive GRPO), flat groups dropped and more prompts sampled (dynamic sampling), stored groups replayed; every
policy's groups, each as a run of that policy alone draws them (train/slots.py, train/collect.py)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from rlora.batching import concat_rollouts
from rlora.data.prompts import PromptOrder
from rlora.errors import UserError
from rlora.rewards.scoring import Scores
from rlora.train.collect import CollectStats, Collector, Group, assemble
from rlora.train.replay import ReplayBuffer, StoredGroup
from rlora.train.schedules import progress_of, scheduled_value
from rlora.train.session import Session
from rlora.train.slots import Slot, extra_round, first_round
from rlora.types import Rollout, SamplingParams


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
    path: one seed for all prompts, no policies."""
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


def collect_batch(s: Session, step: int, replay: list[ReplayBuffer] | None, timings: Timings) -> Collected:
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
    replayed = []  # each policy's own, in policy order, as many as a run of it alone draws
    for policy, buffer in zip(s.policies, replay or []):
        expected = cfg.algo.replay.ratio * sum(g.slot.policy == policy.index for g in groups)
        replayed += buffer.draw(replay_count(expected, policy.seed, step, s.world.rank), step)
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
