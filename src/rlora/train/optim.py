"""AdamW over the trainable (adapter) parameters with linear warmup then constant or cosine decay."""

from __future__ import annotations

import math

import torch

from rlora.config import OptimizerConfig


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the base learning rate for optimiser step `step` (0-based)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps, 1)
    progress = min((step - warmup_steps) / decay_steps, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimizerConfig, total_updates: int):
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_updates, cfg.warmup_steps, cfg.schedule)
    )
    return optimizer, scheduler
