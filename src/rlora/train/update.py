"""One policy update from a scored rollout: micro-batched gradient accumulation, normalised by the
token/sequence counts of the whole batch, then one optimiser step (skipped if anything is non-finite)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rlora.algos.losses import BatchTotals, LossInputs, aggregate, truncated_is_weight
from rlora.algos.registry import Algorithm
from rlora.config import AlgoConfig
from rlora.models.frozen_prefix import FrozenPrefix
from rlora.models.logprobs import completion_logprobs
from rlora.models.adapters import PolicyAdapter, adapter_of
from rlora.models.multi_lora import policy_rows
from rlora.train.distributed import World, all_reduce_gradients, all_reduce_sums, all_reduce_tensor
from rlora.train.metrics import reduction_of
from rlora.train.fsdp import ZeroPasses, passes_to_add, zero_pass
from rlora.batching import trim
from rlora.tensors import pad_right
from rlora.types import Rollout


@dataclass
class ScoredRollout:
    rollout: Rollout
    advantages_BTc: torch.Tensor  # one per token, broadcast where they are made (a completion's on all its tokens)
    loss_mask_BTc: torch.Tensor  # completion mask with failed (and, if asked, truncated) samples zeroed
    old_logp_BTc: torch.Tensor | None = None  # None: the rollout is used once, old = current (detached)
    ref_logp_BTc: torch.Tensor | None = None  # None: no KL term
    # Log-probs of the policy that actually drew each token, where a truncated importance weight
    # min(pi_old / pi_behaviour, cap_B) corrects for it (bf16 sampler, replayed groups); NaN rows: weight 1.
    behaviour_logp_BTc: torch.Tensor | None = None
    is_cap_B: torch.Tensor | None = None
    fresh_B: torch.Tensor | None = None  # bool: rows sampled by this step's policy (None: all)
    policy_B: torch.Tensor | None = None  # long: each row's policy, numbered as the adapter's (None: all policy 0)
    betas: list[float] | None = None  # each policy's KL coefficient, by policy (None: cfg.beta for each)

    def __post_init__(self):
        if self.advantages_BTc.shape != self.loss_mask_BTc.shape:
            raise ValueError(f"advantages {tuple(self.advantages_BTc.shape)} are not one per token of the loss mask "
                             f"{tuple(self.loss_mask_BTc.shape)}: broadcast them where they are made (algos.advantages."
                             "per_token)")

    @property
    def rows_policy_B(self) -> torch.Tensor:
        """[B] each row's policy."""
        if self.policy_B is None:
            return torch.zeros(self.rollout.num_completions, dtype=torch.long, device=self.loss_mask_BTc.device)
        return self.policy_B

    def policy_betas(self, beta: float, num_policies: int) -> list[float]:
        """Each policy's KL coefficient (`beta` for every policy, where the rollout names none)."""
        return [beta] * num_policies if self.betas is None else self.betas


@torch.no_grad()
def batched_logprobs(model, rollout: Rollout, micro_batch_size: int, chunk_tokens: int = 256,
                     prefix: FrozenPrefix | None = None, policy_B: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of all completion tokens (no gradient, eval mode: no dropout), micro-batch by micro-batch
    -> logp_BTc. `prefix`: the rollout's hidden states after the frozen lower layers (computed once).
    policy_B: each row's policy adapter, on a model with several (models/multi_lora.py)."""
    width = rollout.completion_ids_BTc.shape[1]
    parts = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, rollout.num_completions, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            micro = trim(rollout.select(rows))
            with policy_rows(model, None if policy_B is None else policy_B[rows]):
                logp, _ = completion_logprobs(model, micro, chunk_tokens=chunk_tokens,
                                              prefix=None if prefix is None else prefix.rows(rows, micro))
            parts.append(pad_right(logp, width))  # on the model's device, as the rollout
    finally:
        model.train(was_training)
    return torch.cat(parts)


def on_device(device: torch.device):
    """tensor -> the same tensor on `device` (a no-op where it is already there)."""
    return lambda tensor: tensor.to(device, non_blocking=True)


def batch_totals(loss_mask_BTc: torch.Tensor, constant_len: int) -> BatchTotals:
    return BatchTotals(
        num_tokens=float(loss_mask_BTc.sum()),
        num_seqs=int((loss_mask_BTc.sum(-1) > 0).sum()),
        constant_len=constant_len,
        num_rows=loss_mask_BTc.shape[0],
    )


def rows_to_train(scored: ScoredRollout, loss_betas: list[float], entropy_coef: float = 0.0, every_row: bool = False
                  ) -> torch.Tensor:
    """Indices of completions whose loss can be non-zero. Without a KL term or entropy bonus, a completion
    with advantage 0 has loss exactly 0 (every algorithm's surrogate is proportional to A), so skipping its
    forward/backward changes no gradient; the normalisers still count it (BatchTotals), so the result is
    identical to training on every row. every_row: keep them (a MoLoRA router's auxiliary loss covers every
    row of the batch). loss_betas: each policy's coefficient of its KL term in the loss (a row's is its policy's)."""
    active_B = scored.loss_mask_BTc.sum(-1) > 0
    if entropy_coef == 0 and not every_row:
        moves_B = ((scored.advantages_BTc != 0) & (scored.loss_mask_BTc > 0)).any(-1)
        betas_K = torch.tensor(loss_betas, device=active_B.device)
        active_B &= moves_B | (betas_K[scored.rows_policy_B] > 0)
    return active_B.nonzero().squeeze(-1)


def importance_weight(old_BT: torch.Tensor, behaviour_BT: torch.Tensor, cap_B: torch.Tensor) -> torch.Tensor:
    """min(pi_old / pi_behaviour, cap) per token, 1 on rows without behaviour log-probs (NaN)."""
    weight_BT = truncated_is_weight(old_BT, behaviour_BT.nan_to_num(0.0), cap_B[:, None])
    return torch.where(torch.isnan(behaviour_BT), torch.ones_like(weight_BT), weight_BT)


def global_totals(world: World, totals: BatchTotals) -> BatchTotals:
    """The normalisers of the whole batch over all ranks (the first of three collectives of an update)."""
    if not world.active:
        return totals
    tokens, seqs, rows = all_reduce_sums(world, [totals.num_tokens, totals.num_seqs, totals.num_rows])
    return BatchTotals(tokens, int(seqs), totals.constant_len, int(rows))


def contribute_nothing(world: World, model, algo: Algorithm, cfg: AlgoConfig, adapter: PolicyAdapter | None = None,
                       betas: list[float] | None = None, padding: ZeroPasses | None = None) -> list[dict[str, float]]:
    """A data-parallel rank without completions this step still takes part in the update's collectives
    (normalisers, gradients, metric sums: those of accumulate_gradient_per_policy), adding zeros. -> each
    policy's update metrics over all ranks. adapter: the model's policy adapter (None: models/adapters.py
    adapter_of the model); betas: each policy's KL coefficient (None: cfg.beta for each); padding: on a sharded
    base, the passes that pair with the other ranks' (required there)."""
    adapter = adapter or adapter_of(model)
    betas = [cfg.beta] * len(adapter.names) if betas is None else betas
    for _ in adapter.names:
        global_totals(world, BatchTotals(0.0, 0, 1, 0))
    passes = passes_to_add(world, model, 0)  # train.fsdp: as many layer passes as the busiest rank
    if passes and padding is None:
        raise ValueError("a rank without rows on a sharded base needs padding passes (ZeroPasses)")
    # the auxiliary loss's sums (a MoLoRA router's), as the ranks that train compute them, and its forwards
    routing = adapter.aux_loss([], None if padding is None else padding.forward,
                               sum_over_ranks=lambda t: all_reduce_tensor(world, t),
                               padding=[] if padding is None else [padding.micro()] * passes)
    if passes:
        padding.run(passes)
    for params in adapter.parameters_per_policy():
        all_reduce_gradients(world, params)
    with_ref = max(betas) > 0  # the step passes the reference log-probs where any policy has a KL term
    results = [UpdateSums(token_metric_sums(algo, cfg, with_ref=with_ref and beta > 0)).metrics(world, num_rows=0)
               for beta in betas]
    if routing is not None:
        results[0] |= routing.metrics()
    return results


# the update's own metrics, beside the per-token ones: a loss's metric terms take other names
OWN_METRICS = ("loss", "entropy", "trained_frac", "sampler_logp_gap", "is_weight_mean")


def token_metric_sums(algo: Algorithm, cfg: AlgoConfig, with_ref: bool) -> dict[str, float | None]:
    """The update's per-token metrics, each at sum 0 (None: not measured in this run, logged as null): the loss's
    terms (TokenLosses.metrics_BT) and the entropy. The loss names its terms on a batch of no rows, so that a step
    that trains no row, and every data-parallel rank, sums the same names in the same collective."""
    none_BT = torch.zeros(0, 1)
    out = algo.token_loss(LossInputs(none_BT, none_BT, none_BT, none_BT, none_BT if with_ref else None),
                          clip_low=cfg.clip_low, clip_high=cfg.clip_high, beta=0.0)
    clash = sorted(set(out.metrics_BT) & set(OWN_METRICS))
    if clash:
        raise ValueError(f"{algo.name}'s loss reports metrics under the update's own names {clash}: rename them")
    # a term is already the whole batch's on every rank; under a name that train/metrics.py joins otherwise (a
    # count: summed, a time: the largest), torchrun would log it multiplied by the world size or wrongly weighted
    joined = sorted(name for name in out.metrics_BT if reduction_of(name) is not None)
    if joined:
        raise ValueError(f"{algo.name}'s loss reports metrics under names the ranks' metrics join as counts, times "
                         f"or weighted means {joined}: rename them")
    return {name: None if term is None else 0.0 for name, term in out.metrics_BT.items()} | {"entropy": 0.0}


class UpdateSums:
    """One policy's sums of an update's metrics over its micro-batches; `metrics` adds them over the ranks and
    divides. Every per-token metric is reduced alike: its sum over the trained tokens / their count.
    Each micro-batch's sums stay on the device (one row of _SCALARS then the measured token metrics) until
    `metrics` reads them all back at once: reading each one (`loss.item()`, ...) would stall a GPU between
    micro-batches. They are added on the host in micro-batch order, so the totals are what per-micro-batch reads
    gave: each value in its own dtype on the device (float32, or float64 for a float64 model), summed in float64."""

    _SCALARS = ("loss", "tokens", "gap", "gap_tokens", "is_weight", "weighted_tokens")

    def __init__(self, token: dict[str, float | None]):
        self.token = token  # per-token metric -> 0.0 (summed) or None (not measured; token_metric_sums)
        self.rows = 0  # trained rows
        self._measured = [name for name, total in token.items() if total is not None]
        self._parts: list[torch.Tensor] = []  # per micro-batch: [len(_SCALARS) + len(_measured)], >= float32

    def add(self, loss: torch.Tensor, mask_BT: torch.Tensor, terms_BT: dict[str, torch.Tensor], part,
            fresh_mask_BT: torch.Tensor, gap_BT: torch.Tensor | None, importance) -> None:
        """One micro-batch's (one policy's rows', `part`) loss share and masked sums of its per-token terms;
        gap (|old - sampler log-prob| over the fresh rows' trained tokens) and importance weights where given."""
        self.rows += len(mask_BT)
        zero = mask_BT.new_zeros(())
        gap, gap_tokens = (zero, zero) if gap_BT is None else \
            ((gap_BT[part] * fresh_mask_BT).sum(), fresh_mask_BT.sum())
        is_weight, weighted = (zero, zero) if importance is None else \
            ((importance[0] * importance[1]).sum(), importance[1].sum())
        values = [loss.detach(), mask_BT.sum(), gap, gap_tokens, is_weight, weighted]
        values += [(terms_BT[name][part] * mask_BT).sum() for name in self._measured]
        self._parts.append(torch.stack(_promoted(values)))

    def metrics(self, world: World, num_rows: int) -> dict:
        """The update's metrics over every rank's rows (a collective: the sums and counts are added over ranks)."""
        columns = len(self._SCALARS) + len(self._measured)
        values = torch.cat(_promoted(self._parts)).tolist() if self._parts else []  # the one read back
        totals = [0.0] * columns
        for start in range(0, len(values), columns):  # micro-batch by micro-batch, as the reads once came
            totals = [total + value for total, value in zip(totals, values[start:start + columns])]
        measured = sorted(self._measured)  # the same on every rank
        by_name = dict(zip(self._SCALARS + tuple(self._measured), totals))
        reduced = all_reduce_sums(world, [by_name[key] for key in self._SCALARS] + [self.rows, num_rows]
                                  + [by_name[name] for name in measured])
        sums = dict(zip(self._SCALARS + ("rows", "num_rows"), reduced))
        token = dict(zip(measured, reduced[len(self._SCALARS) + 2:]))
        trained = sums["tokens"]
        return {
            "loss": sums["loss"],
            **{name: token[name] / trained if trained and name in token else None for name in self.token},
            "trained_frac": sums["rows"] / max(sums["num_rows"], 1),
            "sampler_logp_gap": sums["gap"] / sums["gap_tokens"] if sums["gap_tokens"] else None,
            "is_weight_mean": sums["is_weight"] / sums["weighted_tokens"] if sums["weighted_tokens"] else None,
        }


def _promoted(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in their common dtype (exact: float32 values widen to float64 without rounding)."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return [t.detach().to(dtype) for t in tensors]


def policy_totals(world: World, scored: ScoredRollout, constant_len: int, num_policies: int) -> list[BatchTotals]:
    """The loss normalisers of each policy's rows, summed over ranks."""
    policy_B = scored.rows_policy_B
    return [global_totals(world, batch_totals(scored.loss_mask_BTc[policy_B == k], constant_len))
            for k in range(num_policies)]


def accumulate_policy_gradient(
    model, algo: Algorithm, cfg: AlgoConfig, scored: ScoredRollout, micro_batch_size: int, constant_len: int,
    chunk_tokens: int = 256, world: World = World(), prefix: FrozenPrefix | None = None,
    adapter: PolicyAdapter | None = None,
) -> dict[str, float]:
    """accumulate_gradient_per_policy for a model with one policy -> its metrics."""
    return accumulate_gradient_per_policy(model, algo, cfg, scored, micro_batch_size, constant_len, chunk_tokens, world,
                                          prefix, adapter)[0]


def accumulate_gradient_per_policy(
    model, algo: Algorithm, cfg: AlgoConfig, scored: ScoredRollout, micro_batch_size: int, constant_len: int,
    chunk_tokens: int = 256, world: World = World(), prefix: FrozenPrefix | None = None,
    adapter: PolicyAdapter | None = None,
) -> list[dict[str, float]]:
    """Backward over all micro-batches; returns the summed loss and token metrics of the batch, one dict per policy.
    Token metrics, the loss's terms (TokenLosses.metrics_BT: clip_frac, ratio_mean, kl, or what another loss
    reports) and the entropy, are means over the tokens that were trained.
    sampler_logp_gap: mean |old log-prob - sampler log-prob| over the fresh rows' trained tokens, where old
    is the trainer's log-prob of the policy that sampled (the two must agree; a gap means the rollout is
    off-policy).
    Several policies (scored.policy_B): each micro-batch is one forward of all its rows, each through its own
    adapter; each policy's loss is normalised by its own rows' counts, so the gradient each adapter receives is
    the one a run of that policy alone computes on the same rows.
    adapter: the model's policy adapter (None: models/adapters.py adapter_of the model)."""
    rollout = scored.rollout
    adapter = adapter or adapter_of(model)
    totals = policy_totals(world, scored, constant_len, len(adapter.names))
    betas = scored.policy_betas(cfg.beta, len(adapter.names))
    loss_betas = [0.0 if algo.kl_in_reward else beta for beta in betas]  # REINFORCE++ puts the KL into the reward
    rows = rows_to_train(scored, loss_betas, cfg.entropy_coef, every_row=adapter.aux_loss_every_row)
    micros = [(rows[lo:lo + micro_batch_size], trim(rollout.select(rows[lo:lo + micro_batch_size])))
              for lo in range(0, len(rows), micro_batch_size)]
    padding = passes_to_add(world, model, len(micros))  # train.fsdp: as many layer passes as the busiest rank
    # the auxiliary loss over the whole batch and its metrics (a MoLoRA router's; None: the policy has none)
    routing = adapter.aux_loss([micro for _, micro in micros],
                               lambda micro: completion_logprobs(model, micro, chunk_tokens=chunk_tokens),
                               sum_over_ranks=(lambda t: all_reduce_tensor(world, t)) if world.active else None,
                               padding=[trim(rollout.select(slice(0, 1)))] * padding)
    # a policy's kl only where its own loss has a KL term, as when it runs alone (the others' reference ran)
    sums = [UpdateSums(token_metric_sums(algo, cfg, scored.ref_logp_BTc is not None and beta > 0)) for beta in betas]
    sampled = rollout.sampling_logp_BTc
    fresh_B = scored.fresh_B if scored.fresh_B is not None else \
        torch.ones(rollout.num_completions, dtype=torch.bool, device=scored.loss_mask_BTc.device)
    policy_B = scored.rows_policy_B
    policies, rows_list = policy_B.tolist(), rows.tolist()  # each row's policy on the host, read back once
    for start, (index, micro) in zip(range(0, len(rows_list), micro_batch_size), micros):
        width = micro.completion_ids_BTc.shape[1]
        micro_policy = policy_B[index]
        with adapter.rows(micro_policy):
            logp_BT, entropy_BT = completion_logprobs(model, micro, with_entropy=True, chunk_tokens=chunk_tokens,
                                                      entropy_grad=cfg.entropy_coef > 0,
                                                      prefix=None if prefix is None else prefix.rows(index, micro))
            here = on_device(logp_BT.device)  # a no-op for a step's rollout (on the model's device from sampling on)
            mask_BT = here(scored.loss_mask_BTc[index, :width]).float()
            old = here(scored.old_logp_BTc[index, :width]) if scored.old_logp_BTc is not None else logp_BT.detach()
            ref = here(scored.ref_logp_BTc[index, :width]) if scored.ref_logp_BTc is not None else None
            is_weight, weighted_BT = None, None
            if scored.behaviour_logp_BTc is not None:
                behaviour_BT = here(scored.behaviour_logp_BTc[index, :width])
                is_weight = importance_weight(old, behaviour_BT, here(scored.is_cap_B[index]))
                weighted_BT = mask_BT * (~torch.isnan(behaviour_BT))
            inputs = LossInputs(logp_BT, old, here(scored.advantages_BTc[index, :width]), mask_BT, ref, is_weight)
            # each policy's own beta: its KL term is added per policy below, as token_loss adds it
            out = algo.token_loss(inputs, clip_low=cfg.clip_low, clip_high=cfg.clip_high, beta=0.0)
            parts = _policy_parts([policies[r] for r in rows_list[start:start + micro_batch_size]], mask_BT.device)
            losses = [aggregate(_policy_loss_BT(out, entropy_BT, part, loss_betas[k], cfg.entropy_coef), mask_BT[part],
                                cfg.loss_agg, totals[k])
                      for k, part in parts]
            loss = losses[0] if len(losses) == 1 else torch.stack(losses).sum()
            (loss if routing is None else loss + routing.aux_share(micro)).backward()
        terms_BT = out.metrics_BT | {"entropy": entropy_BT.detach()}
        gap_BT = None if sampled is None else (old - here(sampled[index, :width])).abs()
        fresh_mask_BT = mask_BT * here(fresh_B[index, None])
        for (k, part), part_loss in zip(parts, losses):
            sums[k].add(part_loss, mask_BT[part], terms_BT, part, fresh_mask_BT[part], gap_BT,
                        None if is_weight is None else (is_weight[part], weighted_BT[part]))
    for _ in range(padding):
        zero_pass(model, rollout, chunk_tokens, prefix, scored.policy_B)
    # each rank's loss is over global counts: sum; each policy's apart (a policy that trained no row on any rank
    # keeps no gradient and skips its optimizer step, as in one process)
    for params in adapter.parameters_per_policy():
        all_reduce_gradients(world, params)
    results = [policy_sums.metrics(world, int((policy_B == k).sum())) for k, policy_sums in enumerate(sums)]
    if routing is not None:
        results[0] |= routing.metrics()
    return results


def _policy_loss_BT(out, entropy_BT: torch.Tensor, part, beta: float, entropy_coef: float) -> torch.Tensor:
    """A policy's rows of the token losses: + beta x KL (a policy's own beta), - entropy_coef x entropy."""
    loss_BT = out.loss_BT[part]
    if beta and out.kl_BT is not None:
        loss_BT = loss_BT + beta * out.kl_BT[part]
    return loss_BT - entropy_coef * entropy_BT[part] if entropy_coef else loss_BT


def _policy_parts(micro_policy: list[int], device: torch.device) -> list[tuple[int, slice | torch.Tensor]]:
    """(policy, its rows of the micro-batch) for each policy present, from the rows' policies on the host (no read
    back between a micro-batch's forward and its backward); rows of one policy: all rows, no copy."""
    if len(set(micro_policy)) == 1:
        return [(micro_policy[0], slice(None))]
    return [(k, torch.tensor([j for j, p in enumerate(micro_policy) if p == k], device=device))
            for k in sorted(set(micro_policy))]
