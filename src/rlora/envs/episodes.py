"""Episodes of several turns, all advanced together: the sampler draws every running episode's next turn in one
call, the environments answer, finished episodes leave the batch.

The result is an ordinary Rollout, so the step, the losses and every algorithm treat an episode as one row:
the prompt is the episode's first prompt, the "completion" is everything after it (the policy's turns and the
environment's messages, as token ids exactly as sampled and rendered), and `policy_mask_BTc` marks the tokens
the policy sampled, the only ones that enter the loss, the KL and the entropy. Random keys: turn 0 draws with
the keys a single-turn run uses, so a one-turn environment samples exactly what the prompt/completion path
samples; turn t > 0 draws with keys of its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlora import deadline
from rlora.envs.protocol import Environment, EnvironmentFault, checked_messages, checked_result
from rlora.envs.render import EpisodeRenderer
from rlora.errors import first_line
from rlora.rollout.engine import RowCache
from rlora.rollout.generator import Generator
from rlora.tensors import left_padded, right_padded
from rlora.types import Rollout, SamplingParams

TURN_KEY_STRIDE = 1 << 40  # turn t's random keys are offset by t x this: no two turns of a step share a key


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # policy turns of one episode
    max_total_tokens: int  # tokens after the first prompt (the policy's and the environment's)
    step_timeout_s: float | None  # reset() and step() of the environment


@dataclass
class Episode:
    env: Environment | None  # None until made (a factory that fails leaves it None: the episode fails)
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # after the prompt: the policy's turns and the environment's
    policy_mask: list[int] = field(default_factory=list)  # 1 where the policy sampled the token
    logp: list[float] = field(default_factory=list)  # the sampler's log-prob (0 on the environment's tokens)
    # the temperature each policy token was drawn at (phase-aware sampling: its span's); None on the environment's
    temperatures: list[float | None] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    status: str = "running"  # running | done | truncated | failed
    error: str | None = None
    final_text: str = ""  # the last assistant reply (what reward functions score)
    counters: dict[str, float] = field(default_factory=dict)  # summed step() info, e.g. tool_calls
    cache: RowCache | None = None  # keys/values of its first cache.length tokens (a sampler that continues rows)

    def fail(self, message: str) -> None:
        self.status, self.error = "failed", message


@dataclass
class EpisodeBatch:
    rollout: Rollout  # B = P x G episodes, prompt-major; policy_mask_BTc marks the policy's tokens
    env_rewards_B: torch.Tensor  # float64, summed over turns; NaN where the episode failed
    failed_B: torch.Tensor  # bool: the environment broke the protocol
    errors: list[str]
    messages: list[list[dict[str, str]]]  # each episode's conversation
    episodes: list[Episode]


def _guarded(call, limits: EpisodeLimits, what: str):
    """Run an environment call under the step time limit; any fault -> EnvironmentFault with one line."""
    try:
        with deadline.time_limit(limits.step_timeout_s, f"{what} did not return within {limits.step_timeout_s} s"):
            return call()
    except EnvironmentFault:
        raise
    except deadline.TimeLimitExceeded as err:
        raise EnvironmentFault(str(err)) from None
    except Exception as err:  # noqa: BLE001 - an environment's failure ends its episode, not the run
        raise EnvironmentFault(f"{what} raised {type(err).__name__}: {first_line(err)}") from None


class EpisodeRunner:
    def __init__(self, generator: Generator, renderer: EpisodeRenderer, eos_ids: list[int], pad_id: int,
                 limits: EpisodeLimits):
        self.generator, self.renderer, self.limits = generator, renderer, limits
        self.eos_ids, self.pad_id = set(eos_ids), pad_id

    def run(self, model, make_env: Callable[[], Environment], rows: list[dict[str, Any]], G: int,
            params: Sequence[SamplingParams], seeds: Sequence[int], keys: Sequence[int],
            policies: Sequence[int] | None = None) -> EpisodeBatch:
        """G episodes of each of the P dataset rows (prompt-major), each with a fresh environment from make_env;
        params/seeds/keys/policies per prompt, as Generator.sample takes them."""
        episodes = [Episode(None) for _ in range(len(rows) * G)]
        self.with_logp = True  # every sampler call returned its log-probs (both samplers do; a test double may not)
        for b, ep in enumerate(episodes):
            self._reset(ep, make_env, rows[b // G])
        self._first_turn(model, episodes, G, params, seeds, keys, policies)
        for turn in range(1, self.limits.max_turns):
            if not any(ep.status == "running" for ep in episodes):
                break
            self._each_alone(model, episodes, turn, G, params, seeds, keys, policies)
        for ep in episodes:
            if ep.status == "running":  # its last turn was sampled at max_turns
                ep.status = "truncated"
        return self._batch(episodes, G, params)

    def _reset(self, ep: Episode, make_env: Callable[[], Environment], row: dict[str, Any]) -> None:
        try:
            ep.env = _guarded(make_env, self.limits, "the env factory")
            ep.messages = checked_messages(_guarded(lambda: ep.env.reset(row), self.limits, "reset()"), "reset()")
            if not ep.messages:
                raise EnvironmentFault("reset() returned no messages")
            ep.prompt_ids = self.renderer.first_prompt(ep.messages)
        except EnvironmentFault as err:
            ep.fail(str(err))
        except Exception as err:  # noqa: BLE001 - the template rejects these messages: this episode fails
            ep.fail(f"rendering the first messages failed: {type(err).__name__}: {err}")

    def _first_turn(self, model, episodes: list[Episode], G: int, params, seeds, keys, policies) -> None:
        """Turn 0. Where each prompt's G episodes start alike (the usual case), the prompt is sampled once with G
        samples, exactly as a single-turn step samples it; otherwise each episode alone, with the same keys."""
        groups = [episodes[i * G:(i + 1) * G] for i in range(len(episodes) // G)]
        if all(ep.status == "running" and ep.prompt_ids == group[0].prompt_ids for group in groups for ep in group):
            first = [self._turn_params(params[i], group[0]) for i, group in enumerate(groups)]
            self._sample_turn(model, episodes, G, first, seeds, keys, policies)
        else:
            self._each_alone(model, episodes, 0, G, params, seeds, keys, policies)

    def _each_alone(self, model, episodes: list[Episode], turn: int, G: int, params, seeds, keys, policies) -> None:
        """The running episodes' turn `turn`, each its own prompt: episode g of prompt i draws with key
        turn x TURN_KEY_STRIDE + key_i x G + g (turn 0: the row key a shared prompt's G samples get)."""
        running = [b for b, ep in enumerate(episodes) if ep.status == "running"]
        if running:
            self._sample_turn(model, [episodes[b] for b in running], 1,
                              [self._turn_params(params[b // G], episodes[b]) for b in running],
                              [seeds[b // G] for b in running],
                              [turn * TURN_KEY_STRIDE + keys[b // G] * G + b % G for b in running],
                              None if policies is None else [policies[b // G] for b in running])

    def _turn_params(self, params: SamplingParams, ep: Episode) -> SamplingParams:
        budget = max(1, min(params.max_new_tokens, self.limits.max_total_tokens - len(ep.tokens)))
        return dataclasses.replace(params, max_new_tokens=budget, min_new_tokens=min(params.min_new_tokens, budget))

    def _sample_turn(self, model, episodes: list[Episode], n: int, params, seeds, keys, policies) -> None:
        """Sample the next turn of these episodes (n > 1: each run of n episodes starts alike and shares one prompt)
        and advance them. A sampler that continues rows (the built-in engine's sample_continued) runs only the
        tokens after an episode's cache; another runs each episode's whole history again."""
        firsts = episodes[::n]
        seed = seeds[0] if len(set(seeds)) == 1 else list(seeds)  # one seed: the samplers' plain path
        # a MoLoRA sequence router routes every turn by the episode's first prompt, as the trainer routes its row
        common = dict(keys=list(keys), policies=None if policies is None else list(policies),
                      route_by=[ep.prompt_ids for ep in firsts])
        continued = getattr(self.generator, "sample_continued", None)
        if continued is None:
            rollout = self.generator.sample(model, [ep.prompt_ids + ep.tokens for ep in firsts], n, list(params), seed,
                                            **common)
        else:
            past = [ep.cache for ep in firsts] if firsts[0].cache is not None else None
            start = [0 if ep.cache is None else ep.cache.length for ep in firsts]
            prompts = [(ep.prompt_ids + ep.tokens)[cut:] for ep, cut in zip(firsts, start)]
            rollout, caches = continued(model, prompts, n, list(params), seed, past=past, **common)
            for ep, cache in zip(episodes, caches):
                ep.cache = cache
        self._advance(episodes, rollout)
        for ep in episodes:
            if ep.status != "running":
                ep.cache = None  # its memory: an episode that ended needs no more turns

    def _advance(self, episodes: list[Episode], rollout: Rollout) -> None:
        """Append each episode's sampled turn, then let its environment answer. An episode is built on the host (its
        environment answers between turns): each turn's tokens and log-probs are read back once, for all rows."""
        lengths = rollout.completion_mask_BTc.sum(-1).tolist()
        tokens = rollout.completion_ids_BTc.tolist()
        self.with_logp &= rollout.sampling_logp_BTc is not None
        logps = rollout.sampling_logp_BTc.tolist() if self.with_logp else None
        temperatures = rollout.temperature_BTc.tolist() if rollout.temperature_BTc is not None else None
        for r, ep in enumerate(episodes):
            length = lengths[r]
            turn = tokens[r][:length]
            logp = logps[r][:length] if logps is not None else [0.0] * length
            ep.tokens += turn
            ep.policy_mask += [1] * length
            ep.logp += logp
            ep.temperatures += temperatures[r][:length] if temperatures is not None else [None] * length
            ep.turns += 1
            ep.final_text = rollout.completions[r]
            ep.messages.append({"role": "assistant", "content": ep.final_text})
            if rollout.finish_reasons[r] == "length":  # cut at the turn's token budget: the episode ends here
                ep.status = "truncated"
                continue
            self._respond(ep, ended_by_eos=bool(turn) and turn[-1] in self.eos_ids, last=turn[-1] if turn else None)

    def _respond(self, ep: Episode, ended_by_eos: bool, last: int | None) -> None:
        try:
            result = checked_result(_guarded(lambda: ep.env.step(ep.final_text), self.limits, "step()"))
        except EnvironmentFault as err:
            ep.fail(str(err))
            return
        ep.reward += result.reward
        for name, value in result.info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                ep.counters[name] = ep.counters.get(name, 0.0) + value
        if result.done:
            ep.status = "done"
            return
        if ep.turns >= self.limits.max_turns:
            ep.status = "truncated"
            return
        eos_text = self.renderer.tokenizer.decode([last], skip_special_tokens=False) if ended_by_eos else ""
        try:
            follow = self.renderer.continuation(ep.messages, result.messages, ended_by_eos, eos_text)
        except Exception as err:  # noqa: BLE001 - RenderError, or the template rejects the messages: this episode
            ep.fail(f"rendering the environment's messages failed: {type(err).__name__}: {err}")
            return
        if len(ep.tokens) + len(follow) >= self.limits.max_total_tokens:  # no room left for a reply
            ep.status = "truncated"
            return
        ep.tokens += follow
        ep.policy_mask += [0] * len(follow)
        ep.logp += [0.0] * len(follow)
        ep.temperatures += [None] * len(follow)
        ep.messages += result.messages

    def _batch(self, episodes: list[Episode], G: int, params: Sequence[SamplingParams]) -> EpisodeBatch:
        for ep in episodes:
            if not ep.prompt_ids:  # failed at reset: one padding token of prompt and of completion, trained on nothing
                ep.prompt_ids, ep.tokens, ep.policy_mask, ep.logp = [self.pad_id], [self.pad_id], [0], [0.0]
                ep.temperatures = [None]
        prompt_ids_BTp, prompt_mask_BTp = left_padded([ep.prompt_ids for ep in episodes], self.pad_id)
        completion_ids_BTc, completion_mask_BTc = right_padded([ep.tokens for ep in episodes], self.pad_id)
        policy_mask_BTc, _ = right_padded([ep.policy_mask for ep in episodes], 0)
        logp_BTc = torch.zeros(completion_ids_BTc.shape)
        for b, ep in enumerate(episodes):
            logp_BTc[b, :len(ep.logp)] = torch.tensor(ep.logp)
        failed_B = torch.tensor([ep.status == "failed" for ep in episodes])
        rewards_B = torch.tensor([math.nan if ep.status == "failed" else ep.reward for ep in episodes], dtype=torch.float64)
        temperature_B = torch.tensor([1.0 if params[b // G].greedy else params[b // G].temperature
                                      for b in range(len(episodes))])
        temperature_BTc = None
        if any(p.think is not None for p in params):  # phase-aware sampling: each policy token at its span's
            # the environment's tokens take the row's temperature: they are read, never trained on
            temperature_BTc = torch.zeros(completion_ids_BTc.shape)
            for b, ep in enumerate(episodes):
                temperature_BTc[b, :len(ep.temperatures)] = torch.tensor(
                    [float(temperature_B[b]) if t is None else t for t in ep.temperatures])
        rollout = Rollout(
            prompt_ids_BTp=prompt_ids_BTp, prompt_mask_BTp=prompt_mask_BTp, completion_ids_BTc=completion_ids_BTc,
            completion_mask_BTc=completion_mask_BTc, completions=[ep.final_text for ep in episodes],
            finish_reasons=["length" if ep.status == "truncated" else "stop" for ep in episodes],
            temperature_B=temperature_B, temperature_BTc=temperature_BTc,
            sampling_logp_BTc=logp_BTc if self.with_logp else None, policy_mask_BTc=policy_mask_BTc,
        )
        errors = [f"episode {b}: {ep.error}" for b, ep in enumerate(episodes) if ep.error]
        return EpisodeBatch(rollout, rewards_B, failed_B, errors, [ep.messages for ep in episodes], episodes)
