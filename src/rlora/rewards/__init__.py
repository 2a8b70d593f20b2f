"""Reward functions: plain callables `f(prompts, completions, **columns) -> list[float | None]`."""
