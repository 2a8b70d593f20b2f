"""Mixture of LoRA experts (MoLoRA) on one frozen base: each adapted linear layer carries N LoRA experts and a
router that mixes them.

    out = base(x) + sum_e gate_e * (alpha / rank) * B_e @ A_e @ x

Expert weights are stored batched (A: [E, r, in], or one shared [r, in] with `hydra`; B: [E, out, r], zero at
start so a fresh MoLoRA equals the base exactly) and computed in one pass over all experts (two einsums; an
unselected expert has gate 0 and contributes exactly 0). Adapter weights and routers are float32.

Routers (one per adapted module, `nn.Linear(D, E, bias=False)` on an RMS-normalised input; routing.py):
- "token": each token is routed from its own input x to that module (D = in_features).
- "sequence": each sequence is routed once from its prompt. The routing input is the prompt summary, the
  mean of the base's (frozen) input embeddings over the prompt tokens (D = hidden size). The caller sets it
  on the model (`sequence_routing(model, summary_BD)` / `routing_from_prompts(model, prompts)`, model.py)
  around every forward that belongs to those sequences: prefill and each decoding step when sampling, the
  one forward over prompt + completion when training. Every module reads the same summary, so the gates are
  the same in both paths whatever the module sees (the whole sequence or one new token with a KV cache).

docs/molora.md has the formulas and the saved format.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlora.config import MoLoRAConfig
from rlora.models.molora.routing import RouterRecord, RoutingState, rms_normalize, route

PARAM_TAG = ".molora_"  # every MoLoRA parameter name contains it (molora_A, molora_B, molora_router.weight)


def mixture_delta(x_XI: torch.Tensor, A: torch.Tensor, B_EOR: torch.Tensor, gates_XE: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """[X, O] = scale * sum_e gates[x, e] * B_e @ A_e @ x, all experts at once. A: [E, r, I] per expert or
    [r, I] shared (hydra)."""
    if A.dim() == 2:
        h_XER = (x_XI @ A.T)[:, None, :] * gates_XE[:, :, None]
    else:
        h_XER = torch.einsum("xi,eri->xer", x_XI, A) * gates_XE[:, :, None]
    return torch.einsum("xer,eor->xo", h_XER, B_EOR) * scale


class MoLoRALinear(nn.Module):
    """A frozen nn.Linear plus N LoRA experts mixed by a router. Input [B, T, in] or [B, in] (B sequences of
    one token, e.g. a sampler's decoding step); the sequence router needs the state's summary for those B
    rows."""

    def __init__(self, base: nn.Linear, config: MoLoRAConfig, state: RoutingState | None = None,
                 summary_dim: int | None = None):
        super().__init__()
        self.base_layer = base
        self.state = state or RoutingState(config)
        self.in_features, self.out_features = base.in_features, base.out_features
        E, r, device = config.num_experts, config.rank, base.weight.device
        a_shape = (r, self.in_features) if config.hydra else (E, r, self.in_features)
        bound = 1.0 / math.sqrt(self.in_features)  # as peft's kaiming_uniform(a=sqrt(5)) on each A_e
        self.molora_A = nn.Parameter(torch.empty(a_shape, device=device).uniform_(-bound, bound))
        self.molora_B = nn.Parameter(torch.zeros(E, self.out_features, r, device=device))
        router_in = self.in_features if config.router == "token" else (summary_dim or self.in_features)
        self.molora_router = nn.Linear(router_in, E, bias=False, device=device, dtype=torch.float32)
        nn.init.normal_(self.molora_router.weight, 0.0, config.router_init_std)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.last: RouterRecord | None = None

    @property
    def config(self) -> MoLoRAConfig:
        return self.state.config

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def get_base_layer(self) -> nn.Linear:
        return self.base_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self.state.disabled:
            return out
        dtype = self.molora_A.dtype  # float32 unless the caller cast the model
        x_XI = x.reshape(-1, self.in_features).to(dtype)
        gates_XE = self._gates(x, x_XI).to(dtype)
        delta_XO = mixture_delta(self.dropout(x_XI), self.molora_A, self.molora_B, gates_XE, self.config.scale)
        return out + delta_XO.view(out.shape).to(out.dtype)

    def _gates(self, x: torch.Tensor, x_XI: torch.Tensor) -> torch.Tensor:
        """[X, E] gates of the X tokens of x; records the routing of this forward."""
        per_token = self.config.router == "token"
        logits_UE = self.router_logits(x_XI if per_token else self._summary(x))
        gates_UE, chosen_UK = route(logits_UE, self.config.top_k, self.config.renormalize)
        self.last = RouterRecord(logits_UE, chosen_UK, gates_UE, per_token)
        if per_token:
            return gates_UE
        tokens_per_row = x_XI.shape[0] // x.shape[0]
        return gates_UE.repeat_interleave(tokens_per_row, dim=0)

    def router_logits(self, units_UD: torch.Tensor) -> torch.Tensor:
        """[U, E] router logits of U routing inputs (tokens' inputs, or prompt summaries)."""
        return self.molora_router(rms_normalize(units_UD.to(self.molora_router.weight.dtype)))

    def _summary(self, x: torch.Tensor) -> torch.Tensor:
        summary_BD = self.state.summary_BD
        if summary_BD is None:
            raise RuntimeError("MoLoRA sequence routing needs the prompts: run the model inside "
                               "`with sequence_routing(model, summary_BD)` (or routing_from_prompts)")
        if x.dim() not in (2, 3) or summary_BD.shape[0] != x.shape[0]:
            raise RuntimeError(f"MoLoRA sequence routing: input {tuple(x.shape)} has {x.shape[0]} rows, the "
                               f"routing summary {summary_BD.shape[0]} (expand it as the batch is expanded)")
        return summary_BD.to(device=x.device)

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"in={self.in_features}, out={self.out_features}, experts={cfg.num_experts}, rank={cfg.rank}, "
                f"router={cfg.router}, top_k={cfg.top_k}, hydra={cfg.hydra}")
