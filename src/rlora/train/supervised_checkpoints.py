"""Checkpoints of `rlora sft` and `rlora rm`: the atomic folders of train/checkpoint.py, holding what a supervised run
needs to go on exactly where it stopped:

    weights         what the recipe trains, written and read back by its Resumable: sft's adapter/ (PEFT or MoLoRA,
                    through the adapter protocol) or, with train.full_finetune, model.safetensors; rm's reward_model/
                    (its adapter and score head)
    trainer.pt      AdamW and schedule state, every rank's RNG states (LoRA dropout draws from them; weights_only)
    state.json      the command, step, training time so far, the run's config

The batches are a function of (seed, step) (data/sft_data.py LengthGroupedOrder), so the step is the data position.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlora.config import to_yaml
from rlora.errors import UserError
from rlora.logging.console import info
from rlora.train.checkpoint import set_aside_after, write_checkpoint
from rlora.train.distributed import World, all_reduce_sums, gather_objects
from rlora.train.optim import load_optimizer_state
from rlora.train.outputs import RunDir
from rlora.train.resume import CHECKPOINTS, check_same_run, restore_rng, rng_state, safe_load


@dataclass(frozen=True)
class Resumable:
    """What a supervised recipe checkpoints besides its optimizer: which command it is, the settings a resume must
    keep (the sections and train keys that decide the batches and what a step computes), and its trained weights."""

    command: str  # "sft" or "rm": a checkpoint of one is refused by the other
    must_match: tuple[str, ...]
    save: Callable[[Path], None]  # the trained weights into a checkpoint folder
    load: Callable[[Path], None]  # ... and back into the live model (a one-line UserError where they do not fit)


def check_supervised_resume(cfg, folder: Path, steps: int, weights: Resumable) -> dict:
    """Before the model loads: the checkpoint is this command's, of this run's settings, not past its `steps`."""
    return check_same_run(cfg, folder, weights.must_match, steps, command=weights.command)


def save_supervised_state(run_dir: RunDir, step: int, cfg, weights: Resumable, optimizer, scheduler, train_s: float,
                          world: World = World()) -> None:
    """The state after `step` steps (rank 0 writes it, with every rank's RNG states); a write that fails stops every
    rank with one line, the previous checkpoint untouched."""
    rngs = gather_objects(world, rng_state())  # every rank's own: their dropout masks differ

    def fill(folder: Path) -> None:
        weights.save(folder)
        torch.save({"optimizers": [optimizer.state_dict()], "schedulers": [scheduler.state_dict()], "rng": rngs[0],
                    "rng_ranks": rngs}, folder / "trainer.pt")
        state = {"command": weights.command, "step": step, "train_s": train_s, "config": to_yaml(cfg)}
        (folder / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")

    cause = None
    if world.is_main:
        try:
            write_checkpoint(run_dir.path / CHECKPOINTS, step, fill, cfg.train.keep_checkpoints)
        except OSError as err:  # a full disk, a lost mount
            cause = err.strerror or str(err)
    if all_reduce_sums(world, [float(cause is not None)])[0]:
        raise UserError(f"could not write the checkpoint after step {step} ({cause or 'on rank 0'}); the previous "
                        "checkpoint stays valid: fix the cause and continue with train.resume=auto")


def restore_supervised_state(folder: Path, run_dir: RunDir, weights: Resumable, optimizer, scheduler,
                             world: World = World()) -> int:
    """Put the checkpoint's weights, optimizer, schedule and RNG states back; drop log lines of later steps; set later
    checkpoints of this folder aside -> the step to go on from."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    try:
        weights.load(folder)
    except UserError as err:
        raise UserError(f"train.resume: {err}") from None
    trainer = safe_load(folder / "trainer.pt")
    [optimizer_state], [scheduler_state] = trainer["optimizers"], trainer["schedulers"]
    load_optimizer_state(optimizer, scheduler, optimizer_state, scheduler_state)
    restore_rng(trainer, world.rank, world.size)
    run_dir.drop_steps_after(state["step"], ("metrics.jsonl",))
    if run_dir.writer and run_dir.holds_checkpoint(folder):
        for moved in set_aside_after(folder.parent, state["step"]):
            info(f"checkpoint step-{moved.name.rpartition('step-')[2]} is after the resumed step: kept as {moved}")
    info(f"resuming from {folder} after step {state['step']}")
    return state["step"]


def logged_so_far(run_dir: RunDir, held_out: tuple[str, ...]) -> dict:
    """What summary.json says of the steps before a resume, from the run's metrics.jsonl (kept up to the checkpoint's
    step): the last step's metrics and the last value of each held-out metric. Empty where the resume starts a new
    folder."""
    path = run_dir.path / "metrics.jsonl"
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    if not rows:
        return {}
    last_held = next((row for row in reversed(rows) if held_out[0] in row), {})
    return {"last_metrics": rows[-1], **{key: last_held.get(key) for key in held_out}}


def trained_seconds(folder: Path) -> float:
    """The training time a checkpoint's run had spent so far."""
    return float(json.loads((folder / "state.json").read_text(encoding="utf-8"))["train_s"])
