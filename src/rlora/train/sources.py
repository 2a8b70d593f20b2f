"""Where a step's rows come from: one completion per sample (prompt -> completion), or an episode of several turns
with an environment (envs/). Both turn prompts into a scored Rollout, so the step, the collector (adaptive and
dynamic sampling), replay, several policies and every algorithm run unchanged on either."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rlora.data.prompts import prompt_text
from rlora.config import RLConfig
from rlora.errors import UserError
from rlora.envs.episodes import EpisodeLimits, EpisodeRunner
from rlora.envs.protocol import Environment
from rlora.envs.registry import EnvFactory
from rlora.envs.render import EpisodeRenderer, tools_of
from rlora.models.loading import TokenizerInfo
from rlora.rewards.scoring import RewardFn, Scores, score_completions
from rlora.rollout.generator import Generator
from rlora.types import Example, Rollout, SamplingParams


def columns_of(examples: list[Example], repeat: int = 1) -> dict[str, list]:
    """The examples' extra columns (answer, task entry, ...) as reward functions take them, each row `repeat` times."""
    names = sorted({name for ex in examples for name in ex.columns})
    return {name: [ex.columns.get(name) for ex in examples for _ in range(repeat)] for name in names}


class RolloutSource(Protocol):
    correct_by: str  # the per_fn score whose full marks (1.0) make a row correct in evaluations

    def sample(self, model, examples: list[Example], prompt_ids: list[list[int]], G: int,
               params: Sequence[SamplingParams], seeds: int | Sequence[int], keys: Sequence[int],
               policies: Sequence[int] | None) -> tuple[Rollout, Scores, float]:
        """G rows per example (prompt-major), scored, and the seconds spent in reward functions; arguments as
        Generator.sample takes them."""
        ...

    def take_metrics(self) -> dict[int, dict]:
        """Each policy's (by index) metrics gathered since the last call (this step's), e.g. turns per episode."""
        ...


class Completions:
    """One sampled completion per row, scored by the reward functions."""

    def __init__(self, generator: Generator, rewards: list[RewardFn]):
        self.generator, self.rewards = generator, rewards
        self.correct_by = rewards[0].name

    def sample(self, model, examples, prompt_ids, G, params, seeds, keys, policies) -> tuple[Rollout, Scores, float]:
        rollout = self.generator.sample(model, prompt_ids, G, list(params), seeds, keys=keys, policies=policies)
        t0 = time.perf_counter()
        texts = [prompt_text(ex) for ex in examples for _ in range(G)]
        scores = score_completions(self.rewards, texts, rollout.completions, columns_of(examples, repeat=G))
        return rollout, scores, time.perf_counter() - t0

    def take_metrics(self) -> dict[int, dict]:
        return {}


def combine(env_scores: Scores, fn_scores: Scores | None) -> Scores:
    """The environment's reward (per_fn 'env') plus the reward functions' weighted total; failed if either failed."""
    if fn_scores is None:
        return env_scores
    failed_B = env_scores.failed_B | fn_scores.failed_B
    total_B = torch.where(failed_B, torch.nan, env_scores.total_B.nan_to_num(0.0) + fn_scores.total_B.nan_to_num(0.0))
    return Scores(total_B, {**env_scores.per_fn, **fn_scores.per_fn}, failed_B, env_scores.errors + fn_scores.errors)


class Episodes:
    """An episode per row: `make_env()` gives each its environment, the runner plays all of them turn by turn.
    Its reward is the environment's (summed over turns) plus the reward functions' on the final reply; reward
    functions get the conversation as the `messages` column."""

    COUNTERS = ("turns", "env_tokens")

    def __init__(self, runner: EpisodeRunner, make_env: Callable[[], Environment], rewards: list[RewardFn]):
        self.runner, self.make_env, self.rewards = runner, make_env, rewards
        self.correct_by = rewards[0].name if rewards else "env"
        self._metrics: dict[int, dict[str, float]] = {}  # per policy index

    def sample(self, model, examples, prompt_ids, G, params, seeds, keys, policies) -> tuple[Rollout, Scores, float]:
        rows = [{"prompt": ex.prompt, **ex.columns} for ex in examples]
        count = len(examples)
        seeds = [seeds] * count if isinstance(seeds, int) else list(seeds)
        batch = self.runner.run(model, self.make_env, rows, G, params, seeds, keys, policies)
        rollout, t0 = batch.rollout, time.perf_counter()
        env_rewards = [None if failed else float(r) for r, failed in zip(batch.env_rewards_B, batch.failed_B)]
        env_scores = Scores(batch.env_rewards_B, {"env": env_rewards}, batch.failed_B.clone(), batch.errors)
        fn_scores = None
        if self.rewards:
            texts = [prompt_text(ex) for ex in examples for _ in range(G)]
            columns = columns_of(examples, repeat=G) | {"messages": batch.messages}
            fn_scores = score_completions(self.rewards, texts, rollout.completions, columns)
        self._count(batch, G, policies)
        return rollout, combine(env_scores, fn_scores), time.perf_counter() - t0  # the environments' time: sampling

    def _count(self, batch, G: int, policies: Sequence[int] | None) -> None:
        for b, ep in enumerate(batch.episodes):
            m = self._metrics.setdefault(0 if policies is None else policies[b // G], {})
            # the environment's own counters (step() info) may not take the runner's names
            own = {(f"env_{name}" if name in RUNNER_COUNTS else name): value for name, value in ep.counters.items()}
            counts = {"episodes": 1, "turns": ep.turns, f"episodes_{ep.status}": 1,
                      "env_tokens": len(ep.tokens) - sum(ep.policy_mask), **own}
            for name, value in counts.items():
                m[name] = m.get(name, 0) + value

    def take_metrics(self) -> dict[int, dict]:
        """Per policy, over this step's sampled episodes (`episodes`): the means of turns, environment tokens and
        step() counters (e.g. tool_calls) and the shares of episodes done, truncated and failed, under episode/.
        (Merged over ranks as means weighted by `episodes`; a rank without some counter counts it 0.)"""
        taken, self._metrics = self._metrics, {}
        return {policy: self._summary(m) for policy, m in taken.items()}

    @staticmethod
    def _summary(m: dict[str, float]) -> dict:
        episodes = m.pop("episodes")
        out = {"episodes": episodes, **{f"episode/{status}_frac": 0.0 for status in ("done", "truncated", "failed")}}
        for name, value in m.items():
            status = name.removeprefix("episodes_")
            out[f"episode/{status}_frac" if status != name else f"episode/{name}_mean"] = value / episodes
        return out


RUNNER_COUNTS = ("episodes", "turns", "env_tokens", "episodes_done", "episodes_truncated", "episodes_failed")


def episode_renderer(tokenizer, make_env: EnvFactory) -> EpisodeRenderer:
    """The renderer of this environment's episodes (its tools described), its template checked: a template that
    cannot render episodes at all is one line before training, not a failure of every episode."""
    renderer = EpisodeRenderer(tokenizer, *tools_of(make_env()))
    renderer.check_template()
    return renderer


def longest_context(cfg: RLConfig, renderer: EpisodeRenderer | None, prompt_ids: list[list[int]]) -> int:
    """The most tokens a row can reach: a prompt and its completion, or an episode's first prompt (the prompt with the
    tools' description) and env.max_total_tokens (the sampler checks it against the model's limits)."""
    prompt = max(len(p) for p in prompt_ids)
    if renderer is None:
        return prompt + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens or 0)
    described = len(renderer.first_prompt([{"role": "user", "content": ""}]))  # the template's and the tools' share
    return prompt + described + cfg.env.max_total_tokens


def check_context(cfg: RLConfig, renderer: EpisodeRenderer | None, prompt_ids: list[list[int]],
                  max_positions: int | None) -> None:
    """Refuse, before the model loads, a completion budget that cannot fit the model's positions with the longest
    prompt: past them the model is out of its trained range, and the sampler's KV cache, sized for the budget, may
    take all the memory first (a one-line error instead of a run killed for memory). max_positions: the model
    config's max_position_embeddings (None: not stated, nothing to check)."""
    if not max_positions or not prompt_ids:
        return
    need = longest_context(cfg, renderer, prompt_ids)
    if need <= max_positions:
        return
    if renderer is not None:
        key, budget = "env.max_total_tokens", cfg.env.max_total_tokens
    elif (cfg.eval.max_new_tokens or 0) > cfg.rollout.max_new_tokens:
        key, budget = "eval.max_new_tokens", cfg.eval.max_new_tokens
    else:
        key, budget = "rollout.max_new_tokens", cfg.rollout.max_new_tokens
    room = max_positions - (need - budget)
    fix = f"set {key} <= {room}" if room > 0 else "shorten the prompts"
    raise UserError(f"{key}={budget} does not fit the model's {max_positions} positions after the longest prompt "
                    f"({need - budget} tokens): {fix}")


def rollout_source(cfg: RLConfig, generator: Generator, tok: TokenizerInfo, rewards: list[RewardFn],
                   make_env: EnvFactory | None, renderer: EpisodeRenderer | None) -> RolloutSource:
    """Completions, or with env (and its renderer): episodes played turn by turn through the same generator."""
    if make_env is None:
        return Completions(generator, rewards)
    limits = EpisodeLimits(cfg.env.max_turns, cfg.env.max_total_tokens, cfg.env.step_timeout_s)
    return Episodes(EpisodeRunner(generator, renderer, tok.eos_ids, tok.pad_id, limits), make_env, rewards)
