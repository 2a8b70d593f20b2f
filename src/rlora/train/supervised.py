"""What `rlora sft` and `rlora rm` share: the checks before any model loads, micro-batches, and the step loop
(one optimizer step per batch, train/optim.py, as `rlora train` takes)."""

from __future__ import annotations

import time
from collections.abc import Callable

from rlora.config import check_config, check_init_from_keys, check_launch
from rlora.data.files import check_data_file
from rlora.logging.console import progress_bar
from rlora.models.loading import check_adapter_folder, quantization_config, resolve_device
from rlora.train.distributed import World, on_rank_zero
from rlora.train.optim import optimizer_step
from rlora.train.outputs import RunDir, default_output_dir


def check_inputs(cfg, command: str = "sft", world: World = World()) -> RunDir:
    """What can be checked before the tokenizer and model load (`rlora sft` and `rlora rm` configs)."""
    check_config(cfg)  # load_config did it; a config built in Python gets it here
    check_launch(cfg, world.size)  # the refusal table's rows that read the number of ranks
    if cfg.train.output_dir is None:
        cfg.train.output_dir = default_output_dir(command)
    run_dir = RunDir(cfg.train.output_dir, cfg.train.overwrite, writer=world.is_main)
    on_rank_zero(world, run_dir.check_writable)
    for path in (cfg.data.path, cfg.data.eval_path):
        if path is not None:
            check_data_file(path)
    quantization_config(cfg.model)
    resolve_device(cfg.model.device)  # a GPU asked for but absent: say so before loading anything
    if cfg.lora.init_from:
        check_adapter_folder(cfg.lora.init_from, command=command)
        check_init_from_keys(cfg.lora)
    return run_dir


def micro_batches(rows: list, size: int) -> list[list]:
    return [rows[i: i + size] for i in range(0, len(rows), size)]


def optimizer_steps(label: str, steps: int, params, optimizer, scheduler, max_grad_norm: float | None,
                    one_batch: Callable[[int], dict], held_out: Callable[[], dict] | None, eval_every: int,
                    run_dir: RunDir, summary: dict, describe: Callable[[dict], str]) -> None:
    """The step loop `rlora sft` and `rlora rm` share: one_batch(step) accumulates the batch's gradient and
    returns its metrics (a "loss" among them); then the optimizer step every recipe takes (a non-finite loss or
    gradient skips the update, logged as skipped_update=1); held_out() (eval mode) every eval_every steps and at the
    end; one metrics.jsonl line and one progress update per step."""
    with progress_bar(label, steps) as update:
        for step in range(steps):
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
            update(step + 1, f"{describe(metrics)}  {metrics['step_s']:.1f}s/step")
