"""The advantages a real training step trains on come from the rewards of the completions it sampled.

One `rlora train` step on the tiny model with a reward the test can recompute from a completion's text (its
length in characters, rewards_for_tests.char_count). The registered algorithm is wrapped by spies that record
what the step passes to its advantage function and the advantages that reach its per-token loss; the expected
advantages are computed here from the logged completions with the paper's group formula."""

import dataclasses
import json
import math

import pytest
import torch

from conftest import tiny_overrides
from rlora.algos import registry
from rlora.cli import main

G, P = 4, 2  # tiny_overrides: rollout.num_generations, train.prompts_per_step
EPS = 1e-4  # algo.adv_eps's default


def expected_advantages(rewards: list[float], name: str) -> list[float]:
    """GRPO: (r - mean) / (unbiased std + eps) per group of G; Dr.GRPO: r - mean; RLOO: r - mean of the others.
    A group whose rewards are all equal gets 0."""
    out = []
    for g in range(0, len(rewards), G):
        group = rewards[g:g + G]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        for r in group:
            if max(group) == min(group):
                out.append(0.0)
            elif name == "grpo":
                out.append((r - mean) / (std + EPS))
            elif name == "dr_grpo":
                out.append(r - mean)
            else:
                out.append(r - (sum(group) - r) / (G - 1))
    return out


def spy_on(monkeypatch, name: str) -> dict[str, list]:
    """Replace the registry entry by one whose advantage and loss functions record their inputs and outputs."""
    registered = registry.ALGORITHMS[name]
    calls = {"advantages": [], "loss": []}

    def advantages(inputs):
        out = registered.advantages(inputs)
        calls["advantages"].append((inputs.rewards_P_S.clone(), out.clone()))
        return out

    def token_loss(inputs, **kwargs):
        calls["loss"].append(inputs.advantages_BT[:, 0].detach().cpu().clone())  # one per completion
        return registered.token_loss(inputs, **kwargs)

    monkeypatch.setitem(registry.ALGORITHMS, name,
                        dataclasses.replace(registered, advantages=advantages, token_loss=token_loss))
    return calls


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_one_step_trains_on_the_group_advantages_of_its_completions_rewards(name, tiny_model_dir, prompts_file,
                                                                            tmp_path, monkeypatch):
    calls = spy_on(monkeypatch, name)
    out = tmp_path / "run"
    assert main(["train", *tiny_overrides(tiny_model_dir, prompts_file, str(out), **{
        "algo.name": name, "train.steps": 1, "eval.before": "false", "eval.after": "false",
        "rewards": "[{fn: rewards_for_tests.char_count}]", "rollout.sampler_dtype": "model"})]) == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == P * G
    for g in range(P):  # prompt-major: a group's G rows are consecutive
        assert len({s["prompt"] for s in samples[g * G:(g + 1) * G]}) == 1
    rewards = [float(len(s["completion"])) for s in samples]  # the reward of each sampled completion, recomputed
    expected = expected_advantages(rewards, name)
    assert any(a != 0 for a in expected)  # not a batch of flat groups, where every mapping gives zeros

    [(rewards_P_S, returned)] = calls["advantages"]  # one advantage computation in the step
    assert rewards_P_S.reshape(-1).tolist() == rewards and rewards_P_S.shape == (P, G)
    assert returned.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # what reached the loss, micro-batch by micro-batch in row order (rows with advantage 0 may be skipped)
    used = torch.cat(calls["loss"]).tolist()
    assert [a for a in used if a != 0] == pytest.approx([a for a in expected if a != 0], rel=1e-5, abs=1e-6)
    assert [s["advantage"] for s in samples] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert [s["reward"] for s in samples] == rewards
