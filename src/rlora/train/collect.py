"""The groups of one step: sample, resample groups that fail (adaptive GRPO), drop groups whose rewards are
all equal and sample more prompts (DAPO's dynamic sampling).

A group is the G completions of one prompt drawn with one setting, named by its slot (train/slots.py). All
sampling goes through a `SampleFn` (slots, settings per slot, seed -> rollout and scores), so this logic is
tested with a scripted sampler (which names its groups by plain ints: nothing here looks inside a slot).
Retried groups are drawn at the schedule's temperature/top-p; each row keeps the temperature it was drawn at
(Rollout.temperature_B), and the trainer's old and new log-probs of that row use the same temperature, so the
ratio compares like with like.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Callable

import torch

from rlora.algos.advantages import group_flags, overlong_penalty
from rlora.config import AdaptiveConfig, AlgoConfig
from rlora.rewards.scoring import Scores
from rlora.batching import concat_rollouts, select_rows
from rlora.train.slots import Slot
from rlora.types import Rollout, SamplingParams

SampleFn = Callable[[list[Slot], list[SamplingParams], int], tuple[Rollout, Scores]]


@dataclass
class Group:
    slot: Slot  # which policy drew which prompt of the step: what the SampleFn takes
    rollout: Rollout  # the kept attempt's G rows
    scores: Scores  # its rewards (task rewards: what the adaptive and dynamic-sampling conditions look at)
    shaping_G: torch.Tensor  # overlong penalty of each row (float64; 0 when off)
    attempt_rewards: list[torch.Tensor] = field(default_factory=list)  # shaped rewards of every attempt, in order
    retries: int = 0
    failed_first: bool = False  # the first attempt failed the adaptive condition
    first_total_B: torch.Tensor | None = None  # the first attempt's task rewards (None: the kept attempt is it)

    @property
    def first_scores_B(self) -> torch.Tensor:
        return self.scores.total_B if self.first_total_B is None else self.first_total_B

    @property
    def rewards_G(self) -> torch.Tensor:
        """Rewards the advantages use: task rewards plus the overlong shaping (NaN where a reward failed)."""
        return self.scores.total_B + self.shaping_G


def is_flat(rewards_G: torch.Tensor) -> bool:
    """All valid rewards equal (or fewer than two valid): the group gives no GRPO gradient."""
    return bool(group_flags(rewards_G[None])[1])


def fails(rewards_G: torch.Tensor, cfg: AdaptiveConfig) -> bool:
    valid = rewards_G[~torch.isnan(rewards_G)]
    no_success = not bool((valid >= cfg.success_reward).any())
    if cfg.condition == "no_success":
        return no_success
    if cfg.condition == "zero_variance":
        return is_flat(rewards_G)
    return no_success or is_flat(rewards_G)


@dataclass
class CollectStats:
    sampling_rounds: int = 0
    groups_sampled: int = 0  # groups drawn at their first attempt (all rounds)
    groups_dropped: int = 0  # dynamic sampling: zero-variance groups left out
    resamples: int = 0  # adaptive: group resamples
    rescued: int = 0  # adaptive: groups that failed at first and pass after resampling
    zero_var_before: int = 0  # groups with all-equal rewards at their first attempt
    zero_var_after: int = 0  # ... after adaptive resampling (before dynamic filtering)
    first_reward_sum: float = 0.0  # valid task rewards of every group's first attempt (reward_mean_sampled)
    first_reward_count: int = 0

    def add_round(self, groups: list["Group"], adaptive: AdaptiveConfig) -> None:
        """Count one sampling round's groups: by their first attempt, then by the attempt kept after adaptive
        resampling (each retry of a group is one resample)."""
        self.sampling_rounds += 1
        self.groups_sampled += len(groups)
        self.zero_var_before += sum(is_flat(g.first_scores_B) for g in groups)
        for g in groups:
            valid = g.first_scores_B[~torch.isnan(g.first_scores_B)]
            self.first_reward_sum += float(valid.sum())
            self.first_reward_count += len(valid)
        self.zero_var_after += sum(is_flat(g.scores.total_B) for g in groups)
        if adaptive.enabled:
            self.resamples += sum(g.retries for g in groups)
            self.rescued += sum(g.failed_first and not fails(g.scores.total_B, adaptive) for g in groups)


class Collector:
    """Collects the groups of one step. `seed` is the step's seed; round r, retry k draw with their own.
    owner(slot): whose groups a slot's are (a run of several policies: each policy's resampling budget, dynamic
    sampling's quota of kept groups and sampling statistics are its own, as in a run of that policy alone); one owner
    by default."""

    def __init__(self, sample: SampleFn, base: SamplingParams, G: int, algo: AlgoConfig, seed: int,
                 owner: Callable[[Slot], Hashable] = lambda slot: 0):
        self.sample, self.base, self.G, self.algo, self.seed, self.owner = sample, base, G, algo, seed, owner
        self.stats = CollectStats()  # the step's: every owner's groups, each round counted once
        self.owner_stats: dict[Hashable, CollectStats] = collections.defaultdict(CollectStats)  # each owner's own
        # the first row of the first group dropped: a rank that keeps no group makes its passes through a sharded base
        # (train/fsdp.py PassPadding) with it
        self.dropped_row: Rollout | None = None
        budget = algo.adaptive.step_budget if algo.adaptive.step_budget is not None else math.inf
        self.budget: dict[Hashable, float] = collections.defaultdict(lambda: budget)

    def _seed(self, round_index: int, retry: int) -> int:
        # round 0, retry 0 keeps the step's seed (a run without resampling draws exactly as before)
        return self.seed + 1_000_003 * (round_index * 64 + retry)

    def _draw(self, slots: list[Slot], params: SamplingParams, seed: int) -> list[Group]:
        rollout, scores = self.sample(slots, [params] * len(slots), seed)
        lengths_B = rollout.completion_mask_BTc.sum(-1).cpu()  # rewards and what they decide live on the host
        shaping_B = overlong_penalty(lengths_B, params.max_new_tokens, self.algo.overlong_buffer, self.algo.overlong_penalty)
        groups = []
        for i, slot in enumerate(slots):
            rows = list(range(i * self.G, (i + 1) * self.G))
            group = Group(slot, select_rows(rollout, rows), scores.select(rows), shaping_B[rows])
            group.attempt_rewards.append(group.rewards_G)
            groups.append(group)
        return groups

    def _resample_failing(self, groups: list[Group], round_index: int) -> None:
        cfg = self.algo.adaptive
        for group in groups:
            group.failed_first = fails(group.scores.total_B, cfg)
        for retry in range(1, cfg.max_retries + 1):
            failing = self._within_budget([g for g in groups if fails(g.scores.total_B, cfg)])
            if not failing:
                return
            setting = cfg.schedule[min(retry, len(cfg.schedule)) - 1]
            params = dataclasses.replace(self.base, temperature=setting.temperature, top_p=setting.top_p)
            fresh = self._draw([g.slot for g in failing], params, self._seed(round_index, retry))
            for group, new in zip(failing, fresh):
                # the newest attempt is kept: a group stops being resampled once it passes
                if group.first_total_B is None:
                    group.first_total_B = group.scores.total_B
                group.rollout, group.scores, group.shaping_G = new.rollout, new.scores, new.shaping_G
                group.attempt_rewards.append(new.rewards_G)
                group.retries += 1
                self.budget[self.owner(group.slot)] -= 1

    def _within_budget(self, failing: list[Group]) -> list[Group]:
        """The failing groups each owner's remaining budget allows: its first ones, in order."""
        taken: collections.Counter = collections.Counter()
        within = []
        for group in failing:
            owner = self.owner(group.slot)
            if taken[owner] < self.budget[owner]:
                taken[owner] += 1
                within.append(group)
        return within

    def _by_owner(self, groups: list[Group]) -> dict[Hashable, list[Group]]:
        """The groups of each owner, in order (owners in the order of their first group)."""
        owned: dict[Hashable, list[Group]] = {}
        for group in groups:
            owned.setdefault(self.owner(group.slot), []).append(group)
        return owned

    def _round(self, slots: list[Slot], round_index: int) -> list[Group]:
        groups = self._draw(slots, self.base, self._seed(round_index, 0))
        if self.algo.adaptive.enabled:
            self._resample_failing(groups, round_index)
        self.stats.add_round(groups, self.algo.adaptive)
        for owner, owned in self._by_owner(groups).items():
            self.owner_stats[owner].add_round(owned, self.algo.adaptive)
        return groups

    def collect(self, slots: list[Slot], more_slots: Callable[[int], list[Slot]]) -> list[Group]:
        """Groups for the step. With dynamic sampling, zero-variance groups are dropped and round r = 1, 2, ...
        samples the slots of `more_slots(r)` whose owners have kept fewer groups than they had slots, until every
        owner has (each keeps its first ones) or algo.max_extra_rounds is spent; then the step trains on the groups
        it has (possibly fewer, possibly none). The groups come owner by owner, each owner's in the order drawn."""
        groups = self._round(slots, 0)
        if not self.algo.dynamic_sampling:
            return groups
        wanted = collections.Counter(self.owner(slot) for slot in slots)
        kept = self._keep_informative(groups)
        for round_index in range(1, self.algo.max_extra_rounds + 1):
            have = collections.Counter(self.owner(g.slot) for g in kept)
            short = {owner for owner in wanted if have[owner] < wanted[owner]}
            if not short:
                break
            more = [slot for slot in more_slots(round_index) if self.owner(slot) in short]
            if not more:  # this rank's share of the round is empty (fewer extra prompts than ranks): the next one
                continue
            kept += self._keep_informative(self._round(more, round_index))
        owned = self._by_owner(kept)
        return [g for owner in wanted for g in owned.get(owner, [])[:wanted[owner]]]

    def _keep_informative(self, groups: list[Group]) -> list[Group]:
        flat = [is_flat(g.scores.total_B) for g in groups]
        dropped = [g for g, is_dropped in zip(groups, flat) if is_dropped]
        self.stats.groups_dropped += len(dropped)
        for group in dropped:
            self.owner_stats[self.owner(group.slot)].groups_dropped += 1
        if self.dropped_row is None and dropped:
            self.dropped_row = select_rows(dropped[0].rollout, [0])
        return [g for g, is_dropped in zip(groups, flat) if not is_dropped]


def assemble(groups: list[Group], pad_id: int, adv_stats: str) -> tuple[Rollout, Scores, torch.Tensor]:
    """-> (rollout of all kept rows, their scores, rewards for the advantage statistics [P, S]). Columns
    0..G-1 of the statistics are the kept rows' rewards; with adv_stats="all" the other attempts' rewards
    follow (NaN-padded), so the group mean/std are taken over every sample drawn for the prompt."""
    rollout = concat_rollouts([g.rollout for g in groups], pad_id)
    scores = Scores.concat([g.scores for g in groups])
    kept = [g.rewards_G for g in groups]
    if adv_stats == "kept":
        return rollout, scores, torch.stack(kept)
    others = [torch.cat(g.attempt_rewards[:-1]) if len(g.attempt_rewards) > 1 else kept[0][:0] for g in groups]
    width = max(len(k) + len(o) for k, o in zip(kept, others))
    rows = [torch.cat([k, o, torch.full((width - len(k) - len(o),), math.nan, dtype=k.dtype)]) for k, o in zip(kept, others)]
    return rollout, scores, torch.stack(rows)
