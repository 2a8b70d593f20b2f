"""The policy-adapter protocol: what the training code needs of the trainable policy on a frozen base, whatever
its kind, so that it asks the adapter instead of branching on the kind (issue #19).

Three kinds implement it, each a thin class over the functions that already do the work:

    PeftLora       one peft LoRA adapter named 'default' (models/loading.py attach_lora)
    MultiLora      several named LoRA policies served in one batched pass (models/multi_lora.py)
    MoLoRA         a mixture of LoRA experts (models/molora, models/molora_runtime.py)

Policies are numbered 0..K-1 (one policy: 0); `names` holds their names in that order.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file
from torch import nn

from rlora.errors import UserError
from rlora.models import molora as ml
from rlora.models.loading import causal_lm, save_adapter, trainable_parameters
from rlora.models.molora_runtime import RolloutRouting, prompt_list_routing
from rlora.models.multi_lora import (
    PEFT_NAME, parameters_per_policy, policies_disabled, policy_rows, policy_state, save_policy,
)
from rlora.types import RolloutSlice

PEFT_WEIGHTS = "adapter_model.safetensors"


class PolicyAdapter(Protocol):
    """The trainable policy (one or several) on `model`."""

    model: nn.Module
    names: list[str]  # the policies, in policy order (one policy: ['default'])

    def parameters_per_policy(self) -> list[list[nn.Parameter]]:
        """Each policy's trainable parameters (what its optimizer steps), in policy order."""

    def disabled(self) -> AbstractContextManager:
        """The reference policy: forwards inside run the base alone."""

    def rows(self, policy_B: torch.Tensor | None) -> AbstractContextManager:
        """Forwards inside send row b through policy policy_B[b] (None, or one policy: a no-op)."""

    def sampler_policies(self, policy_N: Sequence[int]) -> list[int] | None:
        """The sampler's `policies` argument for prompts of these policies: the list where the model serves
        several; None where it serves one (the sampler's plain path, transformers generate's too)."""

    def prompt_routing(self, prompts: Sequence[Sequence[int]]) -> AbstractContextManager:
        """Forwards inside run rows whose prompts are these token lists, one per row, in row order: a MoLoRA
        sequence router routes each row by its prompt; every other kind runs them as it would anyway."""

    def batch_aux_loss(self, masks_BT: Sequence[torch.Tensor], prompts: Sequence[Sequence[int]], forward,
                       sum_over_ranks: ml.SumOverRanks | None = None) -> ml.BatchAuxLoss | None:
        """The auxiliary loss of one supervised batch run as micro-batches (masks_BT: each micro-batch's attention
        mask; prompts: every row's prompt, in micro-batch order; forward(i): micro-batch i's forward in its
        routing context), or None: the policy has none. `aux_loss` is the same for the rows of a rollout."""

    def aux_loss(self, micro_batches: list[RolloutSlice], forward,
                 sum_over_ranks: ml.SumOverRanks | None = None, padding: Sequence[RolloutSlice] = ()
                 ) -> RolloutRouting | None:
        """The auxiliary loss of one update over these micro-batches as one batch (aux_share(micro) after each
        micro-batch's forward, metrics() at the end), or None: the policy has none. padding: micro-batches whose
        forwards pair with the busiest rank's where the loss makes forwards of its own (a sharded base)."""

    @property
    def aux_loss_every_row(self) -> bool:
        """The auxiliary loss covers every row, so the update trains rows whose policy loss is zero too."""

    def save(self, folder: Path | str, policy: int = 0) -> None:
        """One policy's adapter into `folder` (which the caller makes atomic)."""

    def load(self, folder: Path | str, policy: int = 0) -> None:
        """One policy's weights from a folder `save` wrote, into the live parameters."""


class _OnePolicy:
    """An adapter that serves one policy (number 0): its rows need no routing."""

    def rows(self, policy_B: torch.Tensor | None) -> AbstractContextManager:
        return nullcontext()

    def sampler_policies(self, policy_N: Sequence[int]) -> None:
        if any(policy_N):
            raise ValueError(f"policy {max(policy_N)} asked of an adapter that serves one policy")
        return None


class _WithoutAuxLoss:
    """A plain LoRA adapter (one or several) routes no row by its prompt, adds no auxiliary loss to the update, and
    trains only rows that move."""

    def prompt_routing(self, prompts: Sequence[Sequence[int]]) -> AbstractContextManager:
        return nullcontext()

    def batch_aux_loss(self, masks_BT, prompts, forward, sum_over_ranks=None) -> None:
        return None

    def aux_loss(self, micro_batches, forward, sum_over_ranks=None, padding=()) -> None:
        return None

    @property
    def aux_loss_every_row(self) -> bool:
        return False


class PeftLora(_OnePolicy, _WithoutAuxLoss):
    """One peft LoRA adapter ('default') on the base."""

    def __init__(self, model: nn.Module):
        self.model, self.names = model, ["default"]

    def parameters_per_policy(self) -> list[list[nn.Parameter]]:
        # every trainable parameter, read now: reward adapters and the critic beside the policy are frozen outside
        # their own contexts, and reading it at each call keeps the optimizer's parameter order the model's
        return [trainable_parameters(self.model)]

    def disabled(self) -> AbstractContextManager:
        return self.model.disable_adapter()

    def save(self, folder: Path | str, policy: int = 0) -> None:
        save_adapter(self.model, Path(folder))

    def load(self, folder: Path | str, policy: int = 0) -> None:
        _load_peft(self.model, folder, "default")


class MultiLora(_WithoutAuxLoss):
    """Several named LoRA policies on one base, batched in one pass (models/multi_lora.py)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = [name.removeprefix(PEFT_NAME.format("")) for name in policy_state(model).names]

    def parameters_per_policy(self) -> list[list[nn.Parameter]]:
        return parameters_per_policy(self.model)

    def disabled(self) -> AbstractContextManager:
        return policies_disabled(self.model)

    def rows(self, policy_B: torch.Tensor | None) -> AbstractContextManager:
        return policy_rows(self.model, policy_B)

    def sampler_policies(self, policy_N: Sequence[int]) -> list[int]:
        return list(policy_N)

    def save(self, folder: Path | str, policy: int = 0) -> None:
        save_policy(self.model, self.names[policy], folder)

    def load(self, folder: Path | str, policy: int = 0) -> None:
        _load_peft(self.model, folder, PEFT_NAME.format(self.names[policy]))


class MoLoRA(_OnePolicy):
    """A mixture of LoRA experts on the base (models/molora): the reference is the mixture off, the routers add
    a batch-wide auxiliary loss."""

    def __init__(self, model: nn.Module):
        self.model, self.names = model, ["default"]

    def parameters_per_policy(self) -> list[list[nn.Parameter]]:
        return [trainable_parameters(self.model)]  # read at each call, as PeftLora's

    def disabled(self) -> AbstractContextManager:
        return ml.molora_disabled(self.model)

    def prompt_routing(self, prompts: Sequence[Sequence[int]]) -> AbstractContextManager:
        return prompt_list_routing(self.model, prompts)  # a no-op for a token router

    def batch_aux_loss(self, masks_BT, prompts, forward, sum_over_ranks=None) -> ml.BatchAuxLoss:
        return ml.BatchAuxLoss(self.model, masks_BT, lambda: ml.prompt_summary(self.model, prompts), forward,
                               sum_over_ranks)

    def aux_loss(self, micro_batches, forward, sum_over_ranks=None, padding=()) -> RolloutRouting:
        return RolloutRouting(self.model, micro_batches, forward, sum_over_ranks, padding)

    @property
    def aux_loss_every_row(self) -> bool:
        return ml.aux_losses_on(self.model)

    def save(self, folder: Path | str, policy: int = 0) -> None:
        ml.save_molora(self.model, folder)

    def load(self, folder: Path | str, policy: int = 0) -> None:
        ml.read_molora_meta(folder)  # a MoLoRA folder of a known version, or a one-line error
        tensors = load_file(str(Path(folder) / ml.WEIGHTS_FILE))
        live = {name: p for name, p in causal_lm(self.model).named_parameters() if ml.PARAM_TAG in name}
        if tensors.keys() != live.keys() or any(tensors[n].shape != p.shape for n, p in live.items()):
            raise UserError(f"MoLoRA folder '{folder}' does not fit this model's MoLoRA layers")
        with torch.no_grad():
            for name, param in live.items():
                param.copy_(tensors[name])


def adapter_of(model: nn.Module) -> PolicyAdapter:
    """The adapter of a model that carries a policy: the one place that tells the kinds apart by what the model
    carries (session.prepare builds it once; a test or bench that has only the model asks here)."""
    if ml.has_molora(model):
        return MoLoRA(model)
    if policy_state(model) is not None:
        return MultiLora(model)
    return PeftLora(model)


def reference_policy(model: nn.Module) -> AbstractContextManager:
    """The base alone: the model's policy adapter(s) off."""
    return adapter_of(model).disabled()


def _load_peft(model: nn.Module, folder: Path | str, adapter_name: str) -> None:
    # deferred, as everywhere in rlora: peft is slow to import
    from peft import set_peft_model_state_dict

    # it maps the folder's keys (saved without the adapter name) onto this adapter's parameters
    result = set_peft_model_state_dict(model, load_file(str(Path(folder) / PEFT_WEIGHTS)), adapter_name=adapter_name)
    unexpected = list(getattr(result, "unexpected_keys", []))
    if unexpected:
        raise UserError(f"adapter folder '{folder}' does not fit this model ({unexpected[0]})")
