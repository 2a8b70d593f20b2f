"""Evaluation on held-out prompts: n completions (or episodes) per prompt scored by the run's reward functions.

A completion is *correct* when the first reward function gives its full score (1.0); an episode without reward
functions, when its environment's reward is 1.0 or more.
- accuracy = share of correct completions (with n = 1 greedy completion: share of prompts solved);
- pass@k = mean over prompts of the unbiased estimator 1 - C(n - c, k) / C(n, k) (Chen et al. 2021,
  "Evaluating Large Language Models Trained on Code"), c = correct completions among the prompt's n;
- reward_mean = mean weighted total reward of the completions whose rewards did not fail.
"""

from __future__ import annotations

import math

import torch

from rlora.rewards.scoring import Scores
from rlora.train.sources import RolloutSource
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


def eval_sampling(cfg) -> SamplingParams:
    """The evaluation's sampling settings from an RLConfig: eval.* with the rollout's stop strings."""
    ev = cfg.eval
    return SamplingParams(max_new_tokens=ev.max_new_tokens or cfg.rollout.max_new_tokens, temperature=ev.temperature or 1.0,
                          top_p=ev.top_p, greedy=ev.temperature == 0, stop=tuple(cfg.rollout.stop))


def _is_correct(value) -> bool:
    return value is not None and math.isfinite(value) and value >= 1.0 - 1e-9


@torch.no_grad()
def evaluate(model, source: RolloutSource, examples: list[Example], prompt_ids: list[list[int]], prompt_texts: list[str],
             params: SamplingParams, batch_size: int, num_samples: int = 1, pass_k: tuple[int, ...] = (), seed: int = 0,
             progress=None, policy: int | None = None) -> tuple[dict, list[dict]]:
    """-> (metrics, one row per completion or episode). source: completions or episodes (train/sources.py), which
    scores them too. batch_size counts prompts per sampler call; sampling is seeded by `seed` (the built-in
    engine's draws depend on the prompt's position in its batch, so keep batch_size fixed to reproduce a result).
    policy: which policy adapter samples, on a model with several."""
    [(result, rows)] = evaluate_policies(model, source, examples, prompt_ids, prompt_texts, params, batch_size,
                                         None if policy is None else [policy], num_samples, pass_k, seed, progress)
    return result, rows


@torch.no_grad()
def evaluate_policies(model, source: RolloutSource, examples: list[Example], prompt_ids: list[list[int]],
                      prompt_texts: list[str], params: SamplingParams, batch_size: int, policies: list[int] | None,
                      num_samples: int = 1, pass_k: tuple[int, ...] = (), seed: int = 0, progress=None,
                      ) -> list[tuple[dict, list[dict]]]:
    """evaluate() of each of several policy adapters (models/multi_lora.py), sampled together: every sampler
    call decodes each policy's rows of the same prompts in one batch, with the draws each policy gets when it is
    evaluated alone (same seed, same key per prompt). -> [(metrics, rows)] in the order of `policies` (None: a model
    with one policy adapter, evaluated as evaluate() does: one result)."""
    lanes = [None] if policies is None else list(policies)
    source.take_metrics()  # counters of earlier calls are not this evaluation's
    completions: list[list[str]] = [[] for _ in lanes]
    scores: list[list[Scores]] = [[] for _ in lanes]
    for start in range(0, len(prompt_ids), batch_size):
        batch = list(range(start, min(start + batch_size, len(prompt_ids))))
        rollout, batch_scores, _ = source.sample(
            model, [examples[i] for i in batch] * len(lanes), [prompt_ids[i] for i in batch] * len(lanes), num_samples,
            [params] * len(batch) * len(lanes), seed + start, list(range(len(batch))) * len(lanes),
            None if policies is None else [policy for policy in lanes for _ in batch])
        rows = len(batch) * num_samples
        for lane in range(len(lanes)):
            completions[lane].extend(rollout.completions[lane * rows:(lane + 1) * rows])
            scores[lane].append(batch_scores.select(list(range(lane * rows, (lane + 1) * rows))))
        if progress is not None:
            progress(len(completions[0]) // num_samples * len(lanes))
    episodes = source.take_metrics()  # episodes: turns, tool calls, ... of each policy (by index; alone: 0)
    results = []
    for lane, lane_completions, lane_scores in zip(lanes, completions, scores):
        metrics, rows = score_evaluation(examples, prompt_texts, source.correct_by, lane_completions,
                                         Scores.concat(lane_scores), num_samples, pass_k)
        results.append((metrics | episodes.get(lane or 0, {}), rows))
    return results


def score_evaluation(examples: list[Example], prompt_texts: list[str], correct_by: str, completions: list[str],
                     scores: Scores, num_samples: int, pass_k: tuple[int, ...]) -> tuple[dict, list[dict]]:
    """Scored completions, num_samples per prompt -> (metrics, one row per completion). A completion is correct
    when the `correct_by` reward gives it full marks."""
    texts_B = [t for t in prompt_texts for _ in range(num_samples)]
    correct_B = [_is_correct(v) for v in scores.per_fn[correct_by]]
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
