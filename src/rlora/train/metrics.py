"""One metrics row from every data-parallel rank's, each metric by its own typed reduction.

A rank reports statistics of its share of the batch; joining them needs to know what each one is. Counts add
up; times take the slowest rank and maxima the largest; a mean over rows (or groups, or valid rewards) is
weighted by that count, which the rank reports beside it, so ranks holding different numbers of groups
(dynamic sampling, a rank without groups) join to the mean over the whole batch; a standard deviation is
pooled from the ranks' counts, means and deviations. The update's metrics, and PPO's explained_variance, are
computed from sums all-reduced before dividing (train/update.py, algos/gae.py), so they are already equal on
every rank: averaging keeps them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Sum:
    """Adds up over ranks (counts)."""


@dataclass(frozen=True)
class Max:
    """The largest rank's value (times: the slowest rank; maxima)."""


@dataclass(frozen=True)
class Mean:
    """A mean over the `count` metric's items, weighted by each rank's count."""

    count: str


@dataclass(frozen=True)
class PooledStd:
    """A sample standard deviation over the `count` metric's items whose mean is the `mean` metric."""

    mean: str
    count: str


Reduction = Sum | Max | Mean | PooledStd

_COUNTS = ("rows", "groups", "reward_count", "reward_count_sampled", "value_tokens", "gen_tokens", "prompt_tokens", "groups_sampled", "groups_dropped",
           "resamples", "rescued_groups", "reward_failures", "replay_groups", "replay_stored", "replay_buffer", "episodes")
REDUCTIONS: dict[str, Reduction] = {
    **{key: Sum() for key in _COUNTS},
    "reward_mean": Mean("reward_count"),
    "reward_std": PooledStd("reward_mean", "reward_count"),
    "completion_len_mean": Mean("rows"),
    "truncated_frac": Mean("rows"),
    "overlong_penalty_mean": Mean("rows"),
    "frac_groups_zero_std": Mean("groups"),
    "frac_zero_var_first": Mean("groups_sampled"),
    "frac_zero_var_after_resample": Mean("groups_sampled"),
    "reward_mean_sampled": Mean("reward_count_sampled"),
    "value_mean": Mean("value_tokens"), "return_mean": Mean("value_tokens"), "advantage_mean": Mean("value_tokens"),
    "gpu_peak_gb": Max(),
    # each rank draws its own extra rounds (dynamic sampling): the step took as many as the rank that drew most
    "sampling_rounds": Max(),
}


def reduction_of(key: str) -> Reduction | None:
    """The key's reduction; None: averaged unweighted (values equal on every rank, e.g. the update's)."""
    if key in REDUCTIONS:
        return REDUCTIONS[key]
    if key.startswith("reward/"):  # one reward function's mean over the rows it scored
        return Mean("reward_count/" + key.removeprefix("reward/"))
    if key.startswith("reward_count/"):
        return Sum()
    if key.startswith("episode/"):  # a mean or share over the rank's sampled episodes (train/sources.py)
        return Mean("episodes")
    if key.endswith("_s") or key.endswith("_max"):
        return Max()
    return None


def merge_metrics(per_rank: list[dict]) -> dict:
    """One metrics row from every rank's (keys of any rank; a rank that trained nothing lacks some). A dict
    value (several policies' metrics, by name) is merged key by key the same way, over the ranks that have it."""
    merged = {}
    for m in per_rank:
        merged |= {k: v for k, v in m.items() if k not in merged or merged[k] is None}
    for key in list(merged):
        if isinstance(merged[key], dict):
            names = dict.fromkeys(name for m in per_rank for name in (m.get(key) or {}))  # in rank order
            merged[key] = {name: merge_metrics([m[key][name] for m in per_rank if name in (m.get(key) or {})])
                           for name in names}
            continue
        present = [m for m in per_rank if m.get(key) is not None]
        if key.startswith("episode/"):  # a rank with episodes but without this counter counted 0 of it
            present = [m if m.get(key) is not None else {**m, key: 0.0} for m in per_rank if m.get("episodes")]
        values = [m[key] for m in present]
        if key == "step" or not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        merged[key] = _reduce(reduction_of(key), key, present)
    return merged


def _reduce(how: Reduction | None, key: str, present: list[dict]) -> float:
    values = [m[key] for m in present]
    if isinstance(how, Sum):
        return sum(values)
    if isinstance(how, Max):
        return max(values)
    if isinstance(how, Mean):
        weights = [m.get(how.count) or 0 for m in present]
        return sum(w * v for w, v in zip(weights, values)) / sum(weights) if sum(weights) else sum(values) / len(values)
    if isinstance(how, PooledStd):
        return _pooled_std(present, key, how)
    return sum(values) / len(values)


def _pooled_std(present: list[dict], key: str, how: PooledStd) -> float:
    """sqrt((sum_r (n_r - 1) s_r^2 + sum_r n_r (m_r - m)^2) / (N - 1)): the sample deviation of all the items."""
    parts = [(m.get(how.count) or 0, m.get(how.mean), m[key]) for m in present]
    parts = [(n, mean, std) for n, mean, std in parts if n and mean is not None]
    total = sum(n for n, _, _ in parts)
    if total < 2:
        return 0.0
    mean = sum(n * m for n, m, _ in parts) / total
    squares = sum((n - 1) * s * s + n * (m - mean) ** 2 for n, m, s in parts)
    return math.sqrt(max(squares, 0.0) / (total - 1))
