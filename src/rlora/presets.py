"""Each algorithm's presets (the config values its paper uses) and traits (what it is, where code outside the
registry must know it), as data.

The config applies them after validation, to the keys the user did not set (config file or override), so
`algo.name=dapo algo.clip_high=0.3` keeps 0.3; `rlora train --print-config` shows the resolved values. A value
is a constant, a function of the config (for values that depend on other keys), or a dict: a whole section,
validated by its own class ({} for its defaults). This module sits below both the config and the algorithm
registry (algos/registry.py), so neither imports the other; a test checks that they name the same algorithms.
The registry builds each Algorithm's flags from TRAITS, and the refused combinations (config/refusals.py) read
them here: the two cannot disagree, and no name is compared outside this module and the registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _dapo_buffer(cfg) -> int:
    # DAPO: 4096 of 20480 tokens (20 %) are the soft-punishment buffer
    return max(1, cfg.rollout.max_new_tokens // 5)


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"algo.adv_scale": "none", "algo.loss_agg": "constant"},
    "dapo": {"algo.clip_low": 0.2, "algo.clip_high": 0.28, "algo.loss_agg": "token_mean",
             "algo.dynamic_sampling": True, "algo.overlong_buffer": _dapo_buffer},
    "gspo": {"algo.clip_low": 3e-4, "algo.clip_high": 4e-4, "algo.loss_agg": "seq_mean"},
    "cispo": {"algo.clip_low": 1.0, "algo.clip_high": 0.2, "algo.loss_agg": "token_mean"},
    "rloo": {"algo.adv_scale": "none"},
    "reinforce_pp": {"algo.beta": 0.01},
    "reinforce_pp_baseline": {"algo.beta": 0.01},
    # the `ppo:` section with its defaults (gamma 1, lam 0.95, value_clip 0.2, KL in the reward)
    "ppo": {"algo.beta": 0.05, "ppo": {}},
    "adaptive_grpo": {"algo.adaptive.enabled": True},
}
ALGORITHM_NAMES = tuple(PRESETS)


@dataclass(frozen=True)
class Traits:
    """An algorithm's capability flags: what the step and the refused combinations need to know about it."""

    critic: bool = False  # a value adapter + head beside the policy gives its advantages (GAE, train/ppo_step.py)
    kl_in_reward: bool = False  # the KL to the reference enters the token reward, not the loss (REINFORCE++)
    # advantages whitened over the whole batch (every rank), whatever algo.adv_scale: no group statistics
    batch_statistics: bool = False
    sequence_ratio: bool = False  # one importance ratio per sequence, clipped per sequence: a loss per sequence


TRAITS: dict[str, Traits] = {
    "grpo": Traits(),
    "dr_grpo": Traits(),
    "dapo": Traits(),
    "gspo": Traits(sequence_ratio=True),
    "cispo": Traits(),
    "rloo": Traits(),
    "reinforce_pp": Traits(kl_in_reward=True, batch_statistics=True),
    "reinforce_pp_baseline": Traits(kl_in_reward=True, batch_statistics=True),  # the group mean, then the batch std
    # ppo.kl_mode decides where ppo's KL goes (the reward by default; train/ppo_step.py), and ppo.whiten_advantages
    # whether its advantages take batch statistics: the rows that refuse ppo's combinations read `critic`
    # kl_in_reward: the default ppo.kl_mode=reward; ppo_step sets it from ppo.kl_mode for the run (loss: False)
    "ppo": Traits(critic=True, kl_in_reward=True),
    "adaptive_grpo": Traits(),
}
