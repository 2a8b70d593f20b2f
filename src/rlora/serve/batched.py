"""Several training clients' forward_backward (or forward) in one pass: one base forward for all their rows.

serve/jobs.py hands the worker the forward_backward requests that different clients queued back to back (one
per client; all training or all forward-only). Their data become the rows of one list, client by client,
micro-batched by padded tokens as one request's are. Every LoRA layer runs its base layer once for all rows and
adds each row's own client's adapter (models/routed_adapters.py); the output layer, which runs on the kept
positions a checkpointed chunk at a time, routes each position (inside the chunk, since backward runs it again).
Each client's loss is its own loss function and config on its own rows; one backward of the summed losses gives
each adapter the gradient of its own rows only: the numbers of each client alone, in other batch shapes.

Failures: a member whose client is unknown gets its own 404 and the others run. If the pass raises, every
member's gradients are taken back (each client is exactly as before it) and the error goes up: jobs.py then
runs each member alone, so each gets its own result or its own error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rlora.models.named_adapters import kept_flags
from rlora.models.routed_adapters import AdapterRoutes, Runs, routed_adapters
from rlora.serve import proto
from rlora.serve.datum_rows import micro_batches, padded_rows
from rlora.serve.losses import LOSSES, TokenLoss
from rlora.serve.state import ServeError
from rlora.serve.trainstate import Trainee


@dataclass
class _Member:
    trainee: Trainee
    request: proto.ForwardBackward
    config: dict[str, float]
    loss: TokenLoss
    outputs: list[np.ndarray] = field(default_factory=list)  # per datum: its log-probs
    total: float = 0.0


def forward_backward_batch(worker, requests: list[tuple[proto.ForwardBackward, dict[str, float]]],
                           ) -> list[bytes | Exception]:
    """worker: the ModelWorker. One outcome per request, in order: its forward_backward result, or the error it
    alone failed with. Raises only when the pass fails, every member's gradients taken back first (jobs.py then
    runs each request alone: a runner that raises must have changed nothing)."""
    if len({r.model_id for r, _ in requests}) < len(requests) or len({r.forward_only for r, _ in requests}) > 1:
        raise ValueError("a batched pass takes one request per training client, all of one kind")  # as jobs.py forms
    outcomes: dict[int, bytes | Exception] = {}
    members: dict[int, _Member] = {}
    for i, (request, config) in enumerate(requests):
        try:
            members[i] = _Member(worker.trainee(request.model_id), request, config, LOSSES[request.loss_fn])
        except ServeError as err:
            outcomes[i] = err
    if len(members) == 1:  # the others failed: the one left runs the plain way
        [(i, member)] = members.items()
        try:
            outcomes[i] = worker.forward_backward(member.request, member.config)
        except Exception as err:  # noqa: BLE001 - its own error, not the batch's
            outcomes[i] = err
    elif members:
        train = not requests[0][0].forward_only
        _run_pass(worker, list(members.values()), train)
        # the gradients are in: from here nothing may raise (jobs.py would run each member again, adding them twice)
        for i, member in members.items():
            if train:
                member.trainee.loss_since_step += member.total
            try:
                outcomes[i] = proto.forward_backward_output(member.outputs, {"loss:sum": member.total})
            except Exception as err:  # noqa: BLE001 - this member's answer failed, not the pass
                outcomes[i] = err
    return [outcomes[i] for i in range(len(requests))]


def _run_pass(worker, members: list[_Member], train: bool) -> None:
    rows = [(k, datum) for k, member in enumerate(members) for datum in member.request.data]  # client by client
    for member in members:
        member.outputs = [np.zeros(0, dtype=np.float32)] * len(member.request.data)
    first_row = np.cumsum([0] + [len(m.request.data) for m in members]).tolist()  # member k's rows start here
    before = [[None if p.grad is None else p.grad.clone() for p in m.trainee.params] if train else [] for m in members]
    try:
        with (kept_flags(worker.model), torch.set_grad_enabled(train),
              routed_adapters(worker.model, [m.trainee.peft_name for m in members]) as routes):
            for member in members:
                for param in member.trainee.params:
                    param.requires_grad_(train)
            for group in micro_batches([datum for _, datum in rows], worker.base.device):
                _micro_batch(worker, routes, members, rows, group, first_row, train)
    except BaseException:
        for member, grads in zip(members, before):
            for param, grad in zip(member.trainee.params, grads):
                param.grad = grad
        raise
    worker.batched_passes, worker.last_batch = worker.batched_passes + 1, len(members)


def _micro_batch(worker, routes: AdapterRoutes, members: list[_Member], rows: list[tuple[int, proto.Datum]],
                 group: list[int], first_row: list[int], train: bool) -> None:
    """One micro-batch of consecutive rows (so each member's rows in it are consecutive too): its forward, each
    member's loss on its rows, one backward of their sum."""
    runs: Runs = []  # (member, rows) of this micro-batch, in order
    for i in group:
        if runs and runs[-1][0] == rows[i][0]:
            runs[-1] = (rows[i][0], runs[-1][1] + 1)
        else:
            runs.append((rows[i][0], 1))
    width = max(len(rows[i][1].tokens) for i in group)
    device = next(worker.model.parameters()).device
    padded, start = [], 0
    for k, count in runs:
        padded.append(padded_rows([rows[i][1] for i in group[start:start + count]], members[k].loss, width,
                                  worker.tok.pad_id, device))
        start += count
    ids_BT, mask_BT, targets_BT = (torch.cat([p[j] for p in padded]) for j in range(3))
    token_runs = [(k, int(p[1].sum())) for (k, _), p in zip(runs, padded)]  # the output layer's inputs: kept positions

    def head_routed(lo: int, hi: int):
        return routes.routed(_clipped(token_runs, lo, hi), dims=2)

    with routes.routed(runs, dims=3, row_tokens=ids_BT.shape[1]):  # a sparse block's layers see rows' tokens
        logp_BT = worker.token_logprobs(ids_BT, mask_BT, targets_BT, head_routed)
        losses, start = [], 0
        for (k, count), (_, _, _, inputs) in zip(runs, padded):
            member, rows_slice = members[k], slice(start, start + count)
            losses.append(member.loss.summed(logp_BT[rows_slice], mask_BT[rows_slice], inputs, member.config))
            start += count
        if train:
            torch.stack(losses).sum().backward()
    logp = logp_BT.detach().float().cpu().numpy()
    for row, i in enumerate(group):
        k, datum = rows[i]
        members[k].outputs[i - first_row[k]] = logp[row, :len(datum.tokens)].copy()
    for (k, _), summed in zip(runs, losses):
        members[k].total += float(summed.detach())


def _clipped(runs: Runs, lo: int, hi: int) -> Runs:
    """The runs over positions lo..hi of the positions the runs cover."""
    clipped, start = [], 0
    for k, count in runs:
        overlap = min(hi, start + count) - max(lo, start)
        if overlap > 0:
            clipped.append((k, overlap))
        start += count
    return clipped
