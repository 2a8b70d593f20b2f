import math

import pytest
import torch

from rlora.algos.advantages import group_advantages


def naive_advantages(rewards, scale, eps):
    """Per-element Python loops, the definition written out."""
    flat = [r for group in rewards for r in group]
    def mean(xs): return sum(xs) / len(xs)
    def std(xs):
        m = mean(xs)
        return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    out = []
    for group in rewards:
        m = mean(group)
        denom = {"group": std(group) + eps, "batch": std(flat) + eps, "none": 1.0}[scale]
        out.append([(r - m) / denom for r in group])
    return out


def test_group_scale_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std = sqrt((4 * 0.25) / 3) = 0.57735
    # advantages = +-0.5 / (0.57735 + 1e-4) = +-0.86588
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), "group", eps=1e-4)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    assert torch.allclose(adv, torch.tensor([[expected, -expected, -expected, expected]]), atol=1e-6)


def test_none_scale_is_mean_centred_only():
    # group [3, 1]: mean 2 -> [1, -1]; group [0, 0, ...] -> zeros (no gradient)
    adv = group_advantages(torch.tensor([[3.0, 1.0], [0.0, 0.0]]), "none")
    assert adv.tolist() == [[1.0, -1.0], [0.0, 0.0]]


def test_batch_scale_hand_computed():
    # rewards [[1, 0], [2, 2]]: group means 0.5 and 2 -> centred [[0.5, -0.5], [0, 0]]
    # batch std of [1, 0, 2, 2]: mean 1.25, squares 0.0625+1.5625+0.5625+0.5625 = 2.75, /3 -> sqrt(0.91667)=0.957427
    adv = group_advantages(torch.tensor([[1.0, 0.0], [2.0, 2.0]]), "batch", eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.5 / 0.957427, -0.5 / 0.957427], [0.0, 0.0]]), atol=1e-6)


def test_zero_variance_group_gives_exactly_zero_advantage_in_every_mode():
    # 0.3 * 6 and 0.7 * 7 are not exact in float32 sums: the mean would differ from 0.3 / 0.7 by rounding
    for scale in ("group", "batch", "none"):
        adv = group_advantages(torch.tensor([[0.7] * 7, [1.0, 0.0, 0.5, 0.2, 0.1, 0.9, 0.4]]), scale)
        assert torch.all(adv[0] == 0) and torch.all(adv[1] != 0), scale
        adv = group_advantages(torch.tensor([[0.3] * 6]), scale)
        assert torch.all(adv == 0), scale


def test_failed_samples_are_left_out_of_the_statistics():
    # [1, 0, NaN, NaN]: valid mean 0.5, unbiased std of [1, 0] = sqrt(0.5) = 0.707107
    # -> [0.5 / 0.707207, -0.5 / 0.707207, 0, 0] with eps 1e-4
    nan = float("nan")
    adv = group_advantages(torch.tensor([[1.0, 0.0, nan, nan]]), "group", eps=1e-4)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert torch.allclose(adv, torch.tensor([[a, -a, 0.0, 0.0]]), atol=1e-6)
    # a group with one valid sample has no spread: all zero; a group with none: all zero
    assert torch.all(group_advantages(torch.tensor([[1.0, nan], [nan, nan]]), "group") == 0)


def test_matches_naive_loop_on_random_rewards():
    torch.manual_seed(1)
    rewards = torch.rand(5, 6)
    for scale in ("group", "batch", "none"):
        got = group_advantages(rewards, scale, eps=1e-4)
        want = torch.tensor(naive_advantages(rewards.tolist(), scale, 1e-4))
        assert torch.allclose(got, want, atol=1e-6), scale


def _on_two_ranks(run, inputs):
    """run(input, all_sum) on two threads standing for two data-parallel ranks: all_sum adds both ranks' values
    (each call is a rendezvous, as an all-reduce is). -> both results."""
    import threading

    barrier, sent, results = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int) -> None:
        def all_sum(values):
            sent[r] = list(values)
            barrier.wait()
            total = [a + b for a, b in zip(*sent)]
            barrier.wait()
            return total
        results[r] = run(inputs[r], all_sum)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_batch_std_is_the_unbiased_std_of_the_valid_entries():
    from rlora.algos.advantages import batch_std

    values = torch.tensor([[1.0, float("nan"), 3.0], [0.5, 4.0, float("nan")], [2.5, -1.0, 0.0]], dtype=torch.float64)
    valid = values[~torch.isnan(values)]
    assert batch_std(values) == pytest.approx(float(valid.std()), rel=1e-15)
    assert batch_std(torch.tensor([[2.0, float("nan")]], dtype=torch.float64)) == 0.0  # one valid entry
    # two ranks with a third and two thirds of the batch: both get the whole batch's std
    stds = _on_two_ranks(batch_std, [values[:1], values[1:]])
    assert stds == pytest.approx([float(valid.std())] * 2, rel=1e-12)


def test_whiten_over_two_ranks_equals_whitening_the_whole_batch():
    from rlora.algos.advantages import whiten

    g = torch.Generator().manual_seed(0)
    values_BT = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask_BT = (torch.rand(5, 7, generator=g) > 0.3).long()
    whole = whiten(values_BT, mask_BT, eps=1e-4)
    parts = _on_two_ranks(lambda rows, all_sum: whiten(values_BT[rows], mask_BT[rows], 1e-4, all_sum=all_sum),
                          [slice(0, 2), slice(2, 5)])
    assert torch.allclose(torch.cat(parts), whole, rtol=0, atol=1e-6)
    alone = whiten(values_BT[:2], mask_BT[:2], eps=1e-4)  # the first rank's rows by their own statistics differ
    assert not torch.allclose(alone, whole[:2], atol=1e-3)

