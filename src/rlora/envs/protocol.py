"""The Environment protocol: what a multi-turn task implements (plain Python, one object per episode).

An episode starts with `reset(row)`, which returns the first chat messages (the dataset row's prompt, a game's
opening, ...). The policy answers; `step(assistant_text)` returns the messages that follow (a tool's result, the
game's reply) or says the episode is done, with this turn's reward. The runner (envs/episodes.py) renders the
messages through the chat template and trains only on the tokens the policy sampled.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StepResult:
    messages: list[dict[str, str]] = field(default_factory=list)  # appended to the conversation (empty when done)
    reward: float = 0.0  # this turn's reward; an episode's environment reward is the sum over its turns
    done: bool = False  # the episode ends after this turn (its messages, if any, are not shown to the policy)
    info: dict[str, Any] = field(default_factory=dict)  # counters the runner sums, e.g. {"tool_calls": 1}


class Environment(Protocol):
    """One episode's state. A factory (the config's `env.fn`) makes a fresh one per episode."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The episode's first messages, e.g. [{"role": "user", "content": ...}]. `row`: the dataset row (its
        `prompt` and the other columns: answer, task entry, ...)."""
        ...

    def step(self, assistant_text: str) -> StepResult:
        """The policy's reply (its text, special tokens removed) -> what follows."""
        ...


class EnvironmentFault(Exception):
    """The environment broke the protocol (an exception, a timeout, malformed output): its episode fails."""


def checked_messages(value: Any, where: str) -> list[dict[str, str]]:
    """`value` as a list of {"role": str, "content": str} messages, or EnvironmentFault saying what is wrong."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise EnvironmentFault(f"{where} must return a list of message dicts, got {type(value).__name__}")
    for m in value:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EnvironmentFault(f"{where} returned a message without a str 'role' and 'content': {m!r:.200}")
    return [dict(m) for m in value]


def checked_result(value: Any) -> StepResult:
    if not isinstance(value, StepResult):
        raise EnvironmentFault(f"step() must return rlora.envs.protocol.StepResult, got {type(value).__name__}")
    if isinstance(value.reward, bool) or not isinstance(value.reward, numbers.Real) or not math.isfinite(value.reward):
        raise EnvironmentFault(f"step() returned reward {value.reward!r}: a finite number is needed")
    messages = checked_messages(value.messages, "step()")
    if not value.done and not messages:
        raise EnvironmentFault("step() returned no messages for an episode that is not done")
    return StepResult(messages, float(value.reward), bool(value.done), dict(value.info))
