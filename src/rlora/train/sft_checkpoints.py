"""Checkpoints of `rlora sft`: the atomic folders of train/checkpoint.py, holding what a supervised run needs to go on
exactly where it stopped:

    adapter/        the LoRA (PEFT) or MoLoRA folder, through the adapter protocol (models/adapters.py)
    model.safetensors   with train.full_finetune: every parameter instead (a checkpoint is read back into the live
                    model, so it needs no transformers folder; the run's output is still OUTPUT/model)
    trainer.pt      AdamW and schedule state, every rank's RNG states (LoRA dropout draws from them; weights_only)
    state.json      step, training time so far, the run's config

The batches are a function of (seed, step) (data/sft_data.py LengthGroupedOrder), so the step is the data position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from rlora.config import to_yaml
from rlora.errors import UserError
from rlora.logging.console import info
from rlora.models.adapters import adapter_of
from rlora.train.checkpoint import set_aside_after, write_checkpoint
from rlora.train.distributed import World, all_reduce_sums, gather_objects
from rlora.train.optim import load_optimizer_state
from rlora.train.outputs import RunDir
from rlora.train.resume import CHECKPOINTS, check_same_run, restore_rng, rng_state, safe_load

# what decides the batches and what a step computes; other train.* keys (steps, epochs, lr, eval_every, ...) may change
SFT_MUST_MATCH = ("model", "lora", "molora", "data", "train.seed", "train.batch_size", "train.group_window",
                  "train.max_length", "train.full_finetune")
FULL_MODEL_FILE = "model.safetensors"


def check_sft_resume(cfg, folder: Path, steps: int) -> dict:
    """Before the model loads: the checkpoint is of this run's settings and not past its `steps` -> its state."""
    return check_same_run(cfg, folder, SFT_MUST_MATCH, steps, command="sft")


def save_sft_state(run_dir: RunDir, step: int, cfg, model, optimizer, scheduler, train_s: float,
                   world: World = World()) -> None:
    """The state after `step` steps (rank 0 writes it); a write that fails stops every rank with one line, the
    previous checkpoint untouched."""
    def fill(folder: Path) -> None:
        if cfg.train.full_finetune:
            save_model(model, str(folder / FULL_MODEL_FILE))  # handles tied embeddings (shared tensors)
        else:
            adapter_of(model).save(folder / "adapter")
        torch.save({"optimizers": [optimizer.state_dict()], "schedulers": [scheduler.state_dict()], "rng": rngs[0],
                    "rng_ranks": rngs}, folder / "trainer.pt")
        state = {"command": "sft", "step": step, "train_s": train_s, "config": to_yaml(cfg)}
        (folder / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")

    rngs = gather_objects(world, rng_state())  # every rank's own: their dropout masks differ
    cause = None
    if world.is_main:
        try:
            write_checkpoint(run_dir.path / CHECKPOINTS, step, fill, cfg.train.keep_checkpoints)
        except OSError as err:  # a full disk, a lost mount
            cause = err.strerror or str(err)
    if all_reduce_sums(world, [float(cause is not None)])[0]:
        raise UserError(f"could not write the checkpoint after step {step} ({cause or 'on rank 0'}); the previous "
                        "checkpoint stays valid: fix the cause and continue with train.resume=auto")


def restore_sft_state(folder: Path, run_dir: RunDir, cfg, model, optimizer, scheduler, world: World = World()) -> int:
    """Put the checkpoint's weights, optimizer, schedule and RNG states back; drop log lines of later steps; set later
    checkpoints of this folder aside -> the step to go on from."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    try:
        if cfg.train.full_finetune:
            load_model(model, str(folder / FULL_MODEL_FILE))
        else:
            adapter_of(model).load(folder / "adapter")
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


def logged_so_far(run_dir: RunDir) -> dict:
    """What summary.json says of the steps before a resume, from the run's metrics.jsonl (kept up to the checkpoint's
    step): the last step's metrics and the last held-out loss. Empty where the resume starts a new folder."""
    path = run_dir.path / "metrics.jsonl"
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line of a killed run
            continue
    held = [row["eval_loss"] for row in rows if "eval_loss" in row]
    return {"last_metrics": rows[-1], "eval_loss": held[-1] if held else None} if rows else {}


def trained_seconds(folder: Path) -> float:
    """The training time a checkpoint's run had spent so far."""
    return float(json.loads((folder / "state.json").read_text(encoding="utf-8"))["train_s"])
