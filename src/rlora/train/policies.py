"""The policies a run trains on one base: one (the `default` policy of a plain run) or several (the `policies:`
section, docs/policies.md). Every run has K >= 1 of them and the step, update, checkpoint, resume and evaluation
code loop over them; only where their files go differs (`Policy.own_folder`).

Each policy is a LoRA adapter (one: models/loading.py attach_lora; several: models/multi_lora.py) with its own
AdamW, schedule, learning rate, seed and metrics. With several, each also has a folder OUTPUT/policies/NAME,
and a step gives every policy the step's prompts: a slot of each (train/slots.py), drawn with the key and seed
that a run of that policy alone would use, so its samples are those of that run. All policies' rows are sampled
in one batched decode, share one reference pass (the base: every adapter off) and train in shared
forward/backward passes.
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
LONE_POLICY = "default"  # the name of a run's only policy (the peft adapter's name)


@dataclass
class Policy:
    name: str
    index: int
    seed: int
    beta: float  # its KL coefficient (algo.beta unless it sets its own)
    params: list[torch.nn.Parameter]  # what its optimizer steps and clips (a critic's head is stepped apart)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_dir: RunDir  # OUTPUT/policies/NAME; a run's only policy: the run's folder (OUTPUT/adapter, plain PEFT)
    own_folder: bool  # False: the run's only policy, whose files and metrics are the run's own

    def adapter_in(self, checkpoint: Path) -> Path:
        """Its adapter's folder in a checkpoint (train/resume.py)."""
        return self.folder_in(checkpoint) / "adapter"

    def folder_in(self, checkpoint: Path) -> Path:
        """Where its files go in a checkpoint: the checkpoint itself for a run's only policy, else policies/NAME."""
        return checkpoint if not self.own_folder else checkpoint / POLICIES_FOLDER / self.name

    def metric_name(self, key: str) -> str:
        """Its metric `key` among the run's (metrics.jsonl, the sinks): 'NAME/key' beside other policies'."""
        return f"{self.name}/{key}" if self.own_folder else key


def names_and_seeds(cfg: RLConfig) -> tuple[list[str], list[int]]:
    return [p.name for p in cfg.policies], [cfg.train.seed if p.seed is None else p.seed for p in cfg.policies]


def build_policies(cfg: RLConfig, adapter: PolicyAdapter, run_dir: RunDir, critic_groups: list[dict] | None = None
                   ) -> list[Policy]:
    """One optimizer and schedule per policy, over its adapter's parameters; critic_groups (PPO: each policy's value
    adapter and head, with their own lr) join their policy's optimizer as a second parameter group."""
    total_updates = cfg.train.steps * cfg.algo.num_iterations
    params_per_policy = adapter.parameters_per_policy()
    critic_groups = critic_groups or [None] * len(params_per_policy)

    def groups(index: int) -> list[dict]:
        return [{"params": params_per_policy[index]}] + ([critic_groups[index]] if critic_groups[index] else [])

    if cfg.policies is None:
        optimizer, scheduler = build_optimizer(groups(0), cfg.train, total_updates)
        return [Policy(LONE_POLICY, 0, cfg.train.seed, cfg.algo.beta, params_per_policy[0], optimizer, scheduler,
                       run_dir, False)]
    policies = []
    for index, (spec, seed) in enumerate(zip(cfg.policies, names_and_seeds(cfg)[1])):
        params = params_per_policy[index]
        train = cfg.train.model_copy(update={"lr": spec.lr or cfg.train.lr})
        optimizer, scheduler = build_optimizer(groups(index), train, total_updates)
        folder = RunDir(str(run_dir.path / POLICIES_FOLDER / spec.name), overwrite=True, writer=run_dir.writer)
        beta = cfg.algo.beta if spec.beta is None else spec.beta
        policies.append(Policy(spec.name, index, seed, beta, params, optimizer, scheduler, folder, True))
    return policies


def own_folders(policies: list[Policy]) -> list[Policy]:
    """The policies with a folder of their own (none in a run of one policy)."""
    return [p for p in policies if p.own_folder]


def create_folders(policies: list[Policy]) -> None:
    for policy in own_folders(policies):
        if policy.run_dir.writer:
            policy.run_dir.path.mkdir(parents=True, exist_ok=True)


def row_policies(slots: list[Slot], G: int) -> torch.Tensor:
    """The policy of each of the G rows of each group, from the groups' slots -> policy_B (long)."""
    return torch.tensor([slot.policy for slot in slots], dtype=torch.long).repeat_interleave(G)


def split_metrics(metrics: dict, policies: list[Policy]) -> tuple[dict, dict[str, dict]]:
    """A step's metrics (the shared ones, and each policy's under 'policies') -> (the run's metrics: the shared
    ones and every policy's under its metric_name, for metrics.jsonl and the sinks; {policy: its metrics with the
    shared ones}, for the policies with a folder of their own: OUTPUT/policies/NAME/metrics.jsonl)."""
    per_policy = metrics.pop("policies")
    flat = dict(metrics)
    for policy in policies:
        flat |= {policy.metric_name(key): value for key, value in per_policy.get(policy.name, {}).items()}
    return flat, {p.name: {**metrics, **per_policy.get(p.name, {})} for p in own_folders(policies)}


def per_run(policies: list[Policy], per_policy: dict[str, dict]):
    """A result per policy as the run reports it: {name: result} beside other policies, the only policy's as is."""
    return per_policy if own_folders(policies) else per_policy[policies[0].name]
