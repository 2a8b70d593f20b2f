"""Held-out evaluation: greedy completions scored by the run's reward functions.

accuracy = share of prompts whose first reward function gives its full score (1.0);
reward_mean = mean of the weighted total reward.
"""

from __future__ import annotations

import math

import torch

from rlora.rewards.scoring import RewardFn, score_completions
from rlora.types import Example, SamplingParams


def columns_of(examples: list[Example], repeat: int = 1) -> dict[str, list]:
    names = sorted({name for ex in examples for name in ex.columns})
    return {name: [ex.columns.get(name) for ex in examples for _ in range(repeat)] for name in names}


@torch.no_grad()
def evaluate(model, generator, examples, prompt_ids, prompt_texts, rewards: list[RewardFn],
             max_new_tokens: int, batch_size: int, progress=None, stop: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True, stop=stop)
    completions = []
    for start in range(0, len(examples), batch_size):
        rollout = generator.sample(model, prompt_ids[start:start + batch_size], 1, params, seed=0)
        completions.extend(rollout.completions)
        if progress is not None:
            progress(len(completions))
    scores = score_completions(rewards, prompt_texts, completions, columns_of(examples))
    primary = scores.per_fn[rewards[0].name]
    correct = [v is not None and math.isfinite(v) and v >= 1.0 - 1e-9 for v in primary]
    valid_total = scores.total_B[~scores.failed_B]
    result = {
        "n": len(examples),
        "accuracy": sum(correct) / max(len(examples), 1),
        "reward_mean": float(valid_total.mean()) if len(valid_total) else None,
        "reward_failures": int(scores.failed_B.sum()),
    }
    samples = [
        {"prompt": p, "completion": c, "reward": float(r), "correct": ok}
        for p, c, r, ok in zip(prompt_texts, completions, scores.total_B.tolist(), correct)
    ]
    return result, samples
