"""The routers' auxiliary losses and metrics of one forward: load balancing (Switch Transformer, top-k
assignments), router z-loss (ST-MoE), entropy and expert utilisation, on plain tensors and summed over a model's
MoLoRA modules. A batch run as several forwards uses batch_aux.py, which adds the forwards up to these.
docs/molora.md has the formulas."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlora.models.molora.model import molora_modules, routing_state
from rlora.models.molora.routing import RouterRecord

# ---- pure math ---------------------------------------------------------------------------------------------

def unit_weights(count: int, mask_U: torch.Tensor | None, device) -> torch.Tensor:
    """[U] float weights of the routing units: 1 each, or the mask (0 = padding, excluded)."""
    if mask_U is None:
        return torch.ones(count, device=device)
    return mask_U.reshape(-1).to(device=device, dtype=torch.float32)


def _masked_mean(values_U: torch.Tensor, weights_U: torch.Tensor) -> torch.Tensor:
    return (values_U * weights_U).sum(0) / weights_U.sum().clamp_min(1.0)


def expert_utilisation(chosen_UK: torch.Tensor, num_experts: int, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """[E] f_e: the share of the (unmasked) routing assignments that go to expert e (sums to 1; each unit
    makes top_k assignments). No gradient."""
    weights_U = unit_weights(chosen_UK.shape[0], mask_U, chosen_UK.device)
    hits_UE = F.one_hot(chosen_UK, num_experts).sum(1).float()
    return _masked_mean(hits_UE, weights_U[:, None]) / chosen_UK.shape[1]


def balance_loss(logits_UE: torch.Tensor, chosen_UK: torch.Tensor, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer load balancing, N * sum_e f_e * P_e: f_e = expert_utilisation (top-k assignments,
    no gradient), P_e = mean softmax probability of e; both over unmasked units. 1 when balanced."""
    num_experts = logits_UE.shape[-1]
    weights_U = unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
    f_E = expert_utilisation(chosen_UK, num_experts, mask_U)
    P_E = _masked_mean(logits_UE.float().softmax(-1), weights_U[:, None])
    return num_experts * (f_E * P_E).sum()


def z_loss(logits_UE: torch.Tensor, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss: mean over unmasked units of logsumexp(logits)^2."""
    weights_U = unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
    return _masked_mean(torch.logsumexp(logits_UE.float(), -1).pow(2), weights_U)


def router_entropy(logits_UE: torch.Tensor, mask_U: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over unmasked units of the entropy (nats) of the full softmax over experts."""
    weights_U = unit_weights(logits_UE.shape[0], mask_U, logits_UE.device)
    logp_UE = logits_UE.float().log_softmax(-1)
    return _masked_mean(-(logp_UE.exp() * logp_UE).sum(-1), weights_U)


# ---- on a model: its last forward ------------------------------------------------------------------------------

@dataclass
class AuxLosses:
    balance: torch.Tensor  # sum over MoLoRA modules of balance_loss
    z: torch.Tensor  # sum over MoLoRA modules of z_loss
    total: torch.Tensor  # balance_coef * balance + z_coef * z
    modules: int


def last_records(model: nn.Module) -> list[RouterRecord]:
    """Every MoLoRA module's routing in the model's last forward, in module order."""
    records = [m.last for _, m in molora_modules(model)]
    if not records or any(r is None for r in records):
        raise RuntimeError("no MoLoRA routing recorded: run a forward pass first")
    return records


def unit_mask(record: RouterRecord, attention_mask_BT: torch.Tensor | None) -> torch.Tensor | None:
    """The token mask for a token router's units (None for a sequence router: every row counts)."""
    if attention_mask_BT is None or not record.per_token:
        return None
    if attention_mask_BT.numel() != record.logits_UE.shape[0]:
        raise RuntimeError(f"attention mask {tuple(attention_mask_BT.shape)} does not match the last forward's "
                           f"{record.logits_UE.shape[0]} tokens")
    return attention_mask_BT.reshape(-1)


def collect_aux_losses(model: nn.Module, attention_mask_BT: torch.Tensor | None = None) -> AuxLosses:
    """The auxiliary losses of the last forward, summed over all MoLoRA modules; padding tokens (mask 0)
    are excluded for token routers. Differentiable (call before the next forward)."""
    config = routing_state(model).config
    records = last_records(model)
    balance = sum(balance_loss(r.logits_UE, r.chosen_UK, unit_mask(r, attention_mask_BT)) for r in records)
    z = sum(z_loss(r.logits_UE, unit_mask(r, attention_mask_BT)) for r in records)
    return AuxLosses(balance, z, config.balance_coef * balance + config.z_coef * z, len(records))


def router_metrics(model: nn.Module, attention_mask_BT: torch.Tensor | None = None) -> dict[str, float]:
    """Per-module means over the last forward: molora/balance (1 = balanced), molora/z_loss,
    molora/entropy (nats) and molora/util_<e> (share of assignments to expert e)."""
    config = routing_state(model).config
    records = last_records(model)
    with torch.no_grad():
        masks = [unit_mask(r, attention_mask_BT) for r in records]
        util_E = torch.stack([expert_utilisation(r.chosen_UK, config.num_experts, m) for r, m in zip(records, masks)])
        metrics = {
            "molora/balance": torch.stack([balance_loss(r.logits_UE, r.chosen_UK, m) for r, m in zip(records, masks)]),
            "molora/z_loss": torch.stack([z_loss(r.logits_UE, m) for r, m in zip(records, masks)]),
            "molora/entropy": torch.stack([router_entropy(r.logits_UE, m) for r, m in zip(records, masks)]),
        }
        values = {key: float(v.mean()) for key, v in metrics.items()}
        values.update({f"molora/util_{e}": float(u) for e, u in enumerate(util_E.mean(0))})
    return values
