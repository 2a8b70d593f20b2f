"""Metrics joined over data-parallel ranks with typed reductions equal the statistics of the whole batch."""

import statistics

import pytest

from rlora.train.metrics import Max, Mean, PooledStd, Sum, merge_metrics, reduction_of


def _rank_row(rewards: list[float], lengths: list[int], groups: int, zero_std_groups: int, rollout_s: float) -> dict:
    """What a rank logs for its share (the way train/step.py computes it)."""
    return {"step": 2, "rows": len(rewards), "groups": groups, "reward_count": len(rewards),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
            "completion_len_mean": statistics.fmean(lengths), "completion_len_max": max(lengths),
            "frac_groups_zero_std": zero_std_groups / groups, "gen_tokens": sum(lengths), "rollout_s": rollout_s,
            "loss": 0.25}


def test_uneven_ranks_join_to_the_whole_batchs_statistics():
    """Rank 0 kept 1 group of 2 samples, rank 1 kept 3 groups (dynamic sampling dropped the rest): each mean is
    the whole batch's, not the mean of the two ranks' means (0.5 and 0.833 would give 0.667, not 0.75)."""
    rewards = [[1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]]
    lengths = [[4, 8], [3, 5, 7, 9, 2, 2]]
    ranks = [_rank_row(rewards[0], lengths[0], 1, 0, 1.5), _rank_row(rewards[1], lengths[1], 3, 1, 2.5)]
    merged = merge_metrics(ranks)
    everything, all_lengths = rewards[0] + rewards[1], lengths[0] + lengths[1]
    assert merged["reward_mean"] == pytest.approx(statistics.fmean(everything), abs=1e-12)
    assert merged["reward_std"] == pytest.approx(statistics.stdev(everything), abs=1e-12)
    assert merged["completion_len_mean"] == pytest.approx(statistics.fmean(all_lengths), abs=1e-12)
    assert merged["frac_groups_zero_std"] == pytest.approx(1 / 4, abs=1e-12)
    assert (merged["rows"], merged["groups"], merged["reward_count"]) == (8, 4, 8)
    assert merged["gen_tokens"] == sum(all_lengths) and merged["completion_len_max"] == 9
    assert merged["rollout_s"] == 2.5 and merged["loss"] == 0.25 and merged["step"] == 2
    assert merged["reward_mean"] != pytest.approx(statistics.fmean([r["reward_mean"] for r in ranks]))


def test_a_reward_function_mean_is_over_the_rows_it_scored():
    """A function that applies to 1 of rank 0's 8 rows (value 1.0) and all 8 of rank 1's (0.0): 1/9, not 0.5."""
    ranks = [{"reward/f": 1.0, "reward_count/f": 1, "reward_count": 8},
             {"reward/f": 0.0, "reward_count/f": 8, "reward_count": 8}]
    merged = merge_metrics(ranks)
    assert merged["reward/f"] == pytest.approx(1 / 9) and merged["reward_count/f"] == 9


def test_a_rank_without_groups_does_not_weigh_in():
    row = _rank_row([0.0, 1.0, 1.0], [2, 3, 4], 1, 0, 1.0)
    empty = {"step": 2, "rows": 0, "groups": 0, "reward_count": 0, "reward_mean": None, "gen_tokens": 0, "rollout_s": 0.5}
    merged = merge_metrics([empty, row])
    assert merged["reward_mean"] == row["reward_mean"] and merged["reward_std"] == pytest.approx(row["reward_std"])
    assert merged["rows"] == 3 and merged["rollout_s"] == 1.0


def test_every_logged_statistic_has_the_reduction_it_needs():
    assert isinstance(reduction_of("gen_tokens"), Sum) and isinstance(reduction_of("step_s"), Max)
    assert reduction_of("reward_mean") == Mean("reward_count") and reduction_of("reward/gym") == Mean("reward_count/gym")
    assert isinstance(reduction_of("reward_count/gym"), Sum) and isinstance(reduction_of("gpu_peak_gb"), Max)
    assert reduction_of("reward_mean_sampled") == Mean("reward_count_sampled")
    assert reduction_of("value_mean") == Mean("value_tokens")
    assert reduction_of("reward_std") == PooledStd("reward_mean", "reward_count")
    assert reduction_of("completion_len_mean") == Mean("rows") and isinstance(reduction_of("completion_len_max"), Max)
    assert reduction_of("loss") is None  # all-reduced in the update: the same on every rank
    # rounds a step took (rank 0 drew one, rank 1 three): the most any rank drew, not a mean of 2 rounds
    assert merge_metrics([{"step": 1, "sampling_rounds": 1}, {"step": 1, "sampling_rounds": 3}])["sampling_rounds"] == 3


def test_episode_counters_a_rank_lacks_count_zero():
    """An environment counter only one rank's episodes reported (tool calls there, none elsewhere) is averaged over
    every rank's episodes: the other rank's count 0."""
    from rlora.train.metrics import merge_metrics

    merged = merge_metrics([{"episodes": 4, "episode/tool_calls_mean": 1.0, "episode/turns_mean": 2.0},
                            {"episodes": 12, "episode/turns_mean": 1.0}])
    assert merged["episodes"] == 16 and merged["episode/tool_calls_mean"] == 0.25
    assert merged["episode/turns_mean"] == (4 * 2.0 + 12 * 1.0) / 16
