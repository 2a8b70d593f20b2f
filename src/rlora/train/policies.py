"""Several policies trained in one run on one base (the `policies:` section, docs/policies.md).

Each policy is a named LoRA adapter (models/multi_lora.py) with its own AdamW, schedule, learning rate, seed,
metrics and folder OUTPUT/policies/NAME. A step gives every policy the step's prompts: a slot of each
(train/slots.py), drawn with the key and seed that a run of that policy alone would use, so its samples are
those of that run. All policies' rows are sampled in one batched decode, share one reference pass (the base:
every adapter off) and train in shared forward/backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlora.config import RLConfig
from rlora.models.adapters import PolicyAdapter
from rlora.train.optim import build_optimizer
from rlora.train.outputs import RunDir
from rlora.train.slots import Slot

POLICIES_FOLDER = "policies"


@dataclass
class Policy:
    name: str
    index: int
    seed: int
    beta: float  # its KL coefficient (algo.beta unless it sets its own)
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_dir: RunDir  # OUTPUT/policies/NAME


def names_and_seeds(cfg: RLConfig) -> tuple[list[str], list[int]]:
    return [p.name for p in cfg.policies], [cfg.train.seed if p.seed is None else p.seed for p in cfg.policies]


def build_policies(cfg: RLConfig, adapter: PolicyAdapter, run_path: Path, writer: bool) -> list[Policy]:
    """One optimizer and schedule per policy, over its adapter's parameters only."""
    policies = []
    total_updates = cfg.train.steps * cfg.algo.num_iterations
    params_per_policy = adapter.parameters_per_policy()
    for index, (spec, seed) in enumerate(zip(cfg.policies, names_and_seeds(cfg)[1])):
        params = params_per_policy[index]
        train = cfg.train.model_copy(update={"lr": spec.lr or cfg.train.lr})
        optimizer, scheduler = build_optimizer(params, train, total_updates)
        folder = RunDir(str(run_path / POLICIES_FOLDER / spec.name), overwrite=True, writer=writer)
        beta = cfg.algo.beta if spec.beta is None else spec.beta
        policies.append(Policy(spec.name, index, seed, beta, params, optimizer, scheduler, folder))
    return policies


def create_folders(policies: list[Policy]) -> None:
    for policy in policies:
        if policy.run_dir.writer:
            policy.run_dir.path.mkdir(parents=True, exist_ok=True)


def row_policies(slots: list[Slot], G: int) -> torch.Tensor:
    """The policy of each of the G rows of each group, from the groups' slots -> policy_B (long)."""
    return torch.tensor([slot.policy for slot in slots], dtype=torch.long).repeat_interleave(G)


def split_metrics(metrics: dict, policies: list[Policy]) -> tuple[dict, dict[str, dict]]:
    """A step's metrics -> (shared metrics plus every policy's under 'NAME/key': for metrics.jsonl and the sinks,
    {policy: its metrics with the shared ones}: for OUTPUT/policies/NAME/metrics.jsonl)."""
    per_policy = metrics.pop("policies")
    flat = dict(metrics)
    for name, values in per_policy.items():
        flat |= {f"{name}/{key}": value for key, value in values.items()}
    return flat, {p.name: {**metrics, **per_policy[p.name]} for p in policies}
