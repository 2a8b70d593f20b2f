"""Several named peft LoRA adapters in one forward: each input row (or token) through its own adapter.

The inputs of a forward belong to the adapters in consecutive runs along dim 0 (`runs`: (adapter index, count),
in order; rows of a decoder layer's [B, T, I] input, or positions of an output layer fed [N, H]). Every LoRA layer
runs its base layer once for all inputs, then adds to each run the delta of that run's own adapter:

    y[run] = W x[run] + s_k B_k A_k x[run]        (nothing added where adapter k is not on this layer)

Each delta is peft's own lora_B(lora_A(x)) * scaling on a slice of the inputs (a view, no copy): op for op what
peft computes for that adapter alone, so each adapter's outputs and gradients come from its own runs only.

This loops over the adapters of a forward instead of packing them into two batched matmuls as
models/multi_lora.py does for policies of one LoRA config: the adapters here differ in rank, in the layers they
target and in how many rows they own, which the packed form pays for in zero padding (every rank to the largest,
every adapter's rows to the largest count, a zero adapter where one is not on a layer) and in stacking copies of
the factors every forward. For the few adapters of one forward (rlora serve batches at most 8) the loop costs a
few small rank-r matmuls per layer beside the base matmul, which is the bulk of the work and runs once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rlora.models.multi_lora import lora_layers

Runs = list[tuple[int, int]]  # (adapter index, number of consecutive inputs along dim 0), in order


class AdapterRoutes:
    """The adapters of a routed model and the runs of the forwards now running."""

    def __init__(self, names: list[str]):
        self.names = list(names)  # peft adapter names; a run's adapter index points here
        self.runs: Runs | None = None
        self.dims = 0  # the inputs' number of dimensions the runs are for

    @contextmanager
    def routed(self, runs: Runs, dims: int):
        """The forwards inside send their inputs along dim 0 through these runs' adapters (then the runs before).
        dims: the adapted layers' inputs have so many dimensions (3: rows [B, T, I]; 2: positions [N, H]); a layer
        fed anything else (a mixture-of-experts layer, fed the tokens it got) refuses to run rather than route by
        coincidence of counts. Anything that runs the layers again (a checkpointed function recomputed in
        backward) must run inside."""
        previous, self.runs, self.dims = (self.runs, self.dims), list(runs), dims
        try:
            yield
        finally:
            self.runs, self.dims = previous


def _routed_forward(module: nn.Module, routes: AdapterRoutes):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = module.base_layer(x, *args, **kwargs)
        runs = routes.runs
        if runs is None:
            raise RuntimeError("a forward through routed adapters without its inputs' adapters (AdapterRoutes.routed)")
        # no adapter of this forward is on this layer (e.g. another client's, inside a mixture-of-experts block)
        if not any(routes.names[k] in module.lora_A for k, _ in runs):
            return result
        if x.dim() != routes.dims or sum(count for _, count in runs) != x.shape[0]:  # never guess
            raise RuntimeError(f"inputs {tuple(x.shape)} where runs over {sum(c for _, c in runs)} inputs of "
                               f"{routes.dims} dimensions were routed")
        parts, start = [], 0
        for k, count in runs:
            name, piece = routes.names[k], result[start:start + count]
            if name in module.lora_A:  # as peft's Linear.forward for one active adapter
                lora_A, lora_B = module.lora_A[name], module.lora_B[name]
                x_run = module.lora_dropout[name](x[start:start + count].to(lora_A.weight.dtype))
                piece = (piece + lora_B(lora_A(x_run)) * module.scaling[name]).to(result.dtype)
            parts.append(piece)
            start += count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return forward


@contextmanager
def routed_adapters(model: nn.Module, names: list[str]) -> Iterator[AdapterRoutes]:
    """Inside, every LoRA layer of the peft model routes its inputs to the named adapters by AdapterRoutes.routed
    (the active adapter and any other adapter play no part); afterwards the layers are peft's again."""
    layers = lora_layers(model)
    for module in layers:
        if module.merged:
            raise RuntimeError("routed adapters on a model with an adapter merged into its weights")
        if any(module.lora_variant.get(name) for name in names):
            raise RuntimeError("routed adapters are plain LoRA (no DoRA or other variant)")
    routes = AdapterRoutes(names)
    own = [(module, module.__dict__.get("forward")) for module in layers]  # a forward set on the instance, if any
    for module in layers:
        module.forward = _routed_forward(module, routes)
    try:
        yield routes
    finally:
        for module, forward in own:
            del module.forward
            if forward is not None:
                module.forward = forward
