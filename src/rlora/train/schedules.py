"""Schedules of a value over training (the sampling temperature): pure functions of progress in [0, 1]."""

from __future__ import annotations

import math


def scheduled_value(kind: str, start: float, end: float | None, progress: float) -> float:
    """constant: start; linear: start -> end; cosine: half-cosine from start to end; exponential: geometric
    decay start * (end / start) ** progress (both must be > 0)."""
    if kind == "constant" or end is None:
        return start
    p = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return start + (end - start) * p
    if kind == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * p))
    if kind == "exponential":
        return start * (end / start) ** p
    raise ValueError(f"unknown schedule {kind!r}; use constant, linear, cosine or exponential")


def progress_of(step: int, total_steps: int) -> float:
    """Step 0 -> 0.0, the last step -> 1.0."""
    return step / (total_steps - 1) if total_steps > 1 else 0.0
