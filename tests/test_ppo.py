"""PPO with a critic on the policy's base: GAE, the clipped value loss, whitening and explained variance
(hand-computed and against naive loops), the value model (save/reload, roles that do not leak, micro-batch
invariance), `rlora train algo.name=ppo` end to end with resume, and the bad-input contract."""

import json
import math
import threading

import pytest
import torch

from conftest import tiny_overrides
from rlora.algos.advantages import token_returns, token_rewards
from rlora.algos.gae import clipped_value_loss, explained_variance, gae, ppo_advantages
from rlora.algos.registry import get_algorithm
from rlora.cli import main
from rlora.config import AlgoConfig, LoraConfig, ModelConfig, TrainConfig
from rlora.models.loading import attach_lora, load_base_model, trainable_parameters
from rlora.models.value_model import attach_critic, load_value_model, read_value_meta
from rlora.train.optim import build_optimizer
from rlora.train.ppo_step import accumulate_value_gradient, batched_values
from rlora.train.update import ScoredRollout, accumulate_policy_gradient, batched_logprobs
from test_policy_model import make_policy, perturb_adapter, sample, vary_lengths


# ---- GAE -----------------------------------------------------------------------------------------------

def naive_gae(rewards_BT, values_BT, mask_BT, gamma, lam):
    """Row by row, token by token: the textbook recursion over a row's L real tokens, V_L = 0."""
    B, T = mask_BT.shape
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        L = int(mask_BT[b].sum())
        next_adv = 0.0
        for t in reversed(range(L)):
            next_value = float(values_BT[b, t + 1]) if t + 1 < L else 0.0
            delta = float(rewards_BT[b, t]) + gamma * next_value - float(values_BT[b, t])
            next_adv = delta + gamma * lam * next_adv
            adv[b][t] = next_adv
    adv = torch.tensor(adv, dtype=torch.float64)
    return adv, (adv + values_BT.double()) * mask_BT


def test_gae_hand_computed_with_a_ragged_row():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    values = torch.tensor([[0.5, 0.25, 0.75], [1.0, 0.5, 9.0]])  # 9.0 sits on padding: never read
    rewards = token_rewards(torch.tensor([1.0, 2.0]), mask, None, 0.0)  # outcome at the last real token
    assert rewards.tolist() == [[0, 0, 1], [0, 2, 0]]
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)  # gamma * lam = 0.72
    # row 0: t2: delta = 1 - 0.75 = 0.25 = A2
    #        t1: delta = 0.9 * 0.75 - 0.25 = 0.425; A1 = 0.425 + 0.72 * 0.25 = 0.605
    #        t0: delta = 0.9 * 0.25 - 0.5 = -0.275; A0 = -0.275 + 0.72 * 0.605 = 0.1606
    # row 1 (length 2): t1: delta = 2 - 0.5 = 1.5 = A1
    #                   t0: delta = 0.9 * 0.5 - 1 = -0.55; A0 = -0.55 + 0.72 * 1.5 = 0.53
    assert torch.allclose(adv, torch.tensor([[0.1606, 0.605, 0.25], [0.53, 1.5, 0.0]], dtype=torch.float64), atol=1e-12)
    # returns = A + V: [0.6606, 0.855, 1.0] and [1.53, 2.0, 0 (padding)]
    assert torch.allclose(ret, torch.tensor([[0.6606, 0.855, 1.0], [1.53, 2.0, 0.0]], dtype=torch.float64), atol=1e-12)


def test_gae_steps_over_an_episodes_environment_tokens():
    """An episode's row: policy tokens at 0 and 3, the environment's at 1-2 (mask 0), padding at 4. The policy's
    steps are t0 -> t3 (the environment's tokens are part of that transition): exactly the contiguous row [0, 3]."""
    mask = torch.tensor([[1, 0, 0, 1, 0]])
    values = torch.tensor([[0.5, 7.0, 7.0, 0.25, 9.0]])  # 7.0 on the environment's tokens, 9.0 on padding: unread
    rewards = token_rewards(torch.tensor([1.0]), mask, None, 0.0)
    assert rewards.tolist() == [[0, 0, 0, 1, 0]]  # the outcome on the policy's last token
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # t3: delta = 1 - 0.25 = 0.75 = A3; t0: delta = 0.9 * 0.25 - 0.5 = -0.275, A0 = -0.275 + 0.72 * 0.75 = 0.265
    assert torch.allclose(adv, torch.tensor([[0.265, 0, 0, 0.75, 0]], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(ret, torch.tensor([[0.765, 0, 0, 1.0, 0]], dtype=torch.float64), atol=1e-12)
    contiguous, _ = gae(token_rewards(torch.tensor([1.0]), torch.tensor([[1, 1]]), None, 0.0),
                        torch.tensor([[0.5, 0.25]]), torch.tensor([[1, 1]]), gamma=0.9, lam=0.8)
    assert torch.allclose(adv[:, [0, 3]], contiguous, atol=1e-12)


def test_kl_folded_into_the_token_rewards():
    mask = torch.tensor([[1, 1, 1]])
    kl = torch.tensor([[0.1, 0.2, 0.3]])
    # beta 0.5: r = [-0.05, -0.1, -0.15 + 1] ; gamma = lam = 1 with V = 0: A_t = sum of r from t
    result = ppo_advantages(torch.tensor([1.0]), torch.zeros(1, 3), mask, 1.0, 1.0, False, 1e-4, kl, 0.5)
    assert torch.allclose(result.advantages_BT, torch.tensor([[0.70, 0.75, 0.85]]), atol=1e-7)
    assert torch.allclose(result.returns_BT, result.advantages_BT)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.0), (0.0, 1.0), (0.0, 0.0), (0.9, 0.95), (1.0, 0.95)])
def test_gae_matches_the_naive_loop(gamma, lam):
    g = torch.Generator().manual_seed(3)
    lengths = [7, 1, 0, 4, 7, 2]  # ragged, a row of length 1 and an empty row
    mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    rewards = torch.randn(6, 7, generator=g, dtype=torch.float64) * mask
    values = torch.randn(6, 7, generator=g, dtype=torch.float64)  # garbage on padding: must not matter
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = naive_gae(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, want_adv, atol=1e-12) and torch.allclose(ret, want_ret, atol=1e-12)
    if lam == 0.0:  # one-step TD error
        next_v = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros(6, 1, dtype=torch.float64)], 1)
        assert torch.allclose(adv, (rewards + gamma * next_v - values) * mask, atol=1e-12)
    if lam == 1.0:  # Monte-Carlo: returns are the discounted reward sums, whatever the values
        discounted = torch.zeros_like(rewards)
        running = torch.zeros(6, dtype=torch.float64)
        for t in reversed(range(7)):
            running = rewards[:, t] + gamma * running * mask[:, t]
            discounted[:, t] = running * mask[:, t]
        assert torch.allclose(ret, discounted, atol=1e-12)


def test_gae_with_gamma_lam_one_and_no_critic_is_reinforce_pp_returns():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    kl = torch.tensor([[0.2, -0.1, 0.4, 9.0], [0.3, 9.0, 9.0, 9.0]])
    rewards = torch.tensor([1.0, -0.5])
    out = ppo_advantages(rewards, torch.zeros(2, 4), mask, 1.0, 1.0, False, 1e-4, kl, 0.1)
    assert torch.allclose(out.advantages_BT.double(), token_returns(rewards, mask, kl, 0.1), atol=1e-7)


def test_whitening_over_real_tokens_and_returns_unwhitened():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(5)[None] < torch.tensor([5, 2, 4])[:, None]).long()
    values = torch.randn(3, 5, generator=g)
    rewards = torch.tensor([1.0, 0.0, 0.5])
    plain = ppo_advantages(rewards, values, mask, 1.0, 0.95, False, 1e-8)
    white = ppo_advantages(rewards, values, mask, 1.0, 0.95, True, 1e-8)
    real = mask.bool()
    a = plain.advantages_BT[real].double()
    assert torch.allclose(white.advantages_BT[real].double(), (a - a.mean()) / a.std(), atol=1e-6)
    assert white.advantages_BT[real].mean().abs() < 1e-6 and abs(white.advantages_BT[real].std() - 1) < 1e-5
    assert (white.advantages_BT[~real] == 0).all()
    assert torch.equal(white.returns_BT, plain.returns_BT)  # the critic's targets are never whitened


def test_failed_reward_rows_get_nothing():
    mask = torch.tensor([[1, 1], [0, 0]])  # row 1: its reward failed, so the loss mask is zero
    out = ppo_advantages(torch.tensor([1.0, float("nan")]), torch.ones(2, 2), mask, 1.0, 0.9, False, 1e-4)
    assert torch.isfinite(out.advantages_BT).all()
    assert (out.advantages_BT[1] == 0).all() and (out.returns_BT[1] == 0).all()


# ---- value loss, explained variance -----------------------------------------------------------------------

def test_clipped_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.1, 0.5]])
    returns = torch.tensor([[2.0, -1.0, 2.0]])
    out = clipped_value_loss(values, old, returns, clip=0.2)
    # t0: unclipped (1 - 2)^2 = 1; V clipped to 0.5 + 0.2 = 0.7: (0.7 - 2)^2 = 1.69 -> 0.5 * 1.69 = 0.845, clipped
    # t1: V = 0.0 within 0.1 +- 0.2: both (0 + 1)^2 = 1 -> 0.5, not clipped
    # t2: unclipped (0 - 2)^2 = 4; clipped to 0.5 - 0.2 = 0.3: (0.3 - 2)^2 = 2.89 -> max 4 -> 2.0, not clipped
    assert torch.allclose(out.loss_BT, torch.tensor([[0.845, 0.5, 2.0]]))
    assert out.clipped_BT.tolist() == [[True, False, False]]
    out.loss_BT.sum().backward()
    # d/dV: t0 the clipped branch is constant in V -> 0; t1: V - R = 1; t2: V - R = -2
    assert torch.allclose(values.grad, torch.tensor([[0.0, 1.0, -2.0]]))
    plain = clipped_value_loss(values.detach(), old, returns, clip=None)
    assert torch.allclose(plain.loss_BT, torch.tensor([[0.5, 0.5, 2.0]])) and not plain.clipped_BT.any()


def test_explained_variance_hand_computed():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the 100 is padding
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.5), returns, mask) == pytest.approx(0.0)
    # residual [-1, 1, -1, 1]: variance 1; Var(R) = mean of (1.5^2, 0.5^2, 0.5^2, 1.5^2) = 1.25 -> 1 - 1 / 1.25 = 0.2
    assert explained_variance(torch.tensor([[2.0, 1.0, 4.0, 3.0, 0.0]]), returns, mask) == pytest.approx(0.2)
    assert explained_variance(returns, torch.ones_like(returns), mask) is None  # constant returns


def test_explained_variance_of_split_ranks_is_the_whole_batchs():
    """Two ranks (threads with a summing collective) holding rows [0] and [1, 2] of the batch above each get the
    explained variance of all its real tokens, the hand-computed 0.2; each rank's own is 1 - 1 / 0.25 = -3
    (residuals -1, 1 around returns one apart), so the mean of the ranks' own values would say -3."""
    returns = torch.tensor([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])
    values = torch.tensor([[2.0, 1.0], [4.0, 3.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    ranks = [slice(0, 1), slice(1, 3)]
    barrier, sent, results = threading.Barrier(2), [None, None], [None, None]

    def run(rank: int) -> None:
        def all_sum(mine: list[float]) -> list[float]:
            sent[rank] = list(mine)
            barrier.wait()
            total = [a + b for a, b in zip(*sent)]
            barrier.wait()  # both have read before the next call overwrites
            return total
        results[rank] = explained_variance(values[ranks[rank]], returns[ranks[rank]], mask[ranks[rank]], all_sum)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [pytest.approx(0.2, abs=1e-12)] * 2
    assert explained_variance(values[:1], returns[:1], mask[:1]) == pytest.approx(-3.0)
    assert explained_variance(values[1:], returns[1:], mask[1:]) == pytest.approx(-3.0)


# ---- the value model on the policy's base ----------------------------------------------------------------

def critic_setup(model_dir, seed=0):
    tokenizer, tok, model = make_policy(model_dir)
    perturb_adapter(model, seed=1)  # the policy adapter's B != 0
    critic = attach_critic(model, rank=2, alpha=4, head_init_std=0.1)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():  # lora_B starts at 0: give the value adapter an effect
        for name, p in model.named_parameters():
            if ".value." in name and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    rollout = vary_lengths(sample(model, tokenizer, tok, n_prompts=1, G=4), tok.pad_id, lengths=(6, 2, 5, 1))
    return tokenizer, tok, model, critic, rollout


def test_critic_leaves_the_policy_as_it_was(tiny_model_dir):
    tokenizer, tok, model = make_policy(tiny_model_dir)
    perturb_adapter(model, seed=1)
    rollout = sample(model, tokenizer, tok, n_prompts=1, G=4)
    before = batched_logprobs(model, rollout, 4)
    n_policy = len(trainable_parameters(model))
    critic = attach_critic(model, rank=2, alpha=4, head_init_std=0.1)
    values = batched_values(critic, rollout, 4)
    assert model.active_adapter == "default" and model.training
    assert len(trainable_parameters(model)) == n_policy  # the value adapter is frozen outside Critic.active()
    assert all(".value." not in n for n, p in model.named_parameters() if p.requires_grad)
    assert torch.equal(batched_logprobs(model, rollout, 4), before)
    # the value adapter starts at B = 0, so values = head(base hidden states), which differ per position
    assert values[rollout.completion_mask_BTc.bool()].std() > 0


def test_value_model_reloads_with_identical_values(tiny_model_dir, tmp_path):
    _, _, model, critic, rollout = critic_setup(tiny_model_dir)
    values = batched_values(critic, rollout, 4)
    assert torch.allclose(batched_values(critic, rollout, 1), values, atol=1e-6)  # micro-batching: rounding only
    critic.save(tmp_path / "value_model")
    meta = read_value_meta(tmp_path / "value_model")
    assert meta["format"] == "rlora-value-model" and meta["hidden_size"] == 64
    fresh = attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir), LoraConfig(rank=4, alpha=8))
    reloaded = load_value_model(tmp_path / "value_model", fresh)
    assert torch.equal(batched_values(reloaded, rollout, 4), values)
    # and into a live critic (checkpoint resume): a fresh critic's values differ until restored
    other = attach_critic(attach_lora(load_base_model(ModelConfig(path=tiny_model_dir), tiny_model_dir),
                                      LoraConfig(rank=4, alpha=8)), rank=2, alpha=4)
    assert not torch.equal(batched_values(other, rollout, 4), values)
    other.restore(tmp_path / "value_model")
    assert torch.equal(batched_values(other, rollout, 4), values)


def test_values_over_a_shared_frozen_prefix_are_the_same(tiny_model_dir):
    from rlora.models.frozen_prefix import FrozenPrefix, first_adapter_layer

    tokenizer, tok, model = make_policy(tiny_model_dir, top_layers=1)  # adapters on layer 1 of 2
    critic = attach_critic(model, rank=2, alpha=4, head_init_std=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".value." in name and "lora_B" in name:
                p.normal_(0.0, 0.05)
    assert first_adapter_layer(model) == 1  # the value adapter sits on the policy's layers
    rollout = vary_lengths(sample(model, tokenizer, tok, n_prompts=1, G=4), tok.pad_id, lengths=(6, 2, 5, 1))
    prefix = FrozenPrefix(model, rollout, 1, 2)
    assert torch.allclose(batched_values(critic, rollout, 2, prefix), batched_values(critic, rollout, 2), atol=1e-6)
    mask = rollout.completion_mask_BTc
    old = batched_values(critic, rollout, 2)
    returns = (old + torch.linspace(-1, 1, mask.numel()).view(mask.shape)) * mask
    grads = []
    for shared in (prefix, None):
        accumulate_value_gradient(critic, rollout, returns, old, mask, 2, 0.2, shared)
        grads.append(torch.cat([p.grad.reshape(-1) for p in critic.parameters()]))
        for p in critic.parameters():
            p.grad = None
    assert torch.allclose(grads[0], grads[1], atol=1e-6) and grads[0].abs().max() > 1e-3


def test_value_and_policy_updates_do_not_leak(tiny_model_dir):
    _, _, model, critic, rollout = critic_setup(tiny_model_dir)
    policy, value = trainable_parameters(model), critic.parameters()
    optimizer, _ = build_optimizer([{"params": policy}, {"params": value}], TrainConfig(lr=0.01), 10)
    snapshot = lambda params: [p.detach().clone() for p in params]  # noqa: E731
    mask = rollout.completion_mask_BTc
    old_values = batched_values(critic, rollout, 4)
    returns = old_values + torch.randn(old_values.shape) * mask

    policy_before, value_before = snapshot(policy), snapshot(value)
    accumulate_value_gradient(critic, rollout, returns, old_values, mask, 2, 0.2)
    assert all(p.grad is None for p in policy) and all(p.grad is not None for p in value)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(policy, policy_before))
    assert not all(torch.equal(a, b) for a, b in zip(value, value_before))
    assert model.active_adapter == "default"

    value_before = snapshot(value)
    scored = ScoredRollout(rollout, torch.randn(mask.shape) * mask, mask)
    accumulate_policy_gradient(model, get_algorithm("ppo"), AlgoConfig(), scored, 2, 6)
    assert all(p.grad is None for p in value) and all(p.grad is not None for p in policy)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(value, value_before))
    assert not all(torch.equal(a, b) for a, b in zip(policy, policy_before))


def test_value_gradient_is_micro_batch_invariant(tiny_model_dir):
    _, _, model, critic, rollout = critic_setup(tiny_model_dir)
    mask = rollout.completion_mask_BTc
    old_values = batched_values(critic, rollout, 4)
    # returns away from the values, some beyond the clip range, so both branches of the clipped loss act
    returns = (old_values + torch.linspace(-1, 1, mask.numel()).view(mask.shape)) * mask
    shifted = old_values + 0.1 * mask  # old values that differ from the current ones: clipping is active
    grads = []
    for micro in (4, 1):
        out = accumulate_value_gradient(critic, rollout, returns, shifted, mask, micro, 0.05)
        grads.append(torch.cat([p.grad.reshape(-1) for p in critic.parameters()]))
        losses = out["value_loss"]
        for p in critic.parameters():
            p.grad = None
    assert 0 < out["value_clip_frac"] < 1 and losses > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=0)
    assert grads[0].abs().max() > 1e-3  # a real gradient, not two zeros


# ---- rlora train algo.name=ppo -----------------------------------------------------------------------------

PPO = {"algo.name": "ppo", "rollout.num_generations": 1, "train.prompts_per_step": 4, "train.micro_batch_size": 2,
       "train.lr": 0.01, "eval.before": "false", "eval.after": "false"}


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


PPO_RESUMABLE = {**PPO, "algo.num_iterations": 2, "train.checkpoint_every": 1}


@pytest.fixture(scope="module")
def ppo_run(tiny_model_dir, tmp_path_factory):
    """Two PPO steps (two updates per rollout, G = 1), straight through: (folder, its data file)."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    prompts = out.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                               for i in range(8)))
    assert main(["train", *tiny_overrides(tiny_model_dir, str(prompts), str(out), **PPO_RESUMABLE)]) == 0
    return out, str(prompts)


def test_ppo_end_to_end_two_steps(ppo_run):
    from safetensors import safe_open

    out, _ = ppo_run
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("value_loss", "explained_variance", "value_clip_frac", "value_mean", "return_mean", "loss", "kl",
                    "grad_norm", "value_grad_norm", "reward_mean"):
            assert row[key] is not None and math.isfinite(row[key]), (key, row)
        assert row["skipped_update"] == 0
    assert rows[0]["value_mean"] == 0.0  # the head starts at zero ...
    assert rows[1]["value_mean"] != 0.0 and rows[1]["kl"] > 0  # ... and moved, as did the policy
    assert read_value_meta(out / "value_model")["values"] == "before_each_completion_token"
    with safe_open(str(out / "adapter" / "adapter_model.safetensors"), "pt") as file:
        policy_keys = list(file.keys())
    with safe_open(str(out / "value_model" / "adapter_model.safetensors"), "pt") as file:
        value_keys = list(file.keys())
    assert policy_keys and not any(".value." in key for key in policy_keys)  # the policy adapter alone
    assert sorted(value_keys) == sorted(policy_keys)  # the same LoRA placement, saved under peft's plain names
    assert (out / "checkpoints").is_dir()


def test_ppo_resume_continues_exactly(ppo_run, tiny_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    straight, prompts = ppo_run
    resumed = tmp_path / "resumed"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts, str(resumed), **PPO_RESUMABLE,
                                          **{"train.steps": 1})]) == 0
    assert (resumed / "checkpoints").is_dir() and (resumed / "value_model").is_dir()
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts, str(resumed), **PPO_RESUMABLE,
                                          **{"train.resume": "auto"})]) == 0, capsys.readouterr().err
    for folder, files in (("adapter", ["adapter_model.safetensors"]),
                          ("value_model", ["adapter_model.safetensors", "value_head.safetensors"])):
        for name in files:
            a, b = load_file(str(straight / folder / name)), load_file(str(resumed / folder / name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, name)
    assert _rows(straight)[1]["value_loss"] == _rows(resumed)[1]["value_loss"]


BAD = [
    ("ppo section with grpo", {"ppo.gamma": 0.9}, "the ppo section applies to algo.name=ppo, not grpo"),
    ("gamma above 1", {"algo.name": "ppo", "ppo.gamma": 1.5}, "invalid value for ppo.gamma"),
    ("unknown ppo key", {"algo.name": "ppo", "ppo.lambda": 0.9}, "unknown config key 'ppo.lambda'"),
    ("bad kl mode", {"algo.name": "ppo", "ppo.kl_mode": "both"}, "invalid value for ppo.kl_mode"),
    ("ppo with dynamic sampling", {"algo.name": "ppo", "algo.dynamic_sampling": "true"},
     "algo.dynamic_sampling works on groups of samples"),
    ("one sample per prompt with grpo", {"rollout.num_generations": 1, "train.micro_batch_size": 2},
     "rollout.num_generations=1 gives grpo no group to compare"),
]


@pytest.mark.parametrize("name, extra, message", BAD, ids=[b[0] for b in BAD])
def test_bad_ppo_input_is_one_line_exit_2(name, extra, message, tiny_model_dir, prompts_file, tmp_path, capsys):
    code = main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(tmp_path / "o"), **extra)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlora: error:")]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "o").exists()


def test_ppo_two_ranks_equal_one_rank(tiny_model_dir, prompts_file, tmp_path):
    """torchrun: 2 ranks x 1 prompt == 1 rank x 2 prompts for PPO with whitened GAE advantages: the value loss's
    token count, the critic's gradients and the whitening statistics are summed over ranks. One micro-batch per
    group (see test_distributed.py). Policy adapter, value adapter and value head within 1e-5; without the
    batch-wide whitening each rank would scale its advantages by its own std. PPO on a sharded base:
    tests/test_fsdp.py."""
    from safetensors.torch import load_file

    from test_distributed import _run

    common = {"algo.name": "ppo", "ppo.whiten_advantages": "true", "train.prompts_per_step": 2,
              "rollout.num_generations": 4, "train.micro_batch_size": 4, "train.steps": 2, "train.lr": 0.05,
              "algo.beta": 0.04, "eval.before": "false", "eval.after": "false", "train.threads": 1}
    outs = {}
    for nproc in (1, 2):
        outs[nproc] = tmp_path / f"ranks{nproc}"
        done = _run(nproc, tiny_overrides(tiny_model_dir, prompts_file, str(outs[nproc]), **common))
        assert done.returncode == 0, done.stderr[-3000:]
    for folder, name in (("adapter", "adapter_model.safetensors"), ("value_model", "adapter_model.safetensors"),
                         ("value_model", "value_head.safetensors")):
        one, two = (load_file(str(outs[n] / folder / name)) for n in (1, 2))
        assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-5, (folder, name)
    rows = {n: [json.loads(line) for line in (outs[n] / "metrics.jsonl").read_text().splitlines()] for n in (1, 2)}
    for a, b in zip(rows[1], rows[2]):
        for key in ("loss", "value_loss", "grad_norm", "value_grad_norm", "explained_variance"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert all(r["adapter_rank_divergence"] == 0.0 for r in rows[2])


def test_not_a_value_model_is_one_line(tiny_model_dir, tmp_path):
    from rlora.errors import UserError

    _, _, model, critic, _ = critic_setup(tiny_model_dir)
    with pytest.raises(UserError, match="is not a value model folder"):
        load_value_model(tmp_path, model, adapter_name="other")
    critic.save(tmp_path / "vm")
    meta = json.loads((tmp_path / "vm" / "value_model.json").read_text())
    (tmp_path / "vm" / "value_model.json").write_text(json.dumps({**meta, "hidden_size": 32}))
    with pytest.raises(UserError, match="was built for a base with hidden size 32") as err:
        load_value_model(tmp_path / "vm", model, adapter_name="other")
    assert "\n" not in str(err.value)


def test_a_critic_does_not_start_as_a_copy_of_its_policys_down_projection(tiny_model_dir):
    """Each critic is made from its policy's seed + an offset: made from the seed itself, its value adapter's lora_A
    draws were those of the policy's (the same shapes in the same order), every matrix a copy (seen before the
    offset: 14 of 14)."""
    from rlora.config import RLConfig, apply_presets
    from rlora.models.loading import attach_lora, load_base_model, model_device
    from rlora.train.session import attach_critics

    cfg = RLConfig.model_validate({"model": {"path": tiny_model_dir}, "algo": {"name": "ppo"}, "lora": {"rank": 4},
                                   "data": {"task": "chain_sum"}})
    apply_presets(cfg)
    torch.manual_seed(cfg.train.seed)  # as loading.attach_lora is called for a run
    model = attach_lora(load_base_model(cfg.model, tiny_model_dir), cfg.lora)
    attach_critics(cfg, model, model_device(model))  # in place: a LoRA policy's peft model
    policy = {n: p for n, p in model.named_parameters() if "lora_A.default" in n}
    critic = {n.replace("lora_A.value", "lora_A.default"): p for n, p in model.named_parameters() if "lora_A.value" in n}
    assert policy.keys() == critic.keys() and policy
    assert not any(torch.equal(policy[n], critic[n]) for n in policy)
