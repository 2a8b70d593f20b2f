"""Every registered algorithm, fetched by name as the training step fetches it, against a naive reference of its
paper's formula written here: advantages, per-token loss and loss value on one fixed, hand-chosen batch.

tests/test_algorithms.py checks the math functions one by one; these tests check the *mapping*: an algorithm
registered with another one's advantage or loss function, another one's presets or the wrong kl_in_reward flag
gives other numbers than its reference. The references take their hyperparameters from the paper values
written in SPECS below (docs/algorithms.md's table), not from rlora's presets, so a wrong preset fails too.
"""

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from rlora.algos.gae import ppo_advantages
from rlora.algos.losses import LossInputs, aggregate
from rlora.algos.registry import ALGORITHMS, AdvantageInputs, get_algorithm
from rlora.config import load_config
from rlora.presets import PRESETS
from rlora.train.update import batch_totals

NAN = math.nan
EPS = 1e-4  # algo.adv_eps's default
MAX_NEW_TOKENS = 16  # rollout.max_new_tokens here: Dr.GRPO's constant divides by rows x this
G = 4

# ---- the fixed batch: 3 prompts x 4 completions, 5 completion positions ------------------------------------
# group 0: distinct rewards; group 1: one failed reward (NaN); group 2: all equal (no signal for group methods)
REWARDS_P_G = [[1.0, 0.0, 0.5, 0.25], [0.2, 0.9, NAN, 0.4], [0.7, 0.7, 0.7, 0.7]]
# real completion tokens per row; row 6 (failed reward) has none left in the loss mask, as train/step.loss_mask makes it
LENGTHS = [5, 3, 1, 4, 2, 5, 0, 3, 4, 2, 5, 1]
T = 5
# logp - old_logp per token: the first row of each group stays within GSPO's tiny clip range (3e-4/4e-4) on
# average; the others leave PPO's 0.2 / DAPO's 0.28 range on both sides on some tokens
SMALL_DELTAS = [1e-4, -2e-4, 1.5e-4, 0.0, 2e-4]
BIG_DELTAS = [0.35, -0.4, 0.1, -0.15, 0.0, 0.25, -0.05]
REF_SHIFT = [0.2, -0.1, 0.3, -0.25, 0.05]  # ref_logp - logp per position


@dataclass(frozen=True)
class FixedBatch:
    rewards_P_G: torch.Tensor  # float64
    mask_BT: torch.Tensor  # float32 loss mask
    logp_BT: torch.Tensor  # float32, as the trainer computes them
    old_logp_BT: torch.Tensor
    ref_logp_BT: torch.Tensor
    values_BT: torch.Tensor  # a critic's values (ppo), 0 on padding


def fixed_batch() -> FixedBatch:
    B = len(LENGTHS)
    mask = torch.tensor([[1.0 if t < length else 0.0 for t in range(T)] for length in LENGTHS])
    logp = torch.tensor([[-0.3 - 0.17 * ((3 * b + 5 * t) % 7) for t in range(T)] for b in range(B)])
    delta = torch.tensor([[SMALL_DELTAS[t] if b % G == 0 else BIG_DELTAS[(b + 2 * t) % len(BIG_DELTAS)]
                           for t in range(T)] for b in range(B)])
    ref = logp + torch.tensor(REF_SHIFT)
    values = torch.tensor([[0.1 * ((2 * b + 3 * t) % 5) - 0.2 for t in range(T)] for b in range(B)]) * mask
    return FixedBatch(torch.tensor(REWARDS_P_G, dtype=torch.float64), mask, logp, logp - delta, ref, values)


def rows_of(x: torch.Tensor) -> list[list[float]]:
    return x.double().tolist()


# ---- naive references (Python floats, loops over rows and tokens) -----------------------------------------

def ref_group(batch: FixedBatch, beta: float, scale: str) -> list[float]:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean) / (std + eps), unbiased std over the group's valid rewards;
    Dr.GRPO: r_i - mean. Failed samples and groups whose valid rewards are all equal get 0."""
    out = []
    for row in rows_of(batch.rewards_P_G):
        valid = [r for r in row if not math.isnan(r)]
        mean = sum(valid) / len(valid)
        std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
        flat = max(valid) == min(valid)
        for r in row[:G]:
            out.append(0.0 if math.isnan(r) or flat else (r - mean) / (std + EPS if scale == "group" else 1.0))
    return out


def ref_rloo(batch: FixedBatch, beta: float) -> list[float]:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other valid samples of the group."""
    out = []
    for row in rows_of(batch.rewards_P_G):
        valid = [r for r in row if not math.isnan(r)]
        flat = max(valid) == min(valid)
        out += [0.0 if math.isnan(r) or flat else r - (sum(valid) - r) / (len(valid) - 1) for r in row[:G]]
    return out


def _whitened(returns: dict[tuple[int, int], float], center: bool) -> list[list[float]]:
    """(x - mean) / (std + eps) over the given (row, token) entries (unbiased std); 0 elsewhere."""
    xs = list(returns.values())
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    out = [[0.0] * T for _ in LENGTHS]
    for (b, t), x in returns.items():
        out[b][t] = ((x - mean) if center else x) / (std + EPS)
    return out


def ref_reinforce_pp(batch: FixedBatch, beta: float, baseline: bool) -> list[list[float]]:
    """REINFORCE++ (Hu 2025): G_t = r + sum_{s >= t} -beta * (old_s - ref_s) (gamma 1, k1 KL in the reward),
    whitened over every real token of the batch. -baseline: the group mean reward subtracted from r first,
    then only divided by the std (rlora's documented variant: no token-weighted re-centring)."""
    flat_rewards = [r for row in rows_of(batch.rewards_P_G) for r in row[:G]]
    old, ref = rows_of(batch.old_logp_BT), rows_of(batch.ref_logp_BT)
    returns = {}
    for b, (r, length) in enumerate(zip(flat_rewards, LENGTHS)):
        if math.isnan(r) or length == 0:
            continue
        if baseline:
            group = [x for x in flat_rewards[b // G * G:(b // G + 1) * G] if not math.isnan(x)]
            r -= sum(group) / len(group)
        for t in range(length):
            returns[(b, t)] = r + sum(-beta * (old[b][s] - ref[b][s]) for s in range(t, length))
    return _whitened(returns, center=not baseline)


def ref_ppo_gae(batch: FixedBatch, beta: float, gamma: float, lam: float) -> list[list[float]]:
    """PPO with GAE (Schulman et al. 2015): r_t = -beta * (old_t - ref_t) + outcome at the last token,
    delta_t = r_t + gamma V_{t+1} - V_t (V_L = 0), A_t = delta_t + gamma lam A_{t+1}; whitened over real tokens."""
    flat_rewards = [r for row in rows_of(batch.rewards_P_G) for r in row[:G]]
    old, ref, values = rows_of(batch.old_logp_BT), rows_of(batch.ref_logp_BT), rows_of(batch.values_BT)
    advantages = {}
    for b, (outcome, length) in enumerate(zip(flat_rewards, LENGTHS)):
        next_adv = 0.0
        for t in reversed(range(length)):
            reward = -beta * (old[b][t] - ref[b][t]) + (outcome if t == length - 1 else 0.0)
            next_value = values[b][t + 1] if t + 1 < length else 0.0
            next_adv = reward + gamma * next_value - values[b][t] + gamma * lam * next_adv
            advantages[(b, t)] = next_adv
    return _whitened(advantages, center=True)


def _per_token(advantages, b: int, t: int) -> float:
    return advantages[b][t] if isinstance(advantages[b], list) else advantages[b]


def _ppo_clip(ratio: float, adv: float, low: float, high: float) -> float:
    return -min(ratio * adv, min(max(ratio, 1 - low), 1 + high) * adv)


def _k3(logp: float, ref: float) -> float:
    return math.exp(ref - logp) - (ref - logp) - 1


def ref_token_losses(batch: FixedBatch, advantages, kind: str, clip: tuple[float, float], kl_beta: float):
    """Per real token: PPO-clip (-min(rho A, clip(rho) A)), GSPO (one ratio exp(mean_t(logp - old)) per
    sequence), or CISPO (-sg(clip(rho)) A logp); + kl_beta * k3 KL. {(row, token): loss}."""
    logp, old, ref = rows_of(batch.logp_BT), rows_of(batch.old_logp_BT), rows_of(batch.ref_logp_BT)
    low, high = clip
    losses = {}
    for b, length in enumerate(LENGTHS):
        seq_ratio = math.exp(sum(logp[b][t] - old[b][t] for t in range(length)) / max(length, 1))
        for t in range(length):
            ratio, adv = math.exp(logp[b][t] - old[b][t]), _per_token(advantages, b, t)
            if kind == "gspo":
                loss = _ppo_clip(seq_ratio, adv, low, high)
            elif kind == "cispo":
                loss = -min(max(ratio, 1 - low), 1 + high) * adv * logp[b][t]
            else:
                assert kind == "ppo_clip", kind
                loss = _ppo_clip(ratio, adv, low, high)
            losses[(b, t)] = loss + kl_beta * _k3(logp[b][t], ref[b][t])
    return losses


def ref_aggregate(losses: dict, agg: str) -> float:
    """token_mean: over all real tokens; seq_mean: mean over sequences of their token mean; constant:
    sum / (all rows x max_new_tokens) (Dr.GRPO)."""
    if agg == "token_mean":
        return sum(losses.values()) / len(losses)
    if agg == "seq_mean":
        per_seq = [sum(losses[(b, t)] for t in range(n)) / n for b, n in enumerate(LENGTHS) if n]
        return sum(per_seq) / len(per_seq)
    assert agg == "constant"
    return sum(losses.values()) / (len(LENGTHS) * MAX_NEW_TOKENS)


@dataclass(frozen=True)
class Spec:
    """What the paper says: advantages(batch, beta), the loss kind, clip range, aggregation, and beta."""

    advantages: Callable
    loss: str  # ppo_clip, gspo or cispo
    clip: tuple[float, float]
    agg: str
    beta: float = 0.0  # the preset KL coefficient
    kl_in_loss: bool = True  # k3 in the loss (else: k1 in the reward)


GRPO = Spec(lambda b, beta: ref_group(b, beta, "group"), "ppo_clip", (0.2, 0.2), "token_mean")
SPECS = {
    "grpo": GRPO,
    "dr_grpo": Spec(lambda b, beta: ref_group(b, beta, "none"), "ppo_clip", (0.2, 0.2), "constant"),
    "dapo": Spec(GRPO.advantages, "ppo_clip", (0.2, 0.28), "token_mean"),
    "gspo": Spec(GRPO.advantages, "gspo", (3e-4, 4e-4), "seq_mean"),
    "cispo": Spec(GRPO.advantages, "cispo", (1.0, 0.2), "token_mean"),
    "rloo": Spec(ref_rloo, "ppo_clip", (0.2, 0.2), "token_mean"),
    "reinforce_pp": Spec(lambda b, beta: ref_reinforce_pp(b, beta, baseline=False), "ppo_clip", (0.2, 0.2),
                         "token_mean", beta=0.01, kl_in_loss=False),
    "reinforce_pp_baseline": Spec(lambda b, beta: ref_reinforce_pp(b, beta, baseline=True), "ppo_clip", (0.2, 0.2),
                                  "token_mean", beta=0.01, kl_in_loss=False),
    # PPO's defaults: gamma 1, lam 0.95, KL in the reward, whitened advantages
    "ppo": Spec(lambda b, beta: ref_ppo_gae(b, beta, gamma=1.0, lam=0.95), "ppo_clip", (0.2, 0.2), "token_mean",
                beta=0.05, kl_in_loss=False),
    "adaptive_grpo": GRPO,
}


# ---- the code under test, driven as train/step.py (train/ppo_step.py for the critic) drives it --------------

def step_advantages(algo, cfg, batch: FixedBatch, ref_logp) -> torch.Tensor:
    """advantages_of in train/step.py; ppo's from its critic's values as in train/ppo_step.py."""
    a = cfg.algo
    if algo.critic:
        kl = batch.old_logp_BT - ref_logp if cfg.ppo.kl_mode == "reward" and ref_logp is not None else None
        return ppo_advantages(batch.rewards_P_G[:, :G].reshape(-1), batch.values_BT, batch.mask_BT, cfg.ppo.gamma,
                              cfg.ppo.lam, cfg.ppo.whiten_advantages, a.adv_eps, kl, a.beta).advantages_BT
    kl = batch.old_logp_BT - ref_logp if algo.kl_in_reward and ref_logp is not None else None
    return algo.advantages(AdvantageInputs(batch.rewards_P_G, batch.mask_BT, a.adv_scale, a.adv_eps, a.beta, G, kl))


def step_loss(algo, cfg, batch: FixedBatch, advantages, ref_logp):
    """train/update.py: the registered per-token loss (KL in the loss unless the algorithm puts it in the reward),
    aggregated over the whole batch's counts. -> (TokenLosses, loss)."""
    if algo.critic:  # train/ppo_step.py: kl_mode decides where ppo's KL goes
        algo = dataclasses.replace(algo, kl_in_reward=cfg.ppo.kl_mode == "reward")
    loss_beta = 0.0 if algo.kl_in_reward else cfg.algo.beta
    inputs = LossInputs(batch.logp_BT, batch.old_logp_BT, advantages, batch.mask_BT, ref_logp)
    out = algo.token_loss(inputs, clip_low=cfg.algo.clip_low, clip_high=cfg.algo.clip_high, beta=loss_beta)
    return out, aggregate(out.loss_BT, batch.mask_BT, cfg.algo.loss_agg, batch_totals(batch.mask_BT, cfg.constant_norm()))


def _config(name: str, beta: float | None):
    overrides = [f"algo.name={name}", f"rollout.max_new_tokens={MAX_NEW_TOKENS}"]
    return load_config(None, overrides + ([f"algo.beta={beta}"] if beta is not None else []))


def test_every_registered_algorithm_has_a_reference():
    """A new algorithm must come with its reference here (and the test below runs over the registry's names)."""
    assert sorted(SPECS) == sorted(ALGORITHMS)


@pytest.mark.parametrize("user_beta", [None, 0.04], ids=["preset_beta", "beta_0.04"])
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_registered_algorithm_equals_its_reference(name, user_beta):
    """By name through the registry: advantages, per-token loss and loss value equal the paper's formula, with the
    paper's presets (user_beta None) and with a user-set KL coefficient (k3 in the loss, or k1 in the reward)."""
    assert name in SPECS, f"algorithm {name!r} has no reference in this file"
    spec, cfg = SPECS[name], _config(name, user_beta)
    algo = get_algorithm(cfg.algo.name)  # what train/session.py does
    assert algo.name == name and algo.presets is PRESETS[name]
    beta = spec.beta if user_beta is None else user_beta
    assert cfg.algo.beta == beta
    batch = fixed_batch()
    ref_logp = batch.ref_logp_BT if beta > 0 else None  # the step runs the reference only with a KL term

    advantages = step_advantages(algo, cfg, batch, ref_logp)
    expected_adv = torch.tensor(spec.advantages(batch, beta), dtype=torch.float64)
    assert advantages.shape == expected_adv.shape
    assert torch.allclose(advantages.double(), expected_adv, rtol=1e-5, atol=1e-6), (advantages, expected_adv)

    out, loss = step_loss(algo, cfg, batch, advantages, ref_logp)
    expected_tokens = ref_token_losses(batch, expected_adv.tolist(), spec.loss, spec.clip,
                                       beta if spec.kl_in_loss else 0.0)
    got_tokens = {(b, t): float(out.loss_BT[b, t]) for b, t in expected_tokens}
    for key, want in expected_tokens.items():
        assert got_tokens[key] == pytest.approx(want, rel=1e-5, abs=1e-6), (key, got_tokens[key], want)
    assert float(loss) == pytest.approx(ref_aggregate(expected_tokens, spec.agg), rel=1e-5, abs=1e-7)


def test_the_fixed_batch_tells_the_algorithms_apart():
    """The batch is informative: references that a swapped registry entry would fall back on differ here, so a
    swap cannot pass by coincidence (both clip branches act; group stats differ from leave-one-out and from none)."""
    batch = fixed_batch()
    adv = {name: torch.tensor(spec.advantages(batch, spec.beta or 0.01)) for name, spec in SPECS.items()}
    distinct = ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]
    for i, a in enumerate(distinct):
        for b in distinct[i + 1:]:
            assert adv[a].shape != adv[b].shape or not torch.allclose(adv[a], adv[b], atol=1e-3), (a, b)
    grpo_adv = adv["grpo"].tolist()
    losses = {name: ref_token_losses(batch, grpo_adv, SPECS[name].loss, SPECS[name].clip, 0.0)
              for name in ("grpo", "dapo", "gspo", "cispo")}
    values = [[round(x, 6) for x in losses[k].values()] for k in losses]
    assert all(values[i] != values[j] for i in range(len(values)) for j in range(i + 1, len(values)))
    for kind, clip in (("ppo_clip", (0.2, 0.2)), ("gspo", (3e-4, 4e-4)), ("cispo", (1.0, 0.2))):
        unclipped = ref_token_losses(batch, grpo_adv, kind, (1.0, math.inf), 0.0)
        clipped = ref_token_losses(batch, grpo_adv, kind, clip, 0.0)
        changed = [abs(clipped[key] - unclipped[key]) > 1e-9 for key in clipped]
        assert any(changed) and not all(changed), kind  # the clip acts on some tokens, not on all
    aggs = {agg: ref_aggregate(losses["grpo"], agg) for agg in ("token_mean", "seq_mean", "constant")}
    assert len({round(v, 6) for v in aggs.values()}) == 3


def test_ppo_takes_its_advantages_from_the_critic_not_from_a_group_formula():
    """ppo's registered advantage function refuses (train/ppo_step.py computes GAE from the critic's values)."""
    algo = get_algorithm("ppo")
    assert algo.critic and not get_algorithm("grpo").critic
    batch = fixed_batch()
    with pytest.raises(TypeError, match="critic"):
        algo.advantages(AdvantageInputs(batch.rewards_P_G, batch.mask_BT, "group", EPS, 0.05, G))


def test_adaptive_grpo_with_all_attempts_takes_statistics_over_every_sample_of_the_prompt():
    """adaptive_grpo with adv_stats=all: the mean and std over all samples drawn for the prompt (the kept G and
    the earlier attempts' extra columns), applied to the kept G."""
    cfg = load_config(None, ["algo.name=adaptive_grpo", "algo.adaptive.adv_stats=all"])
    algo = get_algorithm(cfg.algo.name)
    batch = fixed_batch()
    earlier = torch.tensor([[0.0, 0.0], [1.0, NAN], [0.1, 0.7]], dtype=torch.float64)  # earlier attempts
    rewards_P_S = torch.cat([batch.rewards_P_G, earlier], dim=1)
    got = algo.advantages(AdvantageInputs(rewards_P_S, batch.mask_BT, cfg.algo.adv_scale, cfg.algo.adv_eps,
                                          cfg.algo.beta, G))
    expected = ref_group(dataclasses.replace(batch, rewards_P_G=rewards_P_S), 0.0, "group")
    assert torch.allclose(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert float(got[8:].abs().sum()) > 0  # group 2 is flat on its kept samples, not over all attempts
