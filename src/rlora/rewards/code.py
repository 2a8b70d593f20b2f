"""Rewards that run code: a completion's program plus its unit tests, executed in the sandbox
(rewards/sandbox.py); 1.0 when every test passes, else 0.0. HumanEval-style columns: `test` (code that
defines and/or runs checks), `entry_point` (the function under test, called as `check(entry_point)` when
given) and `code_prompt` (the function header the model completes)."""

from __future__ import annotations

import re

from rlora.rewards.sandbox import Limits, run_programs

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*)$", re.DOTALL | re.IGNORECASE)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a completion: the last fenced block that defines entry_point (a usage example after the
    solution does not hide it), else the last fenced block, else the text after an unclosed fence (a
    completion cut at the length limit), else the whole completion."""
    blocks = _FENCED.findall(completion)
    if blocks:
        defining = [b for b in blocks if entry_point and _defines(b, entry_point)]
        return (defining or blocks)[-1]
    opened = _OPEN_FENCE.search(completion)
    return opened.group(1) if opened else completion


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def build_program(completion: str, test: str, entry_point: str | None = None, code_prompt: str | None = None) -> str:
    """code_prompt + the completion's code (a full definition of entry_point, or the continuation of the
    prompt's function body), then the tests, then `check(entry_point)` when an entry point is given. A
    header with only a docstring is a valid function, so a completion that redefines it simply wins."""
    code = extract_code(completion, entry_point)
    if code_prompt:
        code = code_prompt + ("\n" + code if entry_point and _defines(code, entry_point) else code)
    program = code + "\n\n" + test + "\n"
    if entry_point:
        program += f"\ncheck({entry_point})\n"
    return program


def code_reward(prompts, completions, test, entry_point=None, code_prompt=None, timeout_s: float = 5.0,
                memory_mb: int = 512, **_columns) -> list[float]:
    """1.0 where the completion's program passes its tests in the sandbox (time and memory limited)."""
    n = len(completions)
    entry_point = entry_point or [None] * n
    code_prompt = code_prompt or [None] * n
    programs = [build_program(c, t, e, p) for c, t, e, p in zip(completions, test, entry_point, code_prompt)]
    outcomes = run_programs(programs, Limits(timeout_s=timeout_s, memory_mb=memory_mb))
    return [1.0 if outcome.passed else 0.0 for outcome in outcomes]
