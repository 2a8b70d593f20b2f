"""Built-in reasoning-gym tasks: generated problems with their own verifiers.

Each Example carries the columns the `gym` reward needs: `task` (the generator name), `entry` (the raw
problem, scored by reasoning-gym's `score_answer`) and `answer`.
"""

from __future__ import annotations

import difflib
from typing import Any

from rlora.errors import UserError
from rlora.types import Example


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_task(name: str, task_args: dict[str, Any]) -> None:
    """Fail fast (before any model loads) on an unknown task or bad generator arguments."""
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else " (see reasoning_gym.factory.DATASETS)"
        raise UserError(f"unknown data.task '{name}'{hint}")
    make_task_examples(name, task_args, size=1, seed=0)


def make_task_examples(name: str, task_args: dict[str, Any], size: int, seed: int) -> list[Example]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **task_args)
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(f"data.task_args do not fit task '{name}': {err}") from None
    examples = []
    for entry in dataset:
        columns = {"task": name, "entry": entry, "answer": str(entry["answer"])}
        examples.append(Example(prompt=entry["question"], columns=columns))
    return examples
