"""train.fsdp: the frozen base's decoder layers sharded across the data-parallel ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`), so each rank holds 1/N of their weights between uses.

What is sharded: every decoder layer is its own FSDP unit (its weights all-gathered just before the layer
runs and freed after it, in forward and again in backward). Not sharded: the embeddings, the final norm,
the output layer (often tied to the embeddings) and the adapter: every parameter with requires_grad stays a
whole, ordinary tensor on every rank (`ignored_params`), so the optimiser, the gradient all-reduce
(distributed.py), checkpoints and the sampler's LoRA merge see what they see without FSDP.

Sampling: the built-in sampler reads the weights directly (rollout/decoder.py), not through the layers'
forward, so `ShardedBase.gathered()` all-gathers every layer for the whole sampling call and frees the
copies afterwards: during sampling each rank holds the full base. Evaluation (rank 0 alone) runs inside the
same gathered state, entered by every rank.

FSDP's all-gathers are collectives: every rank must run the same sequence of layer passes. The step's
log-prob passes over a rank's rollout are the same on every rank when every rank has the same number of
rows (check_fsdp refuses what changes that: dynamic sampling, adaptive resampling, reward adapters); the
policy update skips rows that cannot contribute, a different number per rank, so ranks with fewer
micro-batches add passes that change no gradient (`passes_to_add`, `zero_pass`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from rlora.errors import UserError
from rlora.logging.console import info
from rlora.models.frozen_prefix import FrozenPrefix
from rlora.models.loading import causal_lm, model_device
from rlora.models.logprobs import completion_logprobs
from rlora.rollout.batching import trim
from rlora.train.distributed import World, all_reduce_max
from rlora.types import Rollout


def check_fsdp(cfg, world: World) -> None:
    """What train.fsdp needs, before anything loads (check_world has refused what data parallel cannot do)."""
    if not cfg.train.fsdp:
        return
    if not world.active:
        raise UserError("train.fsdp shards the base across data-parallel ranks: launch with torchrun "
                        "--nproc_per_node N (N >= 2), or set train.fsdp=false")
    if cfg.model.quantization != "none":
        raise UserError(f"train.fsdp does not shard a quantized base (model.quantization={cfg.model.quantization}): "
                        "set model.quantization=none or train.fsdp=false")
    if cfg.algo.dynamic_sampling or cfg.algo.adaptive.enabled:
        raise UserError("train.fsdp needs every rank to sample and train the same number of rows each step; "
                        "algo.dynamic_sampling and algo.adaptive resample per rank: disable them or train.fsdp")
    if any(spec.fn == "reward_model" for spec in cfg.rewards):
        raise UserError("train.fsdp does not support rewards fn: reward_model yet (the reward adapter scores "
                        "through the sharded base a different number of times per rank): set train.fsdp=false")


def is_sharded(model) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


class ShardedBase:
    """The FSDP units of a model, and the state where every one of them is gathered."""

    def __init__(self, units: list[FSDPModule]):
        self.units = units
        self.depth = 0  # gathered() nests: evaluation gathers, and its sampler calls gather again

    @contextmanager
    def gathered(self):
        """Every unit's full weights on this rank inside (a collective: every rank enters together); layers
        called as modules inside keep them (no reshard after forward). Freed on the way out."""
        if self.depth == 0:
            for unit in self.units:
                unit.set_reshard_after_forward(False, recurse=False)
                unit.unshard()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for unit in self.units:
                    unit.reshard()
                    unit.set_reshard_after_forward(True, recurse=False)


def shard_base(model, world: World) -> ShardedBase:
    """fully_shard every decoder layer of the model (in place) over all ranks; trainable parameters stay whole."""
    units = []
    for layer in causal_lm(model).model.layers:
        trainable = {p for p in layer.parameters() if p.requires_grad}
        # explicit True: a layer that is its own FSDP root would otherwise keep its weights after forward
        units.append(fully_shard(layer, reshard_after_forward=True, ignored_params=trainable))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in frozen)
    info(f"train.fsdp: {len(units)} decoder layers sharded over {world.size} ranks; rank {world.rank} holds "
         f"{held:,} of the base's {sum(p.numel() for p in frozen):,} parameters between sampling calls")
    return ShardedBase(units)


class GatheredSampler:
    """A Generator whose every sample() call runs on the gathered base."""

    def __init__(self, generator, sharded: ShardedBase):
        self.generator, self.sharded = generator, sharded
        self.name = generator.name

    def sample(self, model, *args, **kwargs) -> Rollout:
        """Generator.sample's arguments, passed on as they come."""
        with self.sharded.gathered():
            return self.generator.sample(model, *args, **kwargs)


def passes_to_add(world: World, model, passes: int) -> int:
    """Sharded base: how many passes this rank adds so that every rank runs as many forward/backward passes as
    the busiest one (their all-gathers pair up). A collective: call it before the passes. 0 without FSDP."""
    if not world.active or not is_sharded(model):
        return 0
    return int(all_reduce_max(world, passes)) - passes


def zero_pass(model, rollout: Rollout, chunk_tokens: int, prefix: FrozenPrefix | None) -> None:
    """The forward and backward pass of the rollout's first row, times 0: the same layers and collectives as a
    training pass; every adapter gradient gets + 0.0. The random state is put back (LoRA dropout draws), so
    later passes draw what they draw without the padding."""
    device = model_device(model)
    micro = trim(rollout.select(slice(0, 1)))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        logp_BT, _ = completion_logprobs(model, micro, chunk_tokens=chunk_tokens,
                                         prefix=None if prefix is None else prefix.rows(slice(0, 1), micro))
        (logp_BT.sum() * 0.0).backward()
