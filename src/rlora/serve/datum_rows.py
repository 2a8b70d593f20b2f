"""A forward_backward's data as the passes that run them (`rlora serve`): data that begin alike as trees
(serve/shared_prefix.py), the others in micro-batches of consecutive data; and a pass's data as padded rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from rlora.serve import proto
from rlora.serve.losses import TokenLoss
from rlora.serve.shared_prefix import prefix_trees, sharing_unsupported

MICRO_BATCH_TOKENS = 4096  # padded tokens per forward of a forward_backward (on a GPU)
CPU_MICRO_BATCH_TOKENS = 1024  # on a CPU: forwards of 4096 tokens were 1.5x slower per token (docs/serve.md)


def target_columns(datum: proto.Datum) -> int:
    """K of a datum with K targets per token ([n, K] target_tokens), 1 for one of one ([n])."""
    targets = datum.inputs["target_tokens"]
    return targets.shape[1] if targets.ndim == 2 else 1


def token_limit(device: torch.device) -> int:
    """Padded tokens a forward of a forward_backward takes: MICRO_BATCH_TOKENS, CPU_MICRO_BATCH_TOKENS on a CPU."""
    return MICRO_BATCH_TOKENS if device.type != "cpu" else min(MICRO_BATCH_TOKENS, CPU_MICRO_BATCH_TOKENS)


def micro_batches(data: list[proto.Datum], device: torch.device) -> list[list[int]]:
    """Datum indices in groups of consecutive data whose padded length fits token_limit (one datum at least)."""
    limit = token_limit(device)
    groups: list[list[int]] = [[]]
    width = 0
    for i, datum in enumerate(data):
        grown = max(width, len(datum.tokens))
        if groups[-1] and grown * (len(groups[-1]) + 1) > limit:
            groups.append([])
            grown = len(datum.tokens)
        groups[-1].append(i)
        width = grown
    return groups


def _shareable(model: nn.Module, data: list[proto.Datum], min_shared: int | None) -> bool:
    return (min_shared is not None and len(data) > 1 and all(d.inputs["target_tokens"].ndim == 1 for d in data)
            and sharing_unsupported(model, max(len(d.tokens) for d in data)) is None)


def passes(model: nn.Module, data: list[proto.Datum], min_shared: int | None
           ) -> list[tuple[list[int], list[int] | None]]:
    """The passes a forward_backward's data run in -> (datum indices, None for a micro-batch, or for a tree the
    tokens each shares with its first: the root's length first). Trees where data share at least min_shared tokens
    (None: never) and the model allows it (shared_prefix.sharing_unsupported; one target a position)."""
    trees, rest = [], list(range(len(data)))
    if _shareable(model, data, min_shared):
        trees, rest = prefix_trees([d.tokens for d in data], min_shared)
    device = next(model.parameters()).device
    plain = [([rest[i] for i in group], None) for group in micro_batches([data[i] for i in rest], device)]
    return [(tree.data, [len(data[tree.root].tokens), *tree.shared]) for tree in trees] + (plain if rest else [])


def shares_prefixes(model: nn.Module, data: list[proto.Datum], min_shared: int | None) -> bool:
    """Whether running these data as trees (passes(); min_shared: None never) leaves at most half of their tokens to
    run: then they run alone rather than in a pass batched with other clients' (which runs every token). A rule of
    thumb: the two gains have not been measured against each other on a GPU, the only device where clients are
    batched with more than 512 tokens together."""
    if not _shareable(model, data, min_shared):
        return False
    trees, _ = prefix_trees([d.tokens for d in data], min_shared)
    return 2 * sum(sum(tree.shared) for tree in trees) >= sum(len(d.tokens) for d in data)


def padded_rows(data: list[proto.Datum], loss: TokenLoss, width: int, pad_id: int, device: torch.device):
    """The data as rows right-padded to `width`, on `device`: (ids, mask, targets [B, W], the loss inputs it reads
    {name: [B, W]}; an optional one a datum lacks takes its default). Where a datum has K targets per token ([n, K]:
    cross_entropy only), targets and inputs are [B, W, K] for the largest K: a datum with fewer fills its first
    columns, the others get weight 0."""
    columns = max((target_columns(d) for d in data if d.inputs["target_tokens"].ndim == 2), default=None)
    trailing = () if columns is None else (columns,)
    ids_BT = torch.full((len(data), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros(len(data), width, dtype=torch.long)
    names = set(loss.inputs) | set(loss.optional)  # the ones it reads (the app checked they are there)
    inputs = {name: torch.zeros(len(data), width, *trailing, dtype=torch.float32) for name in names}
    targets_BT = torch.zeros(len(data), width, *trailing, dtype=torch.long)
    for row, datum in enumerate(data):
        n, k = len(datum.tokens), target_columns(datum)
        here = (row, slice(0, n)) + ((slice(0, k),) if trailing else ())
        shape = (n, k) if trailing else (n,)
        ids_BT[row, :n], mask_BT[row, :n] = torch.tensor(datum.tokens), 1
        targets_BT[here] = torch.from_numpy(datum.inputs["target_tokens"].astype(np.int64)).reshape(shape)
        for name in names:
            value = datum.inputs.get(name)
            inputs[name][here] = (torch.full(shape, loss.optional[name]) if value is None
                                  else torch.from_numpy(value.astype(np.float32)).reshape(shape))
    return ids_BT.to(device), mask_BT.to(device), targets_BT.to(device), {k: v.to(device) for k, v in inputs.items()}
