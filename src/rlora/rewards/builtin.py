"""Built-in reward functions, all with TRL's signature `f(prompts, completions, **columns) -> list`."""

from __future__ import annotations

import re
from functools import lru_cache

from rlora.rewards.code import code_reward as run_code

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?")


def extract_answer(text: str, mode: str = "auto") -> str:
    """The answer part of a completion.

    answer_tag: text inside the last <answer>...</answer>; last_number: the last number written;
    auto: the tag if present, else the last number, else the whole text stripped. Small models rarely
    write tags on their own, so `auto` falls back to the last number.
    """
    if mode in ("auto", "answer_tag"):
        tags = _ANSWER_TAG.findall(text)
        if tags:
            return tags[-1].strip()
        if mode == "answer_tag":
            return ""
    if mode in ("auto", "last_number"):
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", "").replace("−", "-").lstrip("+")
        if mode == "last_number":
            return ""
    if mode not in ("auto", "answer_tag", "last_number", "none"):
        raise ValueError(f"unknown extract mode {mode!r}; use auto, answer_tag, last_number or none")
    return text.strip()


@lru_cache(maxsize=None)
def _gym_scorer(task: str):
    import reasoning_gym  # ~2 s: only runs with a gym task import it

    return reasoning_gym.get_score_answer_fn(task)


def gym_reward(prompts, completions, task, entry, extract: str = "auto", **_columns) -> list[float]:
    """reasoning-gym's own verifier on the extracted answer: a score in [0, 1]."""
    return [
        float(_gym_scorer(t)(extract_answer(c, extract), e)) for c, t, e in zip(completions, task, entry)
    ]


def format_reward(prompts, completions, pattern: str = r"<answer>.*?</answer>", **_columns) -> list[float]:
    """1.0 where the completion contains a match of `pattern` (regex, DOTALL), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)
    return [1.0 if regex.search(c) else 0.0 for c in completions]


def math_reward(prompts, completions, answer, **_columns) -> list[float]:
    """1.0 where math-verify finds the completion's final answer equal to the reference `answer`."""
    from math_verify import parse, verify  # ~0.8 s: only runs with the math reward pay it

    scores = []
    for completion, gold in zip(completions, answer):
        gold_parsed = parse(str(gold))
        if not gold_parsed:
            raise ValueError(f"math-verify cannot parse the reference answer {gold!r}")
        scores.append(1.0 if verify(gold_parsed, parse(completion)) else 0.0)
    return scores


def code_reward(prompts, completions, **columns) -> list[float]:
    """Runs the completion's program against its unit tests in a sandboxed process (rewards/code.py)."""
    return run_code(prompts, completions, **columns)


BUILTIN_REWARDS = {"gym": gym_reward, "format": format_reward, "math": math_reward, "code": code_reward}
