"""Data parallel on torch.distributed, launched by torchrun (`torchrun --nproc_per_node N -m rlora train ...`).

Each rank samples, scores and trains on its own share of the step's prompts (whole groups, so group
advantages need no communication). What crosses ranks: the loss normalisers (token, sequence and row
counts), the adapter gradients (summed: each rank's loss is already divided by the global counts, so the
sum is the full-batch gradient; several policies' and PPO's critic's each on their own), batch-wide
statistics (adv_scale=batch, REINFORCE++ and PPO whitening: counts, sums, squared deviations), MoLoRA's
routing sums, the update's metric sums, the other metrics (merged), replay buffers for checkpoints, and a
checksum that proves the ranks' adapters agree. `rlora sft` / `rlora rm` sum their counts and gradients the
same way. gloo on CPU, NCCL on GPU; multi-node works with torchrun's usual --nnodes/--rdzv flags.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from rlora.errors import UserError
from rlora.logging.console import console


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.size > 1

    def share(self, items: list) -> list:
        """This rank's contiguous share of a list whose length is a multiple of the world size."""
        per_rank = len(items) // self.size
        return items[self.rank * per_rank:(self.rank + 1) * per_rank]


T = TypeVar("T")


def on_every_rank(run: Callable[[World], T]) -> T:
    """run(world) in this process: under torchrun on every rank, rank 0 alone printing; then the process group
    is shut down (also when run raises)."""
    world = init_world()
    console.quiet = not world.is_main
    try:
        return run(world)
    finally:
        shutdown(world)


def on_rank_zero(world: World, check: Callable[[], None]) -> None:
    """check() on rank 0 (e.g. that the output folder may be written); if it raised, every rank raises the same
    error, so no rank goes on to load the model alone. Every rank carries rank 0's message because torchrun
    stops the others as soon as one rank exits: whichever rank gets to print must say why. A collective."""
    error = None
    if world.is_main:
        try:
            check()
        except UserError as err:
            error = err
    if world.active:
        message = gather_objects(world, None if error is None else str(error))[0]
        if message is not None and error is None:
            raise UserError(message)
    if error is not None:
        raise error


def init_world() -> World:
    """World of this process: torchrun's WORLD_SIZE/RANK environment, or a single process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # rank 0 evaluates alone while the others wait at a barrier: allow long evaluations
        dist.init_process_group(backend, timeout=datetime.timedelta(hours=2))
    return World(dist.get_rank(), dist.get_world_size())


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sums(world: World, values: list[float]) -> list[float]:
    if not world.active:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_tensor(world: World, tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor over ranks (on the tensor's device; a copy)."""
    if not world.active:
        return tensor
    out = tensor.to(_device()).clone()
    dist.all_reduce(out)
    return out.to(tensor.device)


def all_reduce_max(world: World, value: float) -> float:
    if not world.active:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def all_reduce_gradients(world: World, params: list[torch.nn.Parameter]) -> None:
    """Sum the adapter gradients over ranks, in one flat buffer (a rank without a gradient adds zeros). If no
    rank had a gradient, the gradients stay None, as in one process: the optimiser then skips the step
    rather than applying momentum and weight decay to zero gradients."""
    if not world.active:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    had = float(any(p.grad is not None for p in params))
    flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_tensor([had])]).to(_device())
    dist.all_reduce(flat)
    if flat[-1] == 0:
        for p in params:
            p.grad = None
        return
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g).to(g.device)
        offset += g.numel()


def gather_objects(world: World, obj) -> list:
    if not world.active:
        return [obj]
    out = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def rank_divergence(world: World, params: list[torch.nn.Parameter]) -> float:
    """Largest difference between ranks of the adapter's sum and sum of squares: 0.0 when every rank holds
    the same adapter (the update is identical on each rank by construction; this checks it)."""
    if not world.active:
        return 0.0
    with torch.no_grad():
        total = sum(float(p.double().sum()) for p in params)
        squares = sum(float(p.double().pow(2).sum()) for p in params)
    sums = gather_objects(world, (total, squares))
    return max(max(abs(a[0] - b[0]), abs(a[1] - b[1])) for a in sums for b in sums)


def barrier(world: World) -> None:
    if world.active:
        dist.barrier()


def shutdown(world: World) -> None:
    if world.active and dist.is_initialized():
        dist.destroy_process_group()
