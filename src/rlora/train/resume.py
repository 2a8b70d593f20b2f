"""What a training checkpoint holds, and putting it back.

    adapter/          the PEFT adapter (safetensors), loaded back into the live model's adapter parameters; for a
                      MoLoRA policy its MoLoRA folder (experts and routers, models/molora/folder.py)
    trainer.pt        optimizer and scheduler state, RNG states of python/numpy/torch (and CUDA) of every rank, read back
                      with torch.load(weights_only=True): no pickled code is ever executed
    replay.pt         the experience-replay buffers, when the run uses them: each policy's, of every rank
    value_model/      PPO's critic (value adapter + head, models/value_model.py), when the run has one; its
                      optimizer state is the second param group of trainer.pt's optimizer
    policies/NAME/adapter/   with several policies (docs/policies.md), each one's adapter instead of adapter/ (and
                      with PPO its critic, policies/NAME/value_model/, the second param group of its optimizer)
    trainer.pt        (also) one optimizer and one scheduler state per policy, in policy order
    state.json        step, training time so far, the evaluation before training, the run's config

Data order and sampling seeds are pure functions of (seed, step), so the step number is the data position.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import torch
import yaml

from rlora.algos.advantages import per_token
from rlora.config import RLConfig, apply_presets, to_yaml
from rlora.errors import UserError
from rlora.models.adapters import PolicyAdapter
from rlora.batching import select_rows
from rlora.train.checkpoint import checkpoint_name, checkpoints, latest_valid, verify, write_checkpoint
from rlora.train.optim import load_optimizer_state
from rlora.train.policies import Policy
from rlora.train.replay import ReplayBuffer, StoredGroup
from rlora.types import Rollout

CHECKPOINTS = "checkpoints"
# sections whose change makes a checkpoint meaningless for the run (train.* may change: e.g. more steps)
MUST_MATCH = ("model", "lora", "molora", "data", "rewards", "rollout", "algo", "ppo", "policies", "train.seed",
              "train.prompts_per_step")
# settings inside those sections that may change on resume: how the sampler computes (the same products through
# another kernel: later samples differ by rounding), e.g. weight packs switched off after running out of memory
MAY_CHANGE = ("rollout.weight_packs",)


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def restore_rng(trainer: dict, rank: int = 0, world_size: int = 1) -> None:
    """This rank's own RNG states (each rank draws its own LoRA dropout masks, so their states differ) where the
    checkpoint holds one per rank of this many ranks; else (a checkpoint from before, or of another number of
    ranks) rank 0's on every rank, as a fresh run seeds every rank alike."""
    ranks = trainer.get("rng_ranks")
    set_rng_state(ranks[rank] if ranks is not None and len(ranks) == world_size else trainer["rng"])


def replay_state(buffer: ReplayBuffer) -> list[dict]:
    """A buffer's groups as tensors and plain containers (what torch.load(weights_only=True) reads back)."""
    return [{"rollout": vars(g.rollout), "advantages_GT": g.advantages_GT, "loss_mask_GT": g.loss_mask_GT,
             "step": g.step, "uses": g.uses} for g in buffer.groups]


def _replay_policies(saved) -> list:
    """replay.pt's {"policies": [each policy's {"ranks": [...]}]} (or, from before several policies replayed, the
    only policy's entry)."""
    return saved["policies"] if isinstance(saved, dict) and "policies" in saved else [saved]


def _replay_ranks(saved) -> list[list[dict]]:
    """A policy's entry of replay.pt, {"ranks": [each rank's groups]} (or, from before data-parallel replay, one
    rank's list)."""
    return saved["ranks"] if isinstance(saved, dict) else [saved]


def check_replay_ranks(folder: Path, world_size: int) -> None:
    """Before anything loads or is written: a checkpoint's replay buffers are per rank, so the run resumes
    with as many ranks."""
    if not (folder / "replay.pt").is_file():
        return
    saved = len(_replay_ranks(_replay_policies(safe_load(folder / "replay.pt"))[0]))
    if saved != world_size:
        raise UserError(f"train.resume: the checkpoint holds the replay buffers of {saved} rank(s), this run has "
                        f"{world_size}: resume with --nproc_per_node {saved} (each rank keeps its own buffer)")


def _load_replay(buffer: ReplayBuffer, saved, world_size: int, policy: int) -> None:
    """A policy's buffer on this rank from its entry of replay.pt."""
    ranks = _replay_ranks(saved)
    if len(ranks) != world_size:  # check_replay_ranks said so before loading; a safety net
        raise UserError(f"train.resume: the checkpoint holds the replay buffers of {len(ranks)} rank(s), this run "
                        f"has {world_size}")
    groups = ranks[buffer.rank]
    buffer.groups.clear()
    for g in groups:
        rollout = Rollout(**g["rollout"])
        buffer.groups.append(StoredGroup(select_rows(rollout, list(range(rollout.num_completions))),
                                         _stored_advantages(g), g["loss_mask_GT"], g["step"], g["uses"], policy))


def _stored_advantages(group: dict) -> torch.Tensor:
    """A stored group's advantages, one per token (a checkpoint from before held one per completion)."""
    return per_token(group["advantages_GT"] if "advantages_GT" in group else group["advantages_G"],
                     group["loss_mask_GT"])


def save_training_state(run_path: Path, step: int, cfg, adapter: PolicyAdapter, policies: list[Policy],
                        replay: list[list[list[dict]]] | None, train_s: float, eval_before: dict | None,
                        critics: list | None = None, rng_ranks: list[dict] | None = None) -> Path:
    """Checkpoint after `step` completed steps (keeps the last train.keep_checkpoints): every policy's adapter
    (train/policies.py), optimizer and schedule. replay: each policy's replay_state of every rank; rng_ranks: every rank's
    rng_state (None: this process's)."""

    def fill(folder: Path) -> None:
        for policy in policies:
            adapter.save(policy.adapter_in(folder), policy.index)
        trainer = {"optimizers": [p.optimizer.state_dict() for p in policies],
                   "schedulers": [p.scheduler.state_dict() for p in policies]}
        rngs = rng_ranks or [rng_state()]
        torch.save(trainer | {"rng": rngs[0], "rng_ranks": rngs}, folder / "trainer.pt")
        if replay is not None:
            torch.save({"policies": [{"ranks": ranks} for ranks in replay]}, folder / "replay.pt")
        for policy, critic in zip(policies, critics or []):  # PPO: each policy's critic beside its adapter
            (policy.folder_in(folder) / "value_model").mkdir(parents=True)
            critic.save(policy.folder_in(folder) / "value_model")
        state = {"command": "train", "step": step, "train_s": train_s, "eval_before": eval_before,
                 "config": to_yaml(cfg)}
        (folder / "state.json").write_text(json.dumps(state, indent=1), encoding="utf-8")

    return write_checkpoint(run_path / CHECKPOINTS, step, fill, cfg.train.keep_checkpoints)


def find_checkpoint(cfg) -> Path | None:
    """The checkpoint train.resume names: None (start fresh), 'auto' (the newest valid one in the output
    folder, if any) or a checkpoint folder (must be valid)."""
    resume = cfg.train.resume
    if resume is None:
        return None
    if resume == "auto":
        return latest_valid(Path(cfg.train.output_dir) / CHECKPOINTS)
    folder = Path(resume)
    step = re.fullmatch(r"step-(\d+)", folder.name)
    if not folder.is_dir() and step:  # step-2 for the folder written as step-0000002
        folder = folder.with_name(checkpoint_name(int(step.group(1))))
    if not folder.is_dir():
        present = [p.name for p in checkpoints(folder.parent)]
        raise UserError(f"train.resume: no checkpoint folder at '{resume}' (" + (
            f"{folder.parent} holds {', '.join(present)}" if present else "use 'auto' or a checkpoints/step-N folder"
        ) + ")")
    if verify(folder) is None:
        raise UserError(f"train.resume: '{resume}' is not a complete checkpoint (missing or damaged files): "
                        f"use an older one or train.resume=auto")
    return folder


def check_resume_target(cfg) -> None:
    """train.resume=auto continues the run in train.output_dir: without one, a new timestamped folder would be
    chosen, which holds no checkpoint, and the run would silently start afresh."""
    if cfg.train.resume == "auto" and cfg.train.output_dir is None:
        raise UserError("train.resume=auto continues the run in train.output_dir: set train.output_dir to that run's "
                        "folder (or give train.resume a checkpoints/step-N folder)")


def check_same_run(cfg, folder: Path, must_match: tuple[str, ...] = MUST_MATCH, steps: int | None = None,
                   command: str = "train") -> dict:
    """-> the checkpoint's state; refuses a checkpoint of another command, one made with other settings in
    `must_match` (the sections and train keys that decide what the run computes; `rlora sft` passes its own) or one
    past the run's `steps` (default train.steps)."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    written_by = state.get("command", "train")  # checkpoints from before the key: rlora train's
    if written_by != command:
        raise UserError(f"train.resume: checkpoint {folder} was written by rlora {written_by}, not rlora {command}: "
                        f"resume it with rlora {written_by}")
    saved = _with_current_defaults(yaml.safe_load(state["config"]), type(cfg))
    current = yaml.safe_load(to_yaml(cfg))
    for section, _, field in (key.partition(".") for key in MAY_CHANGE):
        for config in (saved, current):
            (config.get(section) or {}).pop(field, None)
    fixed = [key.partition(".")[2] for key in must_match if key.startswith("train.")]
    fixed_text = ", ".join(fixed[:-1]) + " and " + fixed[-1] if len(fixed) > 1 else "".join(fixed)
    for key in must_match:
        section, _, field = key.partition(".")
        then, now = saved.get(section), current.get(section)
        if field:
            then, now = (then or {}).get(field), (now or {}).get(field)
        if section == "data" and not field and command == "train":  # rlora sft's eval_size takes rows from data.path
            then, now = _used_data_settings(then), _used_data_settings(now)
        if then != now:
            where = _first_difference(then, now, key)
            raise UserError(f"train.resume: checkpoint {folder} was made with a different {where}: resume with the "
                            f"run's settings (train.* may change, except {fixed_text}, which decide the "
                            "data order and what is computed)")
    steps = cfg.train.steps if steps is None else steps
    if state["step"] > steps:
        raise UserError(f"train.resume: checkpoint is at step {state['step']}, beyond the run's {steps} steps "
                        f"(give it more: train.steps{', or train.epochs' if command == 'sft' else ''})")
    return state


def _used_data_settings(data: dict | None) -> dict | None:
    """The data section without eval_size where it selects nothing (a data.path run without data.eval_path has no
    held-out prompts to count), so that changing it does not refuse a resume."""
    if not data or data.get("path") is None or data.get("eval_path") is not None:
        return data
    return {key: value for key, value in data.items() if key != "eval_size"}


def saved_setting(folder: Path, section: str, key: str):
    """One setting of the config a checkpoint was made with (None where it has none)."""
    state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    return (yaml.safe_load(state["config"]).get(section) or {}).get(key)


def _with_current_defaults(saved: dict, config_cls) -> dict:
    """The saved config as this version writes it (keys added since, e.g. a policy's beta, at their defaults);
    as saved when it no longer validates (the comparison then names what differs)."""
    try:
        config = config_cls.model_validate(saved)
    except ValueError:
        return saved
    if isinstance(config, RLConfig):
        apply_presets(config)  # as load_config does for the current config: a key added since takes its preset
    return yaml.safe_load(to_yaml(config))


def _first_difference(a, b, path: str) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}")
    return f"{path} ({a!r} there, {b!r} now)"


def check_fresh_folder(cfg, run_dir) -> None:
    """A run that starts afresh writes into a new or empty folder (or overwrites); train.resume=auto into a used
    folder without a checkpoint says that there is none, not only 'choose a new folder'."""
    if cfg.train.resume == "auto" and not cfg.train.overwrite and run_dir.holds_files():
        raise UserError(f"train.resume=auto: '{cfg.train.output_dir}' holds a run but no checkpoint to resume from "
                        "(train.checkpoint_every=N writes them): choose a new folder, or set train.overwrite=true to "
                        "replace that run")
    run_dir.check_writable()


def restore_training_state(folder: Path, adapter: PolicyAdapter, policies: list[Policy],
                           replay: list[ReplayBuffer] | None,
                           critics: list | None = None, world_size: int = 1, rank: int = 0) -> None:
    trainer = safe_load(folder / "trainer.pt")
    # a checkpoint of one policy from before every run had a list of policies holds its states under these keys
    optimizers = trainer["optimizers"] if "optimizers" in trainer else [trainer["optimizer"]]
    schedulers = trainer["schedulers"] if "schedulers" in trainer else [trainer["scheduler"]]
    for policy, opt_state, sched_state in zip(policies, optimizers, schedulers, strict=True):
        try:
            adapter.load(policy.adapter_in(folder), policy.index)
        except UserError as err:
            raise UserError(f"train.resume: {err}") from None
        load_optimizer_state(policy.optimizer, policy.scheduler, opt_state, sched_state)
    for policy, critic in zip(policies, critics or []):
        critic.restore(policy.folder_in(folder) / "value_model")
    restore_rng(trainer, rank, world_size)
    if replay is not None and (folder / "replay.pt").is_file():
        saved = _replay_policies(safe_load(folder / "replay.pt"))
        for policy, (buffer, entry) in enumerate(zip(replay, saved, strict=True)):
            _load_replay(buffer, entry, world_size, policy)


def safe_load(path: Path):
    """torch.load with weights_only=True: tensors and plain containers only; a file that would need to
    unpickle arbitrary objects (i.e. run code) is refused."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as err:  # noqa: BLE001 - UnpicklingError and friends: one line for the user
        raise UserError(f"train.resume: refused to load {path}: it is not a plain tensor file "
                        f"({type(err).__name__}); only checkpoints written by rlora can be resumed") from None
