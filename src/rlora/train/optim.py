"""AdamW over the trainable (adapter) parameters with linear warmup then constant or cosine decay, and the one
optimizer step every recipe takes (train, sft, rm): clip, skip a non-finite update, schedule."""

from __future__ import annotations

import math
import warnings

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


_CONFIGURED = ("initial_lr", "betas", "eps", "weight_decay")  # what a param group holds of the run's settings


def load_optimizer_state(optimizer, scheduler, optimizer_state: dict, scheduler_state: dict) -> None:
    """A checkpoint's AdamW moments and step counts, under this run's settings: a resume may change train.lr, its
    schedule, betas and weight decay (docs/checkpoints.md), which load_state_dict alone would put back to the saved
    values (the config saved anew would then say one learning rate while another ran)."""
    configured = [{key: group[key] for key in _CONFIGURED} for group in optimizer.param_groups]
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)  # its step count; its factor functions stay this run's
    scheduler.base_lrs = [values["initial_lr"] for values in configured]
    for group, values, base, factor in zip(optimizer.param_groups, configured, scheduler.base_lrs,
                                           scheduler.lr_lambdas, strict=True):
        group.update(values)
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def optimizer_step(params, optimizer, scheduler, max_grad_norm: float | None, loss: float) -> dict[str, float]:
    """Clip, step, zero. A non-finite loss or gradient skips the update (logged as skipped_update=1)."""
    if max_grad_norm is not None:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    else:
        norms = [p.grad.norm() for p in params if p.grad is not None]
        grad_norm = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
        if params and params[0].is_cuda:  # finish the update here, so step timings on a GPU are per phase
            torch.cuda.synchronize(params[0].device)
    optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # a skipped update still advances the schedule; torch warns about that
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return {"grad_norm": grad_norm, "skipped_update": int(skipped)}
