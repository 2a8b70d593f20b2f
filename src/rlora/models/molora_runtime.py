"""MoLoRA where rlora runs a model: the routing context of a forward (training log-prob passes, the samplers),
the reference policy (the mixture off), and the batch's auxiliary losses in a GRPO update.

Sequence routers are decided by the prompt alone: every forward over rows of known prompts runs inside
`prompt_routing(model, prompt_ids_BT, prompt_mask_BT)`, which sets the prompts' summaries (the same bits for a
prompt in any batch, models/molora.py prompt_summary), so the sampler's prefill and decoding steps and the
trainer's forward over prompt + completion use identical gates. For a model without sequence-routed MoLoRA
layers (plain LoRA, token routers) the contexts do nothing.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from rlora.models import molora as ml
from rlora.models.multi_lora import policies_disabled, policy_state


def has_molora(model) -> bool:
    return bool(ml.molora_modules(model))


def aux_losses_on(model) -> bool:
    """The model carries MoLoRA layers whose auxiliary losses have a weight (they then cover every row)."""
    modules = ml.molora_modules(model)
    return bool(modules) and (modules[0][1].config.balance_coef > 0 or modules[0][1].config.z_coef > 0)


def sequence_routed(model) -> bool:
    """The model carries MoLoRA layers with a sequence router (its forwards need the prompts)."""
    modules = ml.molora_modules(model)
    return bool(modules) and modules[0][1].config.router == "sequence"


def prompt_routing(model, prompt_ids_BT: torch.Tensor, prompt_mask_BT: torch.Tensor):
    """The routing context of a forward over these B rows (padded prompts; mask 1 = prompt token)."""
    if not sequence_routed(model):
        return nullcontext()
    return ml.sequence_routing(model, ml.prompt_summary_padded(model, prompt_ids_BT, prompt_mask_BT))


def prompt_list_routing(model, prompts: list[list[int]]):
    """prompt_routing of unpadded token lists (one row each)."""
    return ml.routing_from_prompts(model, prompts) if sequence_routed(model) else nullcontext()


class SamplerRouting:
    """The routing of a sampler that prefills P prompts, then decodes G rows per prompt (row b belongs to prompt
    b // G) whose active subset changes from step to step. Without a sequence router every call is a no-op."""

    def __init__(self, model, prompts: list[list[int]], G: int):
        self.model, self.G = model, G
        self.summary_PD = ml.prompt_summary(model, prompts) if sequence_routed(model) else None

    def prompts(self) -> None:
        """The next forward runs the P prompts (prefill)."""
        if self.summary_PD is not None:
            ml.set_sequence_routing(self.model, self.summary_PD)

    def rows(self, rows_A: torch.Tensor) -> None:
        """The next forwards run these rows of the P x G (a decoding step)."""
        if self.summary_PD is not None:
            ml.set_sequence_routing(self.model, self.summary_PD[rows_A.to(self.summary_PD.device) // self.G])


@contextmanager
def sampler_routing(model, prompts: list[list[int]], G: int):
    """A SamplerRouting for these prompts; the model's previous routing setting is restored on exit."""
    routing = SamplerRouting(model, prompts, G)
    if routing.summary_PD is None:
        yield routing
        return
    with ml.sequence_routing(model, routing.summary_PD):
        yield routing


@contextmanager
def reference_policy(model):
    """The base alone: the MoLoRA mixture off (a MoLoRA model), every policy adapter off (several policies), else
    the peft adapter off."""
    if has_molora(model):
        with ml.molora_disabled(model):
            yield model
    elif policy_state(model) is not None:
        with policies_disabled(model):
            yield model
    else:
        with model.disable_adapter():
            yield model


class RolloutRouting:
    """MoLoRA's part of one GRPO update over the rows `index_R` of a rollout, run as micro-batches: the auxiliary
    loss of the whole update batch as if it were one forward (ml.batch_aux_losses), and the router metrics.

    Units: rows for a sequence router, unpadded prompt + completion tokens for a token router. The balance
    loss's utilisation f_e (no gradient) is the whole batch's, known before the first backward: from the prompt
    summaries (sequence router), from the forward itself (one micro-batch), or from a no-grad routing pass over
    the micro-batches (token router, several micro-batches, balance_coef > 0). So micro_batch_size does not
    change the gradient (tests/test_molora_grpo.py).

    Data parallel (sum_over_ranks: a flat tensor -> its sum over the ranks): the unit count and f_e are the
    whole batch's over all ranks (the routing pass then always runs), so the ranks' aux shares add up to the
    one-process loss; the metrics are summed over ranks too. Every rank must construct it and call metrics()."""

    def __init__(self, model, micro_batches: list, forward, sum_over_ranks=None):
        """micro_batches: the update's trimmed RolloutSlices in order; forward(micro): a no-grad forward of the
        model over one of them (routing context included)."""
        self.model = model
        self.sum_over_ranks = sum_over_ranks
        config = ml.routing_state(model).config
        masks = [self._mask(m) for m in micro_batches]
        sequence = config.router == "sequence"
        self.units = float(sum(m.shape[0] for m in masks)) if sequence else float(sum(m.sum() for m in masks))
        if sum_over_ranks is not None:
            self.units = float(sum_over_ranks(torch.tensor([self.units]))[0])
        self.stats = ml.RouterStats.for_model(model)
        self.aux_total = 0.0
        self.utilisation = None  # None: from the training forwards themselves (one micro-batch, one process)
        if config.balance_coef > 0 and (len(micro_batches) > 1 or sum_over_ranks is not None):
            pre = ml.RouterStats.for_model(model)
            if sequence and micro_batches:
                pre.add_summaries(model, torch.cat([ml.prompt_summary_padded(model, m.prompt_ids_BTp, m.prompt_mask_BTp)
                                                    for m in micro_batches]))
            elif not sequence:
                with torch.no_grad():
                    for micro, mask in zip(micro_batches, masks):
                        forward(micro)
                        pre.add_forward(model, mask)
            if sum_over_ranks is not None:
                pre = pre.summed(sum_over_ranks, len(ml.molora_modules(model)))
            self.utilisation = pre.utilisation()

    @staticmethod
    def _mask(micro) -> torch.Tensor:
        return torch.cat([micro.prompt_mask_BTp, micro.completion_mask_BTc], dim=1)

    def aux_share(self, micro) -> torch.Tensor:
        """After a micro-batch's training forward: its share of the batch's auxiliary loss."""
        mask = self._mask(micro)
        record_device = ml.molora_modules(self.model)[0][1].molora_A.device
        mask = mask.to(record_device)
        self.stats.add_forward(self.model, mask)
        utilisation = self.stats.utilisation() if self.utilisation is None else self.utilisation
        aux = ml.batch_aux_losses(self.model, utilisation, self.units, mask).total
        self.aux_total += aux.item()
        return aux

    def metrics(self) -> dict[str, float]:
        stats, aux_total = self.stats, self.aux_total
        if self.sum_over_ranks is not None:  # a collective: every rank calls it
            stats = stats.summed(self.sum_over_ranks, len(ml.molora_modules(self.model)))
            aux_total = float(self.sum_over_ranks(torch.tensor([aux_total], dtype=torch.float64))[0])
        return {"aux_loss": aux_total, **stats.metrics()} if stats.hits_ME is not None and stats.units else {}
