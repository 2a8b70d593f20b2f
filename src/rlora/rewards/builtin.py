"""Built-in reward functions, all with TRL's signature `f(prompts, completions, **columns) -> list`."""

from __future__ import annotations

import re
from fractions import Fraction
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


def closeness_reward(prompts, completions, answer, extract: str = "auto", **_columns) -> list[float]:
    """Partial credit for a numeric answer t: max(0, 1 - |x - t| / max(|t|, 1)) for the completion's number x
    (extracted as `gym` does), and 0 when x and t have opposite signs. 1 when exact, less the further off relative to
    the answer's size, 0 without a number, so a constant guess earns little. Numbers are parsed exactly (integers,
    decimals, `a/b`: `numeric_answer`) and only the score is rounded to a float.

    Meant as shaping beside an exact verifier, at a small weight: GRPO divides a group's advantages by its rewards'
    spread, so where no completion of a group is exactly right, near misses still rank above far ones and the
    group teaches something, while in groups with a right answer the exact reward dominates."""
    scores = []
    for completion, gold in zip(completions, answer):
        target = numeric_answer(str(gold))
        if target is None:
            raise ValueError(f"the closeness reward needs a numeric `answer` column, got {gold!r}")
        value = numeric_answer(extract_answer(completion, extract))
        if value is None or value * target < 0:
            scores.append(0.0)
            continue
        scores.append(float(max(Fraction(0), 1 - abs(value - target) / max(abs(target), Fraction(1)))))
    return scores


# A plain number (1,234 / -0.5 / 2.5e3: commas only between groups of three digits, so a list "1,2,3" or a European
# decimal "1,5" is not one; an exponent of at most 3 digits, so that parsing cannot build a huge integer) or a
# fraction a/b. The minus sign may be U+2212, as some models and datasets write it.
_EXACT_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?|[-+]?\d+ */ *\d+")
# An answer longer than this is not read as a number: Python's string-to-int conversion is quadratic, and its own digit
# limit (4300 by default) can be lifted with sys.set_int_max_str_digits, so the bound is this function's own.
_MAX_NUMBER_CHARS = 1000  # ANSWER_FORMS says so in its refusal


def numeric_answer(text: str) -> Fraction | None:
    """`text` as an exact number, or None when it is not one (words, a blank, a division by zero, over
    _MAX_NUMBER_CHARS characters)."""
    text = text.strip().replace("\u2212", "-")
    if len(text) > _MAX_NUMBER_CHARS or not _EXACT_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text.replace(",", "").replace(" ", ""))
    except (ZeroDivisionError, ValueError):
        return None


def code_reward(prompts, completions, **columns) -> list[float]:
    """Runs the completion's program against its unit tests in a sandboxed process (rewards/code.py)."""
    return run_code(prompts, completions, **columns)


# Built-ins that score against the answer's value, not just its text: the form every row's answer must have (a
# parser returning None for a bad one) and how to say it. `rlora train` checks each row before the model loads.
ANSWER_FORMS = {"closeness": (numeric_answer, "a number (integer, decimal or a/b, at most 1000 characters)")}

BUILTIN_REWARDS = {"gym": gym_reward, "format": format_reward, "math": math_reward, "code": code_reward,
                   "closeness": closeness_reward}
