"""A training client and its training state as `rlora serve` saves and loads it (save_state / load_state).

The saved form (serve/state.py writes it): the adapter as a PEFT folder, and beside it each parameter's AdamW
moments and step count (optimizer.safetensors, keyed by the parameter's name in the PEFT file plus
`.exp_avg`, `.exp_avg_sq`, `.step`) and the last step's hyper-parameters (optimizer.json). A checkpoint is
loaded only when it is exactly the client's shape: the same rank, targets and lora_alpha, every tensor there
with its shape and none other. A parameter without AdamW state (it never had a gradient) starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from peft import LoraConfig
from torch import nn

from rlora.serve.state import ServeError, TinkerPath

PARTS = ("exp_avg", "exp_avg_sq", "step")


@dataclass
class Trainee:
    model_id: str
    peft_name: str
    rank: int
    config: LoraConfig
    params: list[nn.Parameter]
    routable: bool = True  # its adapter can join a batched pass (serve/batched.py): ClientTargets.routable
    optimizer: torch.optim.AdamW | None = None
    loss_since_step: float = 0.0


def param_names(model: nn.Module, trainee: Trainee) -> list[str]:
    """Its parameters' names without the adapter's name (as in a PEFT file), in trainee.params order."""
    ids = {id(p) for p in trainee.params}
    names = [n for n, p in model.named_parameters() if id(p) in ids]
    return [n.replace(f".{trainee.peft_name}.", ".") for n in names]


def adam_state(trainee: Trainee, names: list[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, description) of its AdamW state. An optimizer with no state (optim_steps that had no
    gradients) is a fresh one: saved as none (stepped false), as is no optimizer."""
    optimizer = trainee.optimizer
    if optimizer is None or not optimizer.state:
        return {}, {"stepped": False}
    group = optimizer.param_groups[0]
    meta = {"stepped": True, "lr": group["lr"], "betas": list(group["betas"]), "eps": group["eps"],
            "weight_decay": group["weight_decay"]}
    tensors = {}
    for key, param in zip(names, trainee.params):
        state = optimizer.state.get(param)
        if state:
            tensors[f"{key}.exp_avg"], tensors[f"{key}.exp_avg_sq"] = state["exp_avg"], state["exp_avg_sq"]
            tensors[f"{key}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
    return tensors, meta


def _first(keys: list[str]) -> str:
    return keys[0] + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")


def _targets(config: LoraConfig) -> set[str]:
    """The maps a LoRA adapts: modules, and parameters (a mixture's fused experts)."""
    return set(config.target_modules or []) | set(config.target_parameters or [])


def checked_state(trainee: Trainee, names: list[str], path: TinkerPath, config: LoraConfig,
                  weights: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor] | None) -> dict[int, dict]:
    """ServeError 400 unless the checkpoint is this client's shape; -> the AdamW state per parameter index
    (tensors None: no optimizer state asked for or saved)."""
    mine = (trainee.config.r, _targets(trainee.config), trainee.config.lora_alpha)
    theirs = (config.r, _targets(config), config.lora_alpha)
    if mine != theirs:
        raise ServeError(400, f"{path} is a rank-{theirs[0]} LoRA on {sorted(theirs[1])} with lora_alpha {theirs[2]}; this "
                              f"training client's is rank {mine[0]} on {sorted(mine[1])} with lora_alpha {mine[2]}")
    shapes = dict(zip(names, (tuple(p.shape) for p in trainee.params)))
    extra, missing = sorted(set(weights) - set(shapes)), sorted(set(shapes) - set(weights))
    wrong = [k for k in names if k in weights and tuple(weights[k].shape) != shapes[k]]
    for problem, keys in [("has a tensor this adapter does not:", extra), ("lacks", missing),
                          ("has a tensor of another shape:", wrong)]:
        if keys:
            raise ServeError(400, f"{path} {problem} {_first(keys)}")
    if tensors is None:
        return {}
    unknown = sorted(set(tensors) - {f"{key}.{part}" for key in names for part in PARTS})
    if unknown:
        raise ServeError(400, f"{path}: optimizer state for a tensor this adapter does not have: {_first(unknown)}")
    moments = {}
    for i, key in enumerate(names):
        present = [f"{key}.{part}" in tensors for part in PARTS]
        if any(present) and not all(present):
            raise ServeError(400, f"{path}: the optimizer state of {key} is incomplete")
        if all(present):
            exp_avg, exp_avg_sq, step = (tensors[f"{key}.{part}"] for part in PARTS)
            if tuple(exp_avg.shape) != shapes[key] or tuple(exp_avg_sq.shape) != shapes[key] or step.numel() != 1:
                raise ServeError(400, f"{path}: the optimizer state of {key} is not of its shape")
            moments[i] = {"step": step.reshape(()).clone(), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    return moments


def restore_adam(trainee: Trainee, meta: dict, moments: dict[int, dict]) -> None:
    """Its AdamW as saved: the last step's hyper-parameters and each parameter's moments."""
    trainee.optimizer = torch.optim.AdamW(trainee.params, lr=meta["lr"], betas=tuple(meta["betas"]), eps=meta["eps"],
                                          weight_decay=meta["weight_decay"])
    state_dict = trainee.optimizer.state_dict()
    state_dict["state"] = moments
    trainee.optimizer.load_state_dict(state_dict)
