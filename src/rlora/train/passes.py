"""The log-prob passes of a step over its rollout before the update: the frozen lower layers once (where two passes
share them), the reference (adapter off) and the old policy's. On a sharded base (train.fsdp) each phase adds passes
until it has made as many as the busiest rank's (train/fsdp.py PassPadding): ranks may hold different numbers of
rows (dynamic sampling, replay), and a rank without rows makes every phase's passes with a row it dropped."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlora.models.frozen_prefix import FrozenPrefix, frozen_prefix, prefix_fits
from rlora.train.fsdp import pass_padding, ranks_agree
from rlora.train.session import Session
from rlora.train.update import batched_logprobs
from rlora.types import Rollout


@dataclass
class LogprobPasses:
    prefix: FrozenPrefix | None  # the frozen lower layers' output for every row (None: not computed)
    ref_logp_BTc: torch.Tensor | None  # the base's (adapter off), where a policy has a KL term
    old_logp_BTc: torch.Tensor | None  # the policy's before the update, where the update needs them
    prefix_s: float
    ref_s: float
    old_s: float


def logprob_passes(s: Session, rollout: Rollout, policy_B: torch.Tensor | None, need_ref: bool, need_old: bool,
                   update_shares_prefix: bool = False) -> LogprobPasses:
    """The rollout's frozen prefix, reference and old log-probs, each where asked (policy_B: each row's policy,
    for the old log-probs of several). The prefix is computed where two passes share it: the reference and the
    old ones, or the update's own (update_shares_prefix: PPO's values and policy). Every rank calls it with the
    same arguments but the rollout."""
    mb, chunk = s.cfg.train.micro_batch_size, s.cfg.train.logprob_chunk_tokens
    padding = pass_padding(s.world, s.model, rollout, mb)
    t0 = time.perf_counter()
    prefix = None
    # the frozen lower layers pay off once two passes share them (a lone policy pass skips zero-advantage rows);
    # every rank takes the prefix or none does, so that their passes pair up on a sharded base
    wanted = s.num_frozen and (need_ref or need_old or update_shares_prefix)
    if wanted and ranks_agree(s.world, s.model, prefix_fits(s.model, rollout)):
        prefix = frozen_prefix(s.model, rollout, s.num_frozen, mb)
        padding.prefix_passes(s.model, s.num_frozen)
    t_prefix = time.perf_counter()
    ref_logp = None
    if need_ref:
        with s.adapter.disabled():
            ref_logp = batched_logprobs(s.model, rollout, mb, chunk, prefix)
            padding.logprob_passes(s.model, chunk, prefix)
    t_ref = time.perf_counter()
    old_logp = None
    if need_old:
        old_logp = batched_logprobs(s.model, rollout, mb, chunk, prefix, policy_B)
        padding.logprob_passes(s.model, chunk, prefix)
    return LogprobPasses(prefix, ref_logp, old_logp, t_prefix - t0, t_ref - t_prefix, time.perf_counter() - t_ref)
