"""Experience replay: keep groups with informative advantages and mix them into later steps.

A replayed group was drawn by an older policy. Its tokens' behaviour log-probs (the sampler's, stored
with it) give the truncated importance weight min(pi_old / pi_behaviour, cap) that multiplies its
surrogate, where pi_old is the policy at the start of the step that replays it; its advantages are the
ones computed when it was sampled (its rewards do not change), one per token as the update takes them (so
per-token advantages, REINFORCE++'s, replay as per-completion ones do).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from rlora.config import ReplayConfig
from rlora.types import Rollout


@dataclass
class StoredGroup:
    rollout: Rollout  # G rows, with sampling_logp_BTc (the behaviour log-probs)
    advantages_GT: torch.Tensor  # one per token, as the loss mask
    loss_mask_GT: torch.Tensor
    step: int  # 1-based step it was sampled in
    uses: int = 0
    policy: int = 0  # the policy that sampled it (its buffer's)


class ReplayBuffer:
    """One rank's buffer of one policy's groups (data parallel: each rank stores and replays its own groups, drawing
    with its own stream; rank 0's is the one-process stream. Several policies: each has its own, seeded by its seed,
    as in a run of it alone: replay_buffers)."""

    def __init__(self, cfg: ReplayConfig, seed: int, rank: int = 0):
        self.cfg = cfg
        self.seed = seed
        self.rank = rank
        self.groups: deque[StoredGroup] = deque()

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, group: StoredGroup) -> bool:
        """Store the group if it is informative (some |advantage| above min_adv_abs, some token in the loss); the oldest leave beyond capacity. -> stored?"""
        if group.rollout.sampling_logp_BTc is None:
            raise ValueError("replay needs the sampler's log-probs: this rollout has none")
        if float(group.advantages_GT.abs().max()) <= self.cfg.min_adv_abs or not bool(group.loss_mask_GT.any()):
            return False
        self.groups.append(group)
        while len(self.groups) > self.cfg.capacity:
            self.groups.popleft()
        return True

    def draw(self, num_groups: int, step: int) -> list[StoredGroup]:
        """Up to num_groups stored groups, uniformly at random (seeded by step); each use is counted and a
        group leaves after cfg.max_uses."""
        if num_groups <= 0 or not self.groups:
            return []
        rng = random.Random(self.seed * 7_919 + step + self.rank * 1_000_003)
        picked = rng.sample(list(self.groups), min(num_groups, len(self.groups)))
        for group in picked:
            group.uses += 1
        self.groups = deque(g for g in self.groups if g.uses < self.cfg.max_uses)
        return picked


def replay_buffers(cfg: ReplayConfig, seeds: list[int], rank: int = 0) -> list[ReplayBuffer]:
    """Each policy's buffer, by policy index, seeded by the policy's seed."""
    return [ReplayBuffer(cfg, seed, rank) for seed in seeds]
