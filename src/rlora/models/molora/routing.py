"""How a MoLoRA layer routes: the router's input (RMS-normalised), the gates (softmax over experts, top-k kept),
the routing state that every layer of one model shares, and a layer's record of its last routing (what the
auxiliary losses and metrics read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlora.config import MoLoRAConfig  # the settings: one definition, the YAML config's `molora:` section

RMS_EPS = 1e-6


def rms_normalize(x_UD: torch.Tensor) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension (no weight): the router's input."""
    return x_UD * torch.rsqrt(x_UD.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def route(logits_UE: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates_UE, chosen_UK): softmax over experts, the top_k kept (renormalised to sum 1 when asked), the
    others 0. U: routing units (tokens or sequences)."""
    probs_UE = logits_UE.float().softmax(-1)
    kept_UK, chosen_UK = probs_UE.topk(top_k, dim=-1)
    if renormalize:
        kept_UK = kept_UK / kept_UK.sum(-1, keepdim=True)
    return torch.zeros_like(probs_UE).scatter(-1, chosen_UK, kept_UK), chosen_UK


@dataclass
class RoutingState:
    """Shared by every MoLoRALinear of one model: the config, the prompt summary of the sequences being run
    (sequence router) and the off switch (the base alone, e.g. the reference policy)."""
    config: MoLoRAConfig
    summary_BD: torch.Tensor | None = None
    disabled: bool = False


@dataclass
class RouterRecord:
    """A module's routing in its last forward. Units are tokens (token router: the flattened [B, T]) or
    sequences (sequence router: the B rows)."""
    logits_UE: torch.Tensor
    chosen_UK: torch.Tensor
    gates_UE: torch.Tensor
    per_token: bool
