"""A base whose decoder layers are FSDP2 units (train.fsdp), and how the sampler reads their weights.

The built-in sampler reads weights directly (rollout/decoder.py) instead of calling the layers' forward, so
FSDP's own gathering hooks do not run for it. ShardedBase.sampling() gathers them in one of two ways
(train.fsdp_gather):

- "model": every layer all-gathered for the whole sampling call and freed afterwards. Fast (one all-gather
  per layer per call), but each rank holds the full base while it samples: the model must fit one device.
- "layer": the sampler streams the layers (`stream`): each layer is all-gathered just before it runs, the next
  one prefetched while it runs, and freed after it, in every prefill and every decode step. A rank holds its
  shard plus about two layers (three with a merged adapter: the layer's merged copy), so a base larger than
  one device samples too; the price is an all-gather of every layer for every generated token.

Streaming is a sequence of collectives, so every rank must make the same passes over the layers even when
their prompts finish after different numbers of tokens, or one rank samples (evaluation) while the others
do not. Each pass starts with a vote (`any_rank`: is any rank still sampling?); a rank whose own sampling is
over keeps making passes that only gather and free the layers until the vote says every rank is done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.distributed.tensor import DTensor

from rlora.models.loading import causal_lm

GATHER_MODES = ("model", "layer")


class ShardedBase:
    """The FSDP units (decoder layers) of a model, and the two ways the sampler gathers them.

    any_rank(flag) -> bool: a collective returning whether flag is true on any rank."""

    def __init__(self, units: list[FSDPModule], gather: str, any_rank: Callable[[bool], bool]):
        if gather not in GATHER_MODES:
            raise ValueError(f"gather must be one of {GATHER_MODES}, not {gather!r}")
        self.units, self.gather, self.any_rank = units, gather, any_rank
        self.depth = 0  # sampling scopes nest: evaluation enters one, its sampler calls enter again
        self.passes = 0  # passes over the layers streamed so far, empty ones included (equal on every rank)

    @property
    def streams(self) -> bool:
        """Whether the sampler should stream the layers (inside sampling(), gather='layer')."""
        return self.gather == "layer" and self.depth > 0

    @contextmanager
    def sampling(self):
        """Where the sampler may read the layers' weights: a collective, every rank enters and leaves together
        (a rank with nothing to sample enters and leaves at once; with gather='layer' it then takes part in
        the other ranks' passes until they are done)."""
        outermost = self.depth == 0
        if outermost and self.gather == "model":
            for unit in self.units:
                unit.set_reshard_after_forward(False, recurse=False)  # layers called as modules keep them too
                unit.unshard()
        self.depth += 1
        try:
            yield
            if outermost and self.gather == "layer":
                while self.any_rank(False):  # another rank still samples: pair its passes with empty ones
                    for _ in self.stream(None, vote=False):
                        pass
        finally:
            self.depth -= 1
            if outermost and self.gather == "model":
                for unit in self.units:
                    unit.reshard()
                    unit.set_reshard_after_forward(True, recurse=False)

    def forward_pass(self) -> None:
        """Before a forward of the layers as modules (a reward adapter scoring) inside a streaming scope: the
        forward all-gathers each layer in turn, as a stream() pass does, so it votes and counts like one, and its
        gathers pair with the other ranks' passes (their own, or the empty ones of a rank that is done). Outside
        such a scope (the trainer's passes, or gather='model') nothing."""
        if self.streams:
            self.any_rank(True)
            self.passes += 1

    def stream(self, build: Callable[[nn.Module], object] | None, vote: bool = True) -> Iterator[object]:
        """One pass over the layers: build(layer) for each while its weights are gathered (None: gather and free
        only). The next layer's all-gather runs while the caller uses this one; each layer is freed, and its
        built item released (`release()`, where it has one), once the caller asks for the next."""
        if not self.streams:
            raise RuntimeError("streaming a sharded base's layers needs ShardedBase.sampling() with gather='layer', "
                               "entered on every rank")
        if vote:
            self.any_rank(True)
        self.passes += 1
        pending = self.units[0].unshard(async_op=True)
        for i, unit in enumerate(self.units):
            pending.wait()
            pending = self.units[i + 1].unshard(async_op=True) if i + 1 < len(self.units) else None
            item = None if build is None else build(unit)
            try:
                yield item
            finally:
                if hasattr(item, "release"):  # its copies (merged weights) go before the next layer's are made
                    item.release()
                unit.reshard()


class StreamedLayers:
    """The sampler's layer list on a streamed base: its length, and each pass over it built layer by layer
    (ShardedBase.stream). Iterate it once per forward pass; never keep an item past its turn."""

    def __init__(self, sharded: ShardedBase, build: Callable[[nn.Module], object]):
        self.sharded, self.build = sharded, build

    def __len__(self) -> int:
        return len(self.sharded.units)

    def __iter__(self):
        return self.sharded.stream(self.build)


def shard_layers(model: nn.Module, device: torch.device, gather: str,
                 any_rank: Callable[[bool], bool]) -> ShardedBase:
    """fully_shard every decoder layer (in place) over the default process group, onto `device`, one layer at a
    time: a model loaded on the CPU never has more than one whole layer on the device. Trainable parameters
    (the adapters) stay whole tensors. Then the rest of the model (embeddings, norm, output layer) moves to the
    device. The ShardedBase is registered on the model for the sampler (`sharded_base`)."""
    units = []
    for layer in causal_lm(model).model.layers:
        layer.to(device)
        # what trains stays whole, and so does every adapter frozen for now (PPO's value adapter outside its
        # passes, a reward adapter): its weights switch to training or are read without the layer's forward
        whole = {p for p in layer.parameters() if p.requires_grad} | adapter_parameters(layer)
        # explicit True: a layer that is its own FSDP root would otherwise keep its weights after forward
        units.append(fully_shard(layer, reshard_after_forward=True, ignored_params=whole))
    _move_unsharded(model, device)
    sharded = ShardedBase(units, gather, any_rank)
    causal_lm(model).rlora_sharded_base = sharded
    # the built-in sampler reads the layers' weights through stream(), never through this forward
    causal_lm(model).model.register_forward_pre_hook(lambda _module, _args: sharded.forward_pass())
    return sharded


def adapter_parameters(module: nn.Module) -> set[nn.Parameter]:
    """Every LoRA adapter's parameters inside `module`, trainable or frozen (peft's adapter layers: lora_A/B, the
    embeddings' A/B, DoRA's magnitudes)."""
    params = set()
    for tuner in module.modules():
        if isinstance(tuner, BaseTunerLayer):
            for name in tuner.adapter_layer_names:
                params.update(getattr(tuner, name).parameters())
    return params


def _move_unsharded(model: nn.Module, device: torch.device) -> None:
    """Every parameter and buffer that is not an FSDP shard to `device`, in place (tied weights stay tied)."""
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def sharded_base(model: nn.Module) -> ShardedBase | None:
    return getattr(causal_lm(model), "rlora_sharded_base", None)


def held_parameters(model: nn.Module) -> tuple[int, int]:
    """(frozen parameters this rank holds, frozen parameters of the whole base: adapters left out)."""
    adapters = adapter_parameters(model)
    frozen = [p for p in model.parameters() if not p.requires_grad and p not in adapters]
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in frozen)
    return held, sum(p.numel() for p in frozen)
