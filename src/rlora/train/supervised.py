"""What `rlora sft` and `rlora rm` share: the checks before any model loads, micro-batches, and the step loop
(one optimizer step per batch, train/optim.py, as `rlora train` takes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from rlora.config import check_config, check_init_from_keys, check_launch
from rlora.data.files import check_data_file
from rlora.logging.console import progress_bar
from rlora.models.loading import check_adapter_folder, quantization_config, resolve_device
from rlora.train.distributed import World, on_rank_zero
from rlora.train.optim import optimizer_step
from rlora.train.outputs import RunDir, default_output_dir
from rlora.train.resume import check_fresh_folder, check_resume_target, find_checkpoint


def check_inputs(cfg, command: str = "sft", world: World = World()) -> tuple[RunDir, Path | None]:
    """What can be checked before the tokenizer and model load (`rlora sft` and `rlora rm` configs) -> the run
    folder and the checkpoint train.resume names (None: a fresh run)."""
    check_config(cfg)  # load_config did it; a config built in Python gets it here
    check_launch(cfg, world.size)  # the refusal table's rows that read the number of ranks
    if hasattr(cfg.train, "resume"):
        check_resume_target(cfg)  # before a default folder is chosen
    if cfg.train.output_dir is None:
        cfg.train.output_dir = default_output_dir(command)
    run_dir = RunDir(cfg.train.output_dir, cfg.train.overwrite, writer=world.is_main)
    resume_from = find_checkpoint(cfg) if hasattr(cfg.train, "resume") else None
    if resume_from is None or not run_dir.holds_checkpoint(resume_from):
        on_rank_zero(world, lambda: check_fresh_folder(cfg, run_dir) if hasattr(cfg.train, "resume")
                     else run_dir.check_writable())
    for path in (cfg.data.path, cfg.data.eval_path):
        if path is not None:
            check_data_file(path)
    quantization_config(cfg.model)
    resolve_device(cfg.model.device)  # a GPU asked for but absent: say so before loading anything
    if cfg.lora.init_from:
        check_adapter_folder(cfg.lora.init_from, command=command)
        check_init_from_keys(cfg.lora)
    return run_dir, resume_from


def micro_batches(rows: list, size: int) -> list[list]:
    return [rows[i: i + size] for i in range(0, len(rows), size)]


def optimizer_steps(label: str, steps: int, params, optimizer, scheduler, max_grad_norm: float | None,
                    one_batch: Callable[[int], dict], held_out: Callable[[], dict] | None, eval_every: int,
                    run_dir: RunDir, summary: dict, describe: Callable[[dict], str], first_step: int = 0,
                    checkpoint_every: int = 0, checkpoint: Callable[[int], None] | None = None) -> None:
    """The step loop `rlora sft` and `rlora rm` share: one_batch(step) accumulates the batch's gradient and
    returns its metrics (a "loss" among them); then the optimizer step every recipe takes (a non-finite loss or
    gradient skips the update, logged as skipped_update=1); held_out() (eval mode) every eval_every steps and at the
    end; one metrics.jsonl line and one progress update per step. A resumed run starts at first_step;
    checkpoint(done) runs every checkpoint_every steps and after the last one."""
    with progress_bar(label, steps) as update:
        update(first_step, "")
        for step in range(first_step, steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            metrics = {"step": step + 1, **one_batch(step), "lr": scheduler.get_last_lr()[0]}
            metrics |= optimizer_step(params, optimizer, scheduler, max_grad_norm, metrics["loss"])
            metrics["step_s"] = time.perf_counter() - start
            if held_out is not None and (step + 1 == steps or (eval_every and (step + 1) % eval_every == 0)):
                held = held_out()
                metrics |= held
                summary |= held
            run_dir.append_jsonl("metrics.jsonl", metrics)
            summary["steps"], summary["last_metrics"] = step + 1, metrics
            if checkpoint is not None and checkpoint_every and (step + 1) % checkpoint_every == 0:
                checkpoint(step + 1)
            update(step + 1, f"{describe(metrics)}  {metrics['step_s']:.1f}s/step")
    if checkpoint is not None and checkpoint_every and steps % checkpoint_every:
        checkpoint(steps)  # the end is a checkpoint too: more train.steps with train.resume=auto extend the run
