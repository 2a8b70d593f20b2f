"""MoLoRA where rlora runs a model: the routing context of a forward (training log-prob passes, the samplers)
and the batch-wide auxiliary loss of an RL update (RolloutRouting: models/molora BatchAuxLoss over the update's
rollout micro-batches). The reference policy (the mixture off) is models/adapters.py MoLoRA.disabled().

It stays outside the models/molora package because it reads rollout slices and the samplers' row layout.

Sequence routers are decided by the prompt alone: every forward over rows of known prompts runs inside
`prompt_routing(model, prompt_ids_BT, prompt_mask_BT)`, which sets the prompts' summaries (the same bits for a
prompt in any batch, models/molora/model.py prompt_summary), so the sampler's prefill and decoding steps and
the trainer's forward over prompt + completion use identical gates. For a model without sequence-routed MoLoRA
layers (plain LoRA, token routers) the contexts do nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch

from rlora.models import molora as ml
from rlora.types import RolloutSlice


def prompt_routing(model, prompt_ids_BT: torch.Tensor, prompt_mask_BT: torch.Tensor):
    """The routing context of a forward over these B rows (padded prompts; mask 1 = prompt token)."""
    if not ml.sequence_routed(model):
        return nullcontext()
    return ml.sequence_routing(model, ml.prompt_summary_padded(model, prompt_ids_BT, prompt_mask_BT))


def checkpoint_kwargs(model) -> dict:
    """torch.utils.checkpoint's extra arguments for the model's checkpointed layers (train.gradient_checkpointing):
    for a model with MoLoRA layers a `context_fn`, so that a layer's recompute in the backward pass runs in the
    routing state its forward ran in (a sequence router's prompt summaries, the mixture on or off). The backward
    runs after the forward's routing context has ended, where the summaries are unset. {} for other models."""
    if not ml.has_molora(model):
        return {}
    state = ml.routing_state(model)

    def context_fn():
        return nullcontext(), _routing_as(state, state.summary_BD, state.disabled)  # read now, at the forward

    return {"context_fn": context_fn}


@contextmanager
def _routing_as(state: ml.RoutingState, summary_BD: torch.Tensor | None, disabled: bool):
    previous = state.summary_BD, state.disabled
    state.summary_BD, state.disabled = summary_BD, disabled
    try:
        yield
    finally:
        state.summary_BD, state.disabled = previous


def prompt_list_routing(model, prompts: list[list[int]]):
    """prompt_routing of unpadded token lists (one row each)."""
    return ml.routing_from_prompts(model, prompts) if ml.sequence_routed(model) else nullcontext()


class SamplerRouting:
    """The routing of a sampler that prefills P prompts, then decodes G rows per prompt (row b belongs to prompt
    b // G) whose active subset changes from step to step. Without a sequence router every call is a no-op."""

    def __init__(self, model, prompts: list[list[int]], G: int):
        self.model, self.G = model, G
        self.summary_PD = ml.prompt_summary(model, prompts) if ml.sequence_routed(model) else None

    @property
    def routes(self) -> bool:
        """Whether the rows' prompts change what a forward computes (a sequence router)."""
        return self.summary_PD is not None

    def prompts(self, index_n: list[int] | None = None) -> None:
        """The next forward runs these of the P prompts (prefill; None: all of them)."""
        if self.summary_PD is not None:
            ml.set_sequence_routing(self.model, self.summary_PD if index_n is None else self.summary_PD[index_n])

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


def rollout_unit_mask(micro: RolloutSlice) -> torch.Tensor:
    """[B, Tp + Tc] the attention mask of a micro-batch's forward over prompt + completion (1 = a real token)."""
    return torch.cat([micro.prompt_mask_BTp, micro.completion_mask_BTc], dim=1)


class RolloutRouting(ml.BatchAuxLoss):
    """MoLoRA's part of one RL update over the rows of a rollout, run as micro-batches (RolloutSlices, in
    order): the auxiliary loss of the whole update batch as if it were one forward, and the router metrics,
    as ml.BatchAuxLoss computes them for `rlora sft` too. Units: rows for a sequence router, unpadded prompt +
    completion tokens for a token router. forward(micro): a forward of the model over one micro-batch (routing
    context included), for a token router's routing pass. sum_over_ranks (data parallel): see ml.BatchAuxLoss;
    a rank without rows constructs one with no micro-batches (train/update.py contribute_nothing).
    padding: micro-batches a token router's routing pass also forwards, uncounted, after the rank's own (a sharded
    base: as many passes as the busiest rank)."""

    def __init__(self, model, micro_batches: list[RolloutSlice], forward,
                 sum_over_ranks: ml.SumOverRanks | None = None, padding: Sequence[RolloutSlice] = ()):
        def prompt_summaries() -> torch.Tensor:
            return torch.cat([ml.prompt_summary_padded(model, m.prompt_ids_BTp, m.prompt_mask_BTp)
                              for m in micro_batches])

        forwarded = [*micro_batches, *padding]
        super().__init__(model, [rollout_unit_mask(m) for m in micro_batches], prompt_summaries,
                         lambda index: forward(forwarded[index]), sum_over_ranks, len(padding))

    def aux_share(self, micro: RolloutSlice) -> torch.Tensor:
        """After a micro-batch's training forward: its share of the batch's auxiliary loss."""
        return self.share(rollout_unit_mask(micro))
