"""train.fsdp: the frozen base's decoder layers sharded across the data-parallel ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`), so each rank holds 1/N of their weights between uses.

What is sharded: every decoder layer is its own FSDP unit (its weights all-gathered just before the layer
runs and freed after it, in forward and again in backward). Not sharded: the embeddings, the final norm,
the output layer (often tied to the embeddings) and the adapter: every parameter with requires_grad stays a
whole, ordinary tensor on every rank (`ignored_params`), so the optimiser, the gradient all-reduce
(distributed.py), checkpoints and the sampler's LoRA merge see what they see without FSDP. The base loads on
the CPU and goes to the device one layer at a time as it is sharded (models/sharded_base.py).

Sampling: the built-in sampler reads the weights directly (rollout/decoder.py), not through the layers'
forward; train.fsdp_gather picks whether a sampling call gathers the whole base or streams it layer by layer
(models/sharded_base.py). Evaluation (rank 0 alone) runs inside the same sampling scope, entered by every rank,
and so does a step's sampling where ranks call the sampler a different number of times (step_sampling_scope:
episodes, adaptive resampling, dynamic sampling's extra prompts).

FSDP's all-gathers are collectives: every rank must run the same sequence of layer passes. A rank's rollout
may hold fewer rows than another's (dynamic sampling keeps each rank's informative groups, replay draws each
rank's own number of stored groups) or none (dynamic sampling kept none of its groups): each log-prob phase of
the step (frozen prefix, reference, old) then adds passes of one row whose results are dropped (`PassPadding`),
and a rank without rows makes them with a row of a group it dropped. The policy update skips rows that cannot
contribute, a different number per rank, so ranks with fewer micro-batches add passes that change no gradient
(`passes_to_add`, `zero_pass`). What would make the passes themselves differ is refused (config/refusals.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from rlora.errors import UserError
from rlora.logging.console import info
from rlora.models.frozen_prefix import FrozenPrefix, prefix_hidden
from rlora.models.loading import model_device
from rlora.models.logprobs import completion_logprobs
from rlora.models.multi_lora import policy_rows
from rlora.models.sharded_base import ShardedBase, held_parameters, shard_layers
from rlora.batching import trim
from rlora.train.distributed import World, all_reduce_max
from rlora.types import Rollout, RolloutSlice


def is_sharded(model) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def shard_base(model, world: World, device: torch.device, gather: str) -> ShardedBase:
    """fully_shard every decoder layer of the model (in place) over all ranks, onto `device`; trainable parameters
    stay whole. The model may arrive on the CPU (load_base_model(place=False)): everything ends on `device`."""
    sharded = shard_layers(model, device, gather, lambda flag: all_reduce_max(world, float(flag)) > 0)
    held, total = held_parameters(model)
    when = "between sampling calls" if gather == "model" else "plus about two decoder layers while sampling"
    info(f"train.fsdp: {len(sharded.units)} decoder layers sharded over {world.size} ranks; rank {world.rank} holds "
         f"{held:,} of the base's {total:,} parameters {when} (train.fsdp_gather={gather})")
    return sharded


class ShardedSampler:
    """A Generator whose every sample() call runs in the sharded base's sampling scope (every rank calls it). It
    continues rows from their caches (sample_continued, an episode's later turns) where the generator does."""

    def __init__(self, generator, sharded: ShardedBase):
        self.generator, self.sharded = generator, sharded
        self.name = generator.name
        if hasattr(generator, "sample_continued"):  # the episode runner looks for it: only where it exists
            self.sample_continued = self._continued

    def sample(self, model, *args, **kwargs) -> Rollout:
        """Generator.sample's arguments, passed on as they come."""
        with self.sharded.sampling():
            return self.generator.sample(model, *args, **kwargs)

    def _continued(self, model, *args, **kwargs):
        """The generator's sample_continued, its arguments passed on as they come."""
        with self.sharded.sampling():
            return self.generator.sample_continued(model, *args, **kwargs)


def sharded_samplers(generator, eval_generator, sharded: ShardedBase, cfg) -> tuple[ShardedSampler, ShardedSampler]:
    """The run's samplers over the sharded base (cfg: the run's RLConfig). Streaming needs the built-in sampler: a
    model it does not run samples with transformers generate, whose layer all-gathers the ranks could not pair up
    (a one-line UserError, before anything is written)."""
    if cfg.train.fsdp_gather == "layer" and "hf" in (generator.name, eval_generator.name):
        raise UserError("train.fsdp_gather=layer streams the layers through rlora's built-in sampler, which does not "
                        "support this model (it samples with transformers generate): set train.fsdp_gather=model")
    if cfg.train.fsdp_gather == "layer" and cfg.rollout.merge_adapter:
        info("train.fsdp_gather=layer with rollout.merge_adapter=true merges the LoRA into every layer in every "
             "decode step: rollout.merge_adapter=false samples faster here (docs/fsdp.md)")
    return ShardedSampler(generator, sharded), ShardedSampler(eval_generator, sharded)


def step_sampling_scope(sharded: ShardedBase | None, rank_dependent: bool) -> Callable[[], AbstractContextManager]:
    """The scope a step's sampling (all its sampler calls and their scoring) runs in. Where ranks call the sampler a
    different number of times in a step (rank_dependent: an episode's turns, adaptive resampling of the groups that
    fail, dynamic sampling's extra prompts), every rank enters one sampling scope of the sharded base around all
    of them: inside it the calls nest, so they gather nothing again (train.fsdp_gather=model), or their passes over
    the layers pair with the other ranks' in any order, and a rank that is done pairs the rest with empty passes
    when it leaves the scope (layer: models/sharded_base.py). Environments and rewards then run inside the scope:
    with `layer` a rank's time there holds up the other ranks' next pass, with `model` the gathered base stays held
    through it. Otherwise (one sampler call a step, or no sharded base) nothing: each call holds its own scope
    (ShardedSampler)."""
    if sharded is None or not rank_dependent:
        return nullcontext
    return sharded.sampling


def passes_to_add(world: World, model, passes: int) -> int:
    """Sharded base: how many passes this rank adds so that every rank runs as many forward/backward passes as
    the busiest one (their all-gathers pair up). A collective: call it before the passes. 0 without FSDP."""
    if not world.active or not is_sharded(model):
        return 0
    return int(all_reduce_max(world, passes)) - passes


def zero_pass(model, rollout: Rollout, chunk_tokens: int, prefix: FrozenPrefix | None,
              policy_B: torch.Tensor | None = None) -> None:
    """The forward and backward pass of the rollout's first row, times 0: the same layers and collectives as a
    training pass, and no gradient changes (a parameter without a gradient keeps none, so an adapter that
    trained nothing still skips its step). The random state is put back (LoRA dropout draws), so later passes
    draw what they draw without the padding. policy_B: each row's policy, with several policies."""
    device = model_device(model)
    micro = trim(rollout.select(slice(0, 1)))
    trainable = [p for p in model.parameters() if p.requires_grad]
    without_grad = [p for p in trainable if p.grad is None]
    with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
          policy_rows(model, None if policy_B is None else policy_B[:1])):
        logp_BT, _ = completion_logprobs(model, micro, chunk_tokens=chunk_tokens,
                                         prefix=None if prefix is None else prefix.rows(slice(0, 1), micro))
        (logp_BT.sum() * 0.0).backward()
    for param in without_grad:
        param.grad = None


def ranks_agree(world: World, model, flag: bool) -> bool:
    """Sharded base: whether `flag` holds on every rank (a collective: every rank calls it), so that all ranks take
    the same passes. This rank's own flag without FSDP."""
    if not world.active or not is_sharded(model):
        return flag
    return all_reduce_max(world, float(not flag)) == 0


# a padding row's policy where the model has several: any one makes the same passes through the sharded layers (the
# adapters are not sharded), and the results are dropped
_A_POLICY = torch.zeros(1, dtype=torch.long)


@dataclass(frozen=True)
class PassPadding:
    """The passes a rank adds after each log-prob phase of a step (frozen prefix, reference, old) so that it makes
    as many passes through the sharded base as the busiest rank: `count` passes of `row`, their results dropped."""

    count: int = 0
    row: RolloutSlice | None = None  # one row: the rank's first, or a dropped group's on a rank without rows

    def prefix_passes(self, model, num_frozen: int) -> None:
        """The frozen lower layers' passes (FrozenPrefix's, one micro-batch each)."""
        with _as_no_grad_pass(model):
            for _ in range(self.count):
                prefix_hidden(model, self.row, num_frozen)

    def logprob_passes(self, model, chunk_tokens: int, prefix: FrozenPrefix | None) -> None:
        """Log-prob passes (batched_logprobs' micro-batches), above the frozen prefix where the phase has one. A
        padding pass's layers are what a real one's are, whatever adapter is on: the adapters are not sharded."""
        with _as_no_grad_pass(model):
            for _ in range(self.count):
                completion_logprobs(model, self.row, chunk_tokens=chunk_tokens,
                                    prefix=None if prefix is None else prefix.rows(slice(0, 1), self.row))


@contextmanager
def _as_no_grad_pass(model):
    """Eval mode (no dropout) and no gradient, as the phases' own passes run; the training flag comes back after. With
    several policies the row goes through the first (_A_POLICY)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), policy_rows(model, _A_POLICY):
            yield
    finally:
        model.train(was_training)


def pass_padding(world: World, model, rollout: Rollout, micro_batch_size: int) -> PassPadding:
    """This rank's PassPadding for log-prob phases over `rollout` in micro-batches of `micro_batch_size` rows (a
    collective on a sharded base; no padding without one)."""
    passes = -(-rollout.num_completions // micro_batch_size)
    count = passes_to_add(world, model, passes)
    return PassPadding(count, trim(rollout.select(slice(0, 1))) if count else None)


@dataclass(frozen=True)
class ZeroPasses:
    """The update's passes of a rank without rows on a sharded base: zero_pass of `row` (a dropped group's), above
    the frozen prefix it computed for the step's log-prob phases (None: the step has none), and the forwards of a
    MoLoRA token router's routing pass."""

    model: torch.nn.Module
    row: Rollout
    chunk_tokens: int
    prefix: FrozenPrefix | None

    def run(self, count: int) -> None:
        for _ in range(count):
            zero_pass(self.model, self.row, self.chunk_tokens, self.prefix, _A_POLICY)

    def micro(self) -> RolloutSlice:
        return trim(self.row.select(slice(0, 1)))

    def forward(self, micro: RolloutSlice) -> None:
        """A full forward of the row, as the update's routing pass makes (a MoLoRA token router's)."""
        completion_logprobs(self.model, micro, chunk_tokens=self.chunk_tokens)
