"""Evaluation on held-out prompts: n completions per prompt scored by the run's reward functions.

A completion is *correct* when the first reward function gives its full score (1.0).
- accuracy = share of correct completions (with n = 1 greedy completion: share of prompts solved);
- pass@k = mean over prompts of the unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code"), c = correct completions among the prompt's n;
- reward_mean = mean weighted total reward of the completions whose rewards did not fail.
"""

from __future__ import annotations

import math

import torch

from rlora.rewards.scoring import RewardFn, score_completions
from rlora.types import Example, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k completions drawn without replacement from n (c of them correct) is
    correct: 1 - C(n-c, k)/C(n, k), computed as a product so large n cannot overflow."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def columns_of(examples: list[Example], repeat: int = 1) -> dict[str, list]:
    names = sorted({name for ex in examples for name in ex.columns})
    return {name: [ex.columns.get(name) for ex in examples for _ in range(repeat)] for name in names}


def eval_sampling(cfg) -> SamplingParams:
    """The evaluation's sampling settings from an RLConfig: eval.* with the rollout's stop strings."""
    ev = cfg.eval
    return SamplingParams(max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens, temperature=ev.temperature or 1.0,
                          top_p=ev.top_p, greedy=ev.temperature == 0, stop=tuple(cfg.rollout.stop))


def _is_correct(value) -> bool:
    return value is not None and math.isfinite(value) and value >= 1.0 - 1e-9


@torch.no_grad()
def evaluate(model, generator, examples: list[Example], prompt_ids: list[list[int]], prompt_texts: list[str],
             rewards: list[RewardFn], params: SamplingParams, batch_size: int, num_samples: int = 1,
             pass_k: tuple[int, ...] = (), seed: int = 0, progress=None, policy: int | None = None,
             ) -> tuple[dict, list[dict]]:
    """-> (metrics, one row per completion). batch_size counts prompts per sampler call; sampling is seeded
    by `seed` (the built-in engine's draws depend on the prompt's position in its batch, so keep
    batch_size fixed to reproduce a result). policy: which policy adapter samples, on a model with several."""
    [completions] = sample_completions(model, generator, prompt_ids, params, batch_size, num_samples, seed, progress,
                                       None if policy is None else [policy])
    return score_evaluation(examples, prompt_texts, rewards, completions, num_samples, pass_k)


@torch.no_grad()
def evaluate_policies(model, generator, examples: list[Example], prompt_ids: list[list[int]], prompt_texts: list[str],
                      rewards: list[RewardFn], params: SamplingParams, batch_size: int, policies: list[int] | None,
                      num_samples: int = 1, pass_k: tuple[int, ...] = (), seed: int = 0, progress=None,
                      ) -> list[tuple[dict, list[dict]]]:
    """evaluate() of each of several policy adapters (models/multi_lora.py), sampled together: every sampler
    call decodes each policy's rows of the same prompts in one batch, with the draws each policy gets when it is
    evaluated alone (same seed, same key per prompt). -> [(metrics, rows)] in the order of `policies` (None: a model
    with one policy adapter, evaluated as evaluate() does: one result)."""
    per_policy = sample_completions(model, generator, prompt_ids, params, batch_size, num_samples, seed, progress,
                                    policies)
    return [score_evaluation(examples, prompt_texts, rewards, completions, num_samples, pass_k)
            for completions in per_policy]


def sample_completions(model, generator, prompt_ids: list[list[int]], params: SamplingParams, batch_size: int,
                       num_samples: int, seed: int, progress, policies: list[int] | None) -> list[list[str]]:
    """num_samples completions of every prompt, per policy (one list without policies). Each call samples
    batch_size prompts (for every policy: K x batch_size prompts); a prompt's draws depend on its position in
    its policy's batch, as when that policy is sampled alone. progress(prompts done, counted per policy)."""
    lanes = [None] if policies is None else list(policies)
    completions: list[list[str]] = [[] for _ in lanes]
    for start in range(0, len(prompt_ids), batch_size):
        batch = prompt_ids[start:start + batch_size]
        if policies is None:
            rollout = generator.sample(model, batch, num_samples, params, seed=seed + start)
        else:
            rollout = generator.sample(model, batch * len(lanes), num_samples, params, seed=seed + start,
                                       keys=list(range(len(batch))) * len(lanes),
                                       policies=[policy for policy in lanes for _ in batch])
        rows = len(batch) * num_samples
        for lane, out in enumerate(completions):
            out.extend(rollout.completions[lane * rows:(lane + 1) * rows])
        if progress is not None:
            progress(len(completions[0]) // num_samples * len(lanes))
    return completions


def score_evaluation(examples: list[Example], prompt_texts: list[str], rewards: list[RewardFn], completions: list[str],
                     num_samples: int, pass_k: tuple[int, ...]) -> tuple[dict, list[dict]]:
    """Score num_samples completions per prompt -> (metrics, one row per completion)."""
    texts_B = [t for t in prompt_texts for _ in range(num_samples)]
    scores = score_completions(rewards, texts_B, completions, columns_of(examples, repeat=num_samples))
    correct_B = [_is_correct(v) for v in scores.per_fn[rewards[0].name]]
    correct_per_prompt = [sum(correct_B[i * num_samples:(i + 1) * num_samples]) for i in range(len(examples))]
    valid_total = scores.total_B[~scores.failed_B]
    result = {
        "n": len(examples),
        "samples_per_prompt": num_samples,
        "accuracy": sum(correct_B) / max(len(correct_B), 1),
        "reward_mean": float(valid_total.mean()) if len(valid_total) else None,
        "reward_failures": int(scores.failed_B.sum()),
    }
    for k in pass_k:
        result[f"pass@{k}"] = sum(pass_at_k(num_samples, c, k) for c in correct_per_prompt) / max(len(examples), 1)
    samples = [
        {"prompt_index": i // num_samples, "sample": i % num_samples, "prompt": texts_B[i], "completion": completions[i],
         "reward": float(scores.total_B[i]), **{f"reward/{name}": values[i] for name, values in scores.per_fn.items()},
         "correct": correct_B[i]}
        for i in range(len(completions))
    ]
    return result, samples
