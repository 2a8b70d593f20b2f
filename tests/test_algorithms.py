"""The algorithm family's math against hand-computed numbers and naive reference loops."""

import math

import pytest
import torch

from rlora.algos.advantages import (
    group_advantages, overlong_penalty, reinforce_pp_advantages, rloo_advantages, token_returns, whiten,
)
from rlora.algos.losses import (
    BatchTotals, LossInputs, aggregate, cispo_token_loss, grpo_token_loss, gspo_token_loss,
)
from rlora.algos.registry import ALGORITHMS
from rlora.config import load_config
from rlora.train.schedules import progress_of, scheduled_value
from rlora.train.update import importance_weight

NAN = math.nan


# ---------------------------------------------------------------- advantages

def naive_group(rewards, scale, eps=1e-4):
    """Per-group loop over Python floats: the reference for group_advantages."""
    out = []
    flat_all = [r for row in rewards for r in row if r == r]
    batch_mean = sum(flat_all) / len(flat_all)
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in flat_all) / (len(flat_all) - 1))
    for row in rewards:
        valid = [r for r in row if r == r]
        mean = sum(valid) / len(valid)
        std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1)) if len(valid) > 1 else 0.0
        denom = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        flat = len(valid) < 2 or max(valid) == min(valid)
        out.append([0.0 if (r != r or flat) else (r - mean) / denom for r in row])
    return out


def naive_rloo(rewards):
    out = []
    for row in rewards:
        valid = [r for r in row if r == r]
        flat = len(valid) < 2 or max(valid) == min(valid)
        out.append([0.0 if (r != r or flat) else r - (sum(valid) - r) / (len(valid) - 1) for r in row])
    return out


REWARDS = [[1.0, 0.0, 0.5, NAN], [0.2, 0.2, 0.2, 0.2], [3.0, NAN, NAN, NAN], [0.0, 1.0, 1.0, 2.0]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_naive_loop(scale):
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), scale=scale)
    assert torch.allclose(got.double(), torch.tensor(naive_group(REWARDS, scale), dtype=torch.float64), atol=1e-6)


def test_rloo_hand_computed():
    # [1, 0, 0, 1]: 1 - (1/3) = 0.666667, 0 - 2/3 = -0.666667
    got = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(got, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]), atol=1e-6)
    # it is G/(G-1) times the centred reward
    rewards = torch.tensor([[0.3, 0.9, 0.1, 0.5, 0.7]])
    assert torch.allclose(rloo_advantages(rewards), 5 / 4 * group_advantages(rewards, scale="none"), atol=1e-6)


def test_rloo_equals_naive_loop_with_failures_and_flat_groups():
    got = rloo_advantages(torch.tensor(REWARDS, dtype=torch.float64))
    assert torch.allclose(got.double(), torch.tensor(naive_rloo(REWARDS), dtype=torch.float64), atol=1e-6)
    assert got[1].abs().sum() == 0 and got[2].abs().sum() == 0  # all-equal group; a single valid sample


def test_token_returns_hand_computed():
    # one completion of 3 tokens, reward 1, kl [0.1, 0.2, 0.3], beta 0.5:
    # token rewards [-0.05, -0.1, -0.15 + 1] -> returns [0.7, 0.75, 0.85]; padding stays 0
    returns = token_returns(torch.tensor([1.0]), torch.tensor([[1, 1, 1, 0]]), torch.tensor([[0.1, 0.2, 0.3, 9.0]]), 0.5)
    assert torch.allclose(returns, torch.tensor([[0.7, 0.75, 0.85, 0.0]], dtype=torch.float64), atol=1e-12)
    # beta 0: every token's return is the outcome reward
    assert token_returns(torch.tensor([2.0]), torch.tensor([[1, 1, 0]]), None, 0.0).tolist() == [[2.0, 2.0, 0.0]]
    # an episode: policy tokens at 0-1 and 4-5, the environment's at 2-3 (mask 0), padding at 6: the outcome is on
    # the policy's last token (5), so every policy token's return holds it; kl [.1 .2 _ _ .3 .4], beta 0.5
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 7.0, 7.0, 0.3, 0.4, 9.0]])
    returns = token_returns(torch.tensor([1.0]), mask, kl, 0.5)
    # token rewards [-.05 -.1 0 0 -.15 (-.2 + 1)] summed from t to the end, times the mask
    expected = torch.tensor([[0.5, 0.55, 0.0, 0.0, 0.65, 0.8, 0.0]], dtype=torch.float64)
    assert torch.allclose(returns, expected, atol=1e-12)


def naive_reinforce_pp(rewards, masks, kls, beta, eps, group=None):
    if group:
        rewards = [r - sum(rewards[i - i % group:i - i % group + group]) / group for i, r in enumerate(rewards)]
    returns = []
    for r, mask, kl in zip(rewards, masks, kls):
        n = sum(mask)
        row = [r - beta * sum(kl[t:n]) if t < n else 0.0 for t in range(len(mask))]
        returns.append(row)
    values = [v for row, mask in zip(returns, masks) for v, m in zip(row, mask) if m]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    shift = 0.0 if group else mean  # the baseline variant divides by the std without re-centring
    return [[(v - shift) / (std + eps) if m else 0.0 for v, m in zip(row, mask)] for row, mask in zip(returns, masks)]


@pytest.mark.parametrize("group", [None, 2])
def test_reinforce_pp_equals_naive_loop(group):
    rewards = [1.0, 0.0, 0.5, 1.0]
    masks = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    kls = [[0.1, -0.2, 0.3, 0.0], [0.05, 0.0, 0.0, 0.0], [0.0, 0.1, 0.2, 0.4], [0.3, 0.3, 0.0, 0.0]]
    got = reinforce_pp_advantages(torch.tensor(rewards), torch.tensor(masks), torch.tensor(kls), 0.1, 1e-4, group_size=group)
    want = naive_reinforce_pp(rewards, masks, kls, 0.1, 1e-4, group)
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_reinforce_pp_baseline_gives_all_equal_groups_no_gradient():
    # group 0: both correct, different lengths; group 1: mixed. Without KL, group 0's advantages are exactly 0.
    masks = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    got = reinforce_pp_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0]), masks, None, 0.0, group_size=2)
    assert got[:2].abs().sum() == 0 and got[2:].abs().sum() > 0


def test_reinforce_pp_failed_sample_is_left_out():
    masks = torch.ones(3, 2)
    got = reinforce_pp_advantages(torch.tensor([1.0, NAN, 0.0]), masks, None, 0.0)
    assert got[1].abs().sum() == 0
    # the other two: returns [1, 1] and [0, 0] -> mean 0.5, unbiased std sqrt(1/3)
    assert torch.allclose(got[0], torch.full((2,), 0.5 / (math.sqrt(1 / 3) + 1e-4)), atol=1e-6)


def test_whiten_single_token_batch_is_zero():
    assert whiten(torch.tensor([[3.0]]), torch.tensor([[1.0]]), 1e-4).tolist() == [[0.0]]


def test_overlong_penalty_hand_computed():
    # limit 10, buffer 4: free up to 6 tokens, then -0.25 per token down to -1 at 10
    got = overlong_penalty(torch.tensor([5, 6, 7, 8, 10]), max_len=10, buffer=4, penalty=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([10]), 10, 0).tolist() == [0.0]
    assert overlong_penalty(torch.tensor([9]), 10, 2, penalty=0.5).tolist() == [-0.25]


# ---------------------------------------------------------------- losses

def test_gspo_hand_computed_sequence_ratio_and_clipping():
    # seq 0: log-ratios [0.2, 0.4] -> s = exp(0.3) = 1.349859, A = +1, clip 0.2 -> min(1.3499, 1.2) -> loss -1.2
    # seq 1: log-ratios [0.2, 0.4, (padding 5.0)] -> same s, A = -1 -> -min(-1.3499, -1.2) = 1.349859, unclipped
    logp = torch.tensor([[0.2, 0.4, 0.0], [0.2, 0.4, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    inp = LossInputs(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    out = gspo_token_loss(inp, 0.2, 0.2, 0.0)
    assert torch.allclose(out.loss_BT[:, :2], torch.tensor([[-1.2, -1.2], [1.349859, 1.349859]]), atol=1e-6)
    assert out.metrics_BT["clip_frac"][:, 0].tolist() == [True, False]
    assert torch.allclose(out.metrics_BT["ratio_mean"][:, 0], torch.tensor([1.349859, 1.349859]), atol=1e-6)


def test_gspo_gradient_is_sequence_ratio_over_length():
    # unclipped: loss_i = -s_i * A_i, ds/dlogp_t = s / |y|; with seq_mean aggregation over 1 sequence
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.1, -0.6]])  # log-ratio 0.1 on every token -> s = exp(0.1)
    inp = LossInputs(logp, old, torch.tensor([0.7]), torch.ones(1, 3))
    out = gspo_token_loss(inp, 0.5, 0.5, 0.0)
    aggregate(out.loss_BT, inp.mask_BT, "seq_mean", BatchTotals(3, 1, 3)).backward()
    s = math.exp(0.1)
    assert torch.allclose(logp.grad, torch.full((1, 3), -0.7 * s / 3), atol=1e-6)


def test_cispo_hand_computed_keeps_gradient_of_clipped_tokens():
    # token 0: ratio exp(0.5) = 1.6487 -> weight clipped to 1.2; A = 1, logp = -0.5 -> loss = -1.2 * (-0.5) = 0.6
    # token 1: ratio exp(-2) = 0.1353, clip_low 1.0 (no lower bound) -> weight 0.1353; loss = -0.1353 * (-1) = 0.1353
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 1.0]])
    inp = LossInputs(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
    out = cispo_token_loss(inp, clip_low=1.0, clip_high=0.2, beta=0.0)
    assert torch.allclose(out.loss_BT, torch.tensor([[0.6, math.exp(-2)]]), atol=1e-6)
    assert out.metrics_BT["clip_frac"].tolist() == [[True, False]]
    out.loss_BT.sum().backward()
    # d/dlogp = -sg(weight) * A: the clipped token still gets -1.2 (PPO-clip would give it 0)
    assert torch.allclose(logp.grad, torch.tensor([[-1.2, -math.exp(-2)]]), atol=1e-6)
    ppo_logp = logp.detach().clone().requires_grad_(True)
    grpo_token_loss(LossInputs(ppo_logp, old, torch.tensor([1.0]), torch.ones(1, 2)), 0.2, 0.2, 0.0).loss_BT.sum().backward()
    assert ppo_logp.grad[0, 0] == 0.0


def test_per_token_advantages_in_ppo_loss():
    # REINFORCE++ hands [B, T] advantages to the PPO-clip loss: at ratio 1 the loss is -A_t per token
    logp = torch.tensor([[-1.0, -2.0]])
    inp = LossInputs(logp, logp, torch.tensor([[0.5, -0.25]]), torch.ones(1, 2))
    assert torch.allclose(grpo_token_loss(inp, 0.2, 0.2, 0.0).loss_BT, torch.tensor([[-0.5, 0.25]]))


@pytest.mark.parametrize("loss_fn", [grpo_token_loss, gspo_token_loss, cispo_token_loss])
def test_extreme_ratios_and_empty_rows_stay_finite(loss_fn):
    # log-ratios of +-30 (ratio 1e13 / 1e-13), one fully masked (truncated and masked) row, a single-token row
    logp = torch.tensor([[30.0, -30.0], [0.5, 0.0], [-0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    inp = LossInputs(logp, torch.zeros(3, 2), torch.tensor([1.0, -1.0, 0.5]), mask)
    out = loss_fn(inp, 0.2, 0.28, 0.0)
    loss = aggregate(out.loss_BT, mask, "token_mean", BatchTotals(3, 2, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[1].abs().sum() == 0  # the masked row contributes nothing


def test_constant_aggregation_counts_masked_rows():
    # Dr.GRPO: 18 / (3 rows * 4), the third row fully masked (failed or truncated) still counts
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert aggregate(values, mask, "constant", BatchTotals(5, 2, 4, num_rows=3)).item() == pytest.approx(1.5)


def test_importance_weight_per_row_caps_and_unweighted_rows():
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    behaviour = torch.tensor([[-1.0, 0.5], [NAN, NAN]])
    w = importance_weight(old, behaviour, torch.tensor([2.0, 2.0]))
    assert torch.allclose(w, torch.tensor([[2.0, math.exp(-0.5)], [1.0, 1.0]]))


# ---------------------------------------------------------------- registry and presets

def test_every_algorithm_is_selectable_and_presets_yield_to_user_values():
    for name in ALGORITHMS:
        cfg = load_config(None, [f"algo.name={name}"])
        assert cfg.algo.name == name
    dapo = load_config(None, ["algo.name=dapo", "rollout.max_new_tokens=50"]).algo
    assert (dapo.clip_low, dapo.clip_high, dapo.loss_agg, dapo.dynamic_sampling, dapo.overlong_buffer) == \
        (0.2, 0.28, "token_mean", True, 10)
    assert load_config(None, ["algo.name=dapo", "algo.clip_high=0.3"]).algo.clip_high == 0.3
    dr = load_config(None, ["algo.name=dr_grpo"]).algo
    assert (dr.adv_scale, dr.loss_agg) == ("none", "constant")
    gspo = load_config(None, ["algo.name=gspo"]).algo
    assert (gspo.clip_low, gspo.clip_high, gspo.loss_agg) == (3e-4, 4e-4, "seq_mean")
    assert load_config(None, ["algo.name=adaptive_grpo"]).algo.adaptive.enabled
    assert not load_config(None, ["algo.name=adaptive_grpo", "algo.adaptive.enabled=false"]).algo.adaptive.enabled
    assert load_config(None, ["algo.name=reinforce_pp"]).algo.beta == 0.01
    cispo = load_config(None, ["algo.name=cispo", "algo.clip_high=2.0"]).algo
    assert (cispo.clip_low, cispo.clip_high, cispo.loss_agg) == (1.0, 2.0, "token_mean")
    assert load_config(None, ["algo.name=rloo", "algo.adv_scale=group"]).algo.adv_scale == "group"
    assert load_config(None, ["algo.name=rloo"]).algo.adv_scale == "none"
    assert load_config(None, ["algo.name=gspo", "algo.clip_low=0.001"]).algo.clip_low == 0.001


# ---------------------------------------------------------------- schedules

def test_temperature_schedules_hand_computed():
    assert scheduled_value("constant", 1.0, 0.5, 0.5) == 1.0
    assert scheduled_value("linear", 1.0, 0.5, 0.5) == 0.75
    assert abs(scheduled_value("cosine", 1.0, 0.5, 0.5) - 0.75) < 1e-12
    assert abs(scheduled_value("cosine", 1.0, 0.5, 0.25) - (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 4)))) < 1e-12
    assert abs(scheduled_value("exponential", 1.0, 0.25, 0.5) - 0.5) < 1e-12
    for kind in ("linear", "cosine", "exponential"):
        assert scheduled_value(kind, 1.2, 0.6, 0.0) == pytest.approx(1.2)
        assert scheduled_value(kind, 1.2, 0.6, 1.0) == pytest.approx(0.6)
    assert [progress_of(s, 5) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert progress_of(0, 1) == 0.0


def test_the_registry_and_the_presets_name_the_same_algorithms():
    """The config applies rlora/presets.py without importing the registry: the two must agree."""
    from rlora.algos.registry import ALGORITHMS
    from rlora.presets import PRESETS

    assert list(ALGORITHMS) == list(PRESETS)
    assert all(ALGORITHMS[name].presets is PRESETS[name] for name in PRESETS)


def test_a_section_preset_is_the_validated_section():
    from rlora.config import PPOConfig, load_config

    cfg = load_config(None, ["algo.name=ppo"])
    assert isinstance(cfg.ppo, PPOConfig) and cfg.ppo == PPOConfig() and cfg.algo.beta == 0.05
    kept = load_config(None, ["algo.name=ppo", "ppo.gamma=0.9"])
    assert kept.ppo.gamma == 0.9  # a section the user set is not replaced
