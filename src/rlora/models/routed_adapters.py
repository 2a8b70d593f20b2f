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

Inside a mixture-of-experts block the layers see the block's B * T tokens, flattened row by row, so the runs go
over tokens there (each row's T with it): a linear map as above, a router's LoRA on its [E, H] weight by running
the family's router on W + that run's delta, and experts that models/expert_lora.py computes on the activations
with each token's adapter as its slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from rlora.models import block_routing, expert_lora
from rlora.models.multi_lora import lora_layers
from rlora.models.sparse_blocks import in_sparse_block, sparse_block_names

Runs = list[tuple[int, int]]  # (adapter index, number of consecutive inputs along dim 0), in order


class AdapterRoutes:
    """The adapters of a routed model and the runs of the forwards now running."""

    def __init__(self, names: list[str]):
        self.names = list(names)  # peft adapter names; a run's adapter index points here
        self.runs: Runs | None = None
        self.dims = 0  # the inputs' number of dimensions the runs are for
        self.row_tokens: int | None = None  # T of the rows [B, T, I] the runs are over (dims 3)

    @contextmanager
    def routed(self, runs: Runs, dims: int, row_tokens: int | None = None):
        """The forwards inside send their inputs along dim 0 through these runs' adapters (then the runs before).
        dims: the adapted layers' inputs have so many dimensions (3: rows [B, T, I]; 2: positions [N, H]); a layer
        fed anything else refuses to run rather than route by coincidence of counts, except inside a mixture's
        sparse block, which flattens its rows to [B * T, H] tokens row by row: with row_tokens = T given, its layers
        route each row's T tokens with the row. Anything that runs the layers again (a checkpointed function
        recomputed in backward) must run inside."""
        previous = (self.runs, self.dims, self.row_tokens)
        self.runs, self.dims, self.row_tokens = list(runs), dims, row_tokens
        try:
            yield
        finally:
            self.runs, self.dims, self.row_tokens = previous

    def inputs_runs(self, x: torch.Tensor, in_block: bool) -> Runs:
        """The runs over x's dim 0: the routed runs, or inside a sparse block the rows' runs in tokens."""
        runs = self.runs
        if runs is None:
            raise RuntimeError("a forward through routed adapters without its inputs' adapters (AdapterRoutes.routed)")
        rows = sum(count for _, count in runs)
        if in_block and self.dims == 3 and self.row_tokens and x.dim() == 2 and x.shape[0] == rows * self.row_tokens:
            return [(k, count * self.row_tokens) for k, count in runs]
        if x.dim() != self.dims or rows != x.shape[0]:  # never guess
            raise RuntimeError(f"inputs {tuple(x.shape)} where runs over {rows} inputs of {self.dims} dimensions "
                               "were routed")
        return runs

    def on(self, runs: Runs, module: nn.Module) -> bool:
        """Whether an adapter of these runs is on the module."""
        return any(self.names[k] in module.lora_A for k, _ in runs)


def _routed_forward(module: nn.Module, routes: AdapterRoutes, in_block: bool):
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = module.base_layer(x, *args, **kwargs)
        if routes.runs is None:
            raise RuntimeError("a forward through routed adapters without its inputs' adapters (AdapterRoutes.routed)")
        # no adapter of this forward is on this layer (e.g. another client's)
        if not routes.on(routes.runs, module):
            return result
        if isinstance(module, ParamWrapper):  # a parameter's LoRA the loop below would apply as a linear map's
            raise RuntimeError(f"routed adapters on peft's {module.parameter_name} parameter of a layout rlora does not "
                               "route (serve's Trainee.routable keeps such an adapter out of batched passes)")
        parts, start = [], 0
        for k, count in routes.inputs_runs(x, in_block):
            name, piece = routes.names[k], result[start:start + count]
            if name in module.lora_A:  # as peft's Linear.forward for one active adapter
                lora_A, lora_B = module.lora_A[name], module.lora_B[name]
                x_run = module.lora_dropout[name](x[start:start + count].to(lora_A.weight.dtype))
                piece = (piece + lora_B(lora_A(x_run)) * module.scaling[name]).to(result.dtype)
            parts.append(piece)
            start += count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return forward


def _block_forward(module: ParamWrapper, routes: AdapterRoutes, experts: bool):
    """A forward for peft's LoRA on a router's weight or on the fused experts (their outermost wrapper) inside a
    sparse block: each row's tokens through the row's adapter (models/block_routing.py)."""
    wrappers, base = expert_lora.chain(module) if experts else ({"weight": module}, module.get_base_layer())

    def forward(x_SH: torch.Tensor, *args, **kwargs):
        if routes.runs is None:
            raise RuntimeError("a forward through routed adapters without its inputs' adapters (AdapterRoutes.routed)")
        if not any(routes.on(routes.runs, wrapper) for wrapper in wrappers.values()):  # e.g. another client's
            return base(x_SH, *args, **kwargs)
        runs = routes.inputs_runs(x_SH, in_block=True)
        slot_S = torch.repeat_interleave(torch.tensor([k for k, _ in runs]), torch.tensor([c for _, c in runs]))
        slot_S = slot_S.to(x_SH.device)
        if experts:
            return block_routing.experts_forward(module, x_SH, *args, slot_S=slot_S, slots=routes.names, **kwargs)
        return block_routing.router_forward(module, x_SH, slot_S, routes.names, *args, **kwargs)

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
    blocks = sparse_block_names(model)
    block_of = {id(module): in_sparse_block(name, blocks) for name, module in model.named_modules()}
    try:
        for module in layers:
            block = None if block_of[id(module)] is None else model.get_submodule(block_of[id(module)])
            if block is not None and block_routing.is_experts(module, block):
                module.forward = _block_forward(module, routes, experts=True)
            elif block is not None and block_routing.is_router(module):
                module.forward = _block_forward(module, routes, experts=False)
            else:
                module.forward = _routed_forward(module, routes, block is not None)
        yield routes
    finally:
        for module, forward in own:
            module.__dict__.pop("forward", None)  # the loop may have stopped part-way
            if forward is not None:
                module.forward = forward
