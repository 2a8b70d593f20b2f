"""A batch run as several forwards (micro-batches, and data-parallel ranks): its routing statistics summed over
the forwards (RouterStats) and the routers' auxiliary loss of the whole batch (BatchAuxLoss). BatchAuxLoss is
the one implementation that `rlora sft` and the RL update both use, through the policy-adapter protocol
(models/adapters.py MoLoRA: batch_aux_loss for an SFT batch, aux_loss -> molora_runtime.py RolloutRouting for
rollout rows)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rlora.models.molora.aux_loss import AuxLosses, last_records, unit_mask, unit_weights
from rlora.models.molora.model import molora_modules, routing_state
from rlora.models.molora.routing import route

SumOverRanks = Callable[[torch.Tensor], torch.Tensor]  # a flat tensor -> its sum over the ranks (a collective)


class RouterStats:
    """Per-module sums over the routing units of one or several forwards (the micro-batches of one batch):
    top-k assignments per expert, softmax probabilities, logsumexp^2, entropy, and the unit count (the same for
    every module). `metrics()` equals `router_metrics` of the whole batch in one forward, and `utilisation()`
    its f_e, whatever the micro-batching."""

    def __init__(self, num_experts: int, top_k: int):
        self.num_experts, self.top_k = num_experts, top_k
        self.hits_ME: torch.Tensor | None = None
        self.probs_ME: torch.Tensor | None = None
        self.z_M: torch.Tensor | None = None
        self.entropy_M: torch.Tensor | None = None
        self.units = 0.0

    @classmethod
    def for_model(cls, model: nn.Module) -> RouterStats:
        config = routing_state(model).config
        return cls(config.num_experts, config.top_k)

    @torch.no_grad()
    def add(self, units: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> None:
        """Add one forward: per module (logits_UE, chosen_UK, mask_U or None)."""
        sums, count = [], None
        for logits_UE, chosen_UK, mask_U in units:
            w_U = unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
            count = float(w_U.sum()) if count is None else count  # every module sees the same units
            logp_UE = logits_UE.float().log_softmax(-1)
            sums.append((
                (F.one_hot(chosen_UK, self.num_experts).sum(1).float() * w_U[:, None]).sum(0),
                (logp_UE.exp() * w_U[:, None]).sum(0),
                (torch.logsumexp(logits_UE.float(), -1).pow(2) * w_U).sum(),
                (-(logp_UE.exp() * logp_UE).sum(-1) * w_U).sum(),
            ))
        hits, probs, z, entropy = (torch.stack(column) for column in zip(*sums))
        if self.hits_ME is None:
            self.hits_ME, self.probs_ME, self.z_M, self.entropy_M = hits, probs, z, entropy
        else:
            self.hits_ME += hits
            self.probs_ME += probs
            self.z_M += z
            self.entropy_M += entropy
        self.units += count

    def add_forward(self, model: nn.Module, attention_mask_BT: torch.Tensor | None = None) -> None:
        """Add the model's last forward (padding excluded for token routers, as in collect_aux_losses)."""
        self.add([(r.logits_UE, r.chosen_UK, unit_mask(r, attention_mask_BT)) for r in last_records(model)])

    def add_summaries(self, model: nn.Module, summary_BD: torch.Tensor) -> None:
        """Add the routing that sequence routers give these prompt summaries, without running the model (their
        gates depend on the summary alone)."""
        modules = molora_modules(model)
        if modules[0][1].config.router != "sequence":
            raise RuntimeError("add_summaries needs sequence routers; a token router's routing needs a forward")
        with torch.no_grad():
            units = []
            for _, module in modules:
                logits_UE = module.router_logits(summary_BD.to(module.molora_router.weight.device))
                units.append((logits_UE, route(logits_UE, self.top_k)[1], None))
        self.add(units)

    def summed(self, sum_over_ranks: SumOverRanks, num_modules: int) -> RouterStats:
        """The sums of every data-parallel rank; a rank that routed nothing adds zeros."""
        M, E = num_modules, self.num_experts
        if self.hits_ME is None:
            parts = [torch.zeros(M, E), torch.zeros(M, E), torch.zeros(M), torch.zeros(M)]
        else:
            parts = [self.hits_ME, self.probs_ME, self.z_M, self.entropy_M]
        flat = torch.cat([p.float().cpu().reshape(-1) for p in parts] + [torch.tensor([float(self.units)])])
        total = sum_over_ranks(flat).cpu()
        out = RouterStats(self.num_experts, self.top_k)
        hits, probs, z, entropy, units = total.split([M * E, M * E, M, M, 1])
        out.hits_ME, out.probs_ME, out.z_M, out.entropy_M = hits.view(M, E), probs.view(M, E), z, entropy
        out.units = float(units)
        return out

    def utilisation(self) -> torch.Tensor:
        """[M, E] f_e of every module over all the units added (no gradient)."""
        if self.hits_ME is None:
            raise RuntimeError("RouterStats: nothing added yet")
        return self.hits_ME / (self.top_k * max(self.units, 1.0))

    def metrics(self) -> dict[str, float]:
        """router_metrics over all the units added: per-module means of balance, z-loss, entropy, utilisation."""
        units = max(self.units, 1.0)
        f_ME = self.utilisation()
        values = {
            "molora/balance": float((self.num_experts * (f_ME * self.probs_ME / units).sum(-1)).mean()),
            "molora/z_loss": float((self.z_M / units).mean()),
            "molora/entropy": float((self.entropy_M / units).mean()),
        }
        values.update({f"molora/util_{e}": float(u) for e, u in enumerate(f_ME.mean(0))})
        return values


def batch_aux_losses(model: nn.Module, utilisation_ME: torch.Tensor, batch_units: float,
                     attention_mask_BT: torch.Tensor | None = None) -> AuxLosses:
    """The last forward's share of a batch's auxiliary losses, where the batch runs as several forwards
    (micro-batches). With f_e the whole batch's utilisation (RouterStats.utilisation, from a pass over the
    batch) and W its unit count (rows for sequence routers, unpadded tokens for token routers):

        balance share = sum_modules N * sum_e f_e * sum_{u in this forward} w_u p_u[e] / W
        z share       = sum_modules sum_{u in this forward} w_u logsumexp(logits_u)^2 / W

    Summed over the batch's forwards these are collect_aux_losses of the whole batch in one forward (value and
    gradient), so how the batch is split does not change them."""
    config = routing_state(model).config
    records = last_records(model)
    if utilisation_ME.shape != (len(records), config.num_experts):
        raise RuntimeError(f"utilisation {tuple(utilisation_ME.shape)} does not match {len(records)} modules x "
                           f"{config.num_experts} experts")
    balance = z = 0.0
    for record, f_E in zip(records, utilisation_ME):
        logits_UE = record.logits_UE.to(torch.promote_types(record.logits_UE.dtype, torch.float32))  # >= float32
        w_U = unit_weights(logits_UE.shape[0], unit_mask(record, attention_mask_BT), logits_UE.device)
        P_sum_E = (logits_UE.softmax(-1) * w_U[:, None]).sum(0)
        balance = balance + config.num_experts * (f_E.to(P_sum_E.device) * P_sum_E).sum() / batch_units
        z = z + (torch.logsumexp(logits_UE, -1).pow(2) * w_U).sum() / batch_units
    return AuxLosses(balance, z, config.balance_coef * balance + config.z_coef * z, len(records))


class BatchAuxLoss:
    """The routers' auxiliary loss of one batch run as several forwards (micro-batches, and data-parallel ranks),
    equal in value and gradient to collect_aux_losses of the whole batch in one forward, and the router metrics
    of the whole batch. After each micro-batch's training forward, `share(mask)` is its part of that loss (to add
    to its loss before backward); `metrics()` at the end.

    Units: rows for a sequence router, unpadded tokens for a token router. Each forward's sums are divided by W,
    the unit count of the whole batch (batch_aux_losses). The balance loss's utilisation f_e (no gradient) is the
    whole batch's and is known before the first backward:
    - one forward in one process: from that forward itself;
    - otherwise, with balance_coef > 0, from a routing pass first: a sequence router's gates depend on the prompt
      summaries alone (no forward); a token router needs one no-grad forward of each micro-batch.
    So micro_batch_size does not change the gradient.

    Data parallel (sum_over_ranks: a flat tensor -> its sum over the ranks, a collective): W and f_e are those of
    every rank's rows together (the routing pass then always runs), so the ranks' shares, whose gradients the
    caller sums, add up to the one-process loss; metrics() sums over the ranks too. Every rank constructs one (a
    rank without rows too, with no masks) and calls metrics(), in the same order."""

    def __init__(self, model: nn.Module, masks_BT: Sequence[torch.Tensor],
                 prompt_summaries: Callable[[], torch.Tensor], routing_forward: Callable[[int], object],
                 sum_over_ranks: SumOverRanks | None = None, padding_forwards: int = 0):
        """masks_BT: each micro-batch's attention mask (1 = a real token), in the order of the forwards.
        prompt_summaries(): [rows of all micro-batches, D], their prompt summaries (read for a sequence router).
        routing_forward(i): a forward of micro-batch i in its routing context (run here under no_grad, for a
        token router). padding_forwards: forwards a token router's routing pass adds after its own, uncounted,
        i = len(masks_BT) and on (a sharded base: as many passes as the busiest rank, train/fsdp.py)."""
        self.model, self.sum_over_ranks, self.padding_forwards = model, sum_over_ranks, padding_forwards
        config = routing_state(model).config
        sequence = config.router == "sequence"
        self.units = float(sum(m.shape[0] for m in masks_BT) if sequence else sum(float(m.sum()) for m in masks_BT))
        if sum_over_ranks is not None:
            self.units = float(sum_over_ranks(torch.tensor([self.units]))[0])
        self.stats = RouterStats.for_model(model)  # of the training forwards: the metrics
        self.aux_total = 0.0
        self.utilisation: torch.Tensor | None = None  # the batch's f_e; None: from the training forward itself
        if config.balance_coef > 0 and (len(masks_BT) > 1 or sum_over_ranks is not None):
            self.utilisation = self._routing_pass(masks_BT, sequence, prompt_summaries, routing_forward)

    def _routing_pass(self, masks_BT: Sequence[torch.Tensor], sequence: bool,
                      prompt_summaries: Callable[[], torch.Tensor], routing_forward: Callable[[int], object]):
        """[M, E] f_e of the whole batch (every rank's)."""
        stats = RouterStats.for_model(self.model)
        if sequence and masks_BT:
            stats.add_summaries(self.model, prompt_summaries())
        elif not sequence:
            with torch.no_grad():
                for index, mask_BT in enumerate(masks_BT):
                    routing_forward(index)
                    stats.add_forward(self.model, mask_BT)
                device = molora_modules(self.model)[0][1].molora_A.device
                # padding: the random state put back (the experts' dropout), as train/fsdp.py zero_pass does
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                    for index in range(len(masks_BT), len(masks_BT) + self.padding_forwards):
                        routing_forward(index)
        if self.sum_over_ranks is not None:
            stats = stats.summed(self.sum_over_ranks, len(molora_modules(self.model)))
        return stats.utilisation()

    def share(self, mask_BT: torch.Tensor) -> torch.Tensor:
        """After a micro-batch's training forward (mask_BT: its attention mask): its share of the batch's
        auxiliary loss."""
        mask_BT = mask_BT.to(molora_modules(self.model)[0][1].molora_A.device)  # where the records are
        self.stats.add_forward(self.model, mask_BT)
        utilisation = self.stats.utilisation() if self.utilisation is None else self.utilisation
        aux = batch_aux_losses(self.model, utilisation, self.units, mask_BT).total
        self.aux_total += aux.item()
        return aux

    def metrics(self) -> dict[str, float]:
        """aux_loss (the batch's) and the router metrics of the whole batch; {} when no rank routed anything."""
        stats, aux_total = self.stats, self.aux_total
        if self.sum_over_ranks is not None:
            stats = stats.summed(self.sum_over_ranks, len(molora_modules(self.model)))
            aux_total = float(self.sum_over_ranks(torch.tensor([aux_total], dtype=torch.float64))[0])
        return {"aux_loss": aux_total, **stats.metrics()} if stats.hits_ME is not None and stats.units else {}
